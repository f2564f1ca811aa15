"""Environment configuration, validated at boot.

``WORKER_POOL`` names a pool of pools.toml, which supplies the defaults of the
other ``WORKER_*`` variables; the environment overrides them. A bad value refuses
to boot: :func:`load_settings` prints one line per bad variable (its name, the
value's problem and the rule) and exits with ``EX_CONFIG`` (78), no traceback.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from . import contract
from .boards import DEFAULT_STALLED_AFTER_S, default_state_dir
from .exitcodes import EX_CONFIG
from .layout import Gate, admission_lease_ms
from .pools import (
    POOLS_FILE_ENV,
    Concurrency,
    DbPoolSize,
    Downstream,
    JobTimeoutMs,
    MaxAttempts,
    Pool,
    PoolsFile,
    PoolsFileError,
    Prefetch,
    PriorityBound,
    Processes,
    ShutdownTimeoutMs,
    derived_env_defaults,
    effective_downstreams,
    load_pools,
    pool_holds_every_handler,
    prefetch_feeds_every_thread,
    timing_problems,
)
from .redisclient import url_problem
from .service import current

logger = logging.getLogger(__name__)

#: The downstream resource of pools.toml that DATABASE_URL points at: a service that declares
#: it (``[downstream.postgres]``) uses the database (the bake's database option).
DATABASE_RESOURCE = "postgres"

_SECRET_FIELDS = {"redis_url", "database_url"}
#: Days a dead letter is kept before the worker deletes it (the runbook's rule).
DLQ_RETENTION_DAYS = 14

# Rules of the variables every process of the service reads (the worker's, the scheduler's),
# stated once: both settings classes type these fields with them.
MetricsPort = Annotated[int, Field(ge=1024, le=65535)]
StalledAfterS = Annotated[float, Field(gt=0, le=86_400)]
ServiceName = Annotated[str, Field(min_length=1, max_length=100)]
LogLevel = Annotated[str, Field(pattern=r"^(DEBUG|INFO|WARNING|ERROR)$")]
#: ``MAX_MESSAGE_BYTES`` when unset: 10 MiB (a message is a job's arguments, not its data).
DEFAULT_MAX_MESSAGE_BYTES = 10 * 1024 * 1024
MaxMessageBytes = Annotated[int, Field(ge=1024, le=512 * 1024 * 1024)]
#: ``RESULT_TTL_MS`` when unset: Dramatiq's default, 10 minutes.
DEFAULT_RESULT_TTL_MS = 600_000
#: ``RESULT_MAX_BYTES`` when unset: 1 MiB (a result is a summary, not the job's data).
DEFAULT_RESULT_MAX_BYTES = 1024 * 1024
#: Port of /metrics, /livez and /readyz when ``METRICS_PORT`` is unset.
DEFAULT_METRICS_PORT = contract.METRICS_PORT
#: ``LOG_LEVEL`` when unset.
DEFAULT_LOG_LEVEL = "INFO"
#: ``LOG_FORMAT``: ``json`` lines (the default, for production) or ``console`` (at a desk).
LogFormat = Literal["json", "console"]
DEFAULT_LOG_FORMAT: LogFormat = "json"


def mask_url(url: str) -> str:
    """``url`` with its passwords replaced by ``***`` (even when the rest is malformed): the
    userinfo's, and a query option named like ``*password`` (``?sentinel_password=``)."""
    parts = original = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.split(":", 1)[0]
        parts = parts._replace(netloc=f"{user}:***@{host}")
    if "password" in parts.query:
        query = [
            (name, "***" if name.endswith("password") else value)
            for name, value in parse_qsl(parts.query, keep_blank_values=True)
        ]
        parts = parts._replace(query=urlencode(query, safe="*"))
    return url if parts == original else urlunsplit(parts)


class WorkerSettings(BaseSettings):
    """The runtime's configuration (a service's ``Settings`` adds its own variables). Field
    ``x_y`` is read from env variable ``X_Y``."""

    # The docstring under each field is its description (README's configuration table).
    model_config = SettingsConfigDict(
        case_sensitive=False, extra="ignore", frozen=True, use_attribute_docstrings=True
    )

    worker_pool: str
    """Pool of pools.toml this process runs; supplies the WORKER_* defaults."""
    worker_queues: Annotated[list[str], NoDecode]
    """Comma list of queues served, all of this pool."""
    worker_concurrency: Concurrency
    """Handler threads per process."""
    worker_processes: Processes
    """Worker processes per container."""
    worker_job_timeout_ms: JobTimeoutMs
    """Hard limit per job; below WORKER_SHUTDOWN_TIMEOUT_MS."""
    worker_shutdown_timeout_ms: ShutdownTimeoutMs
    """Drain window after SIGTERM; below the pod's grace period."""
    worker_max_attempts: MaxAttempts
    """Deliveries, crashes included, before a message is dead-lettered."""
    worker_prefetch: Prefetch
    """Messages a process holds, running or waiting; unset: WORKER_CONCURRENCY."""
    worker_priority_bound: PriorityBound
    """A waiting job is passed over by at most this many jobs of higher priority lanes."""
    worker_heartbeat_timeout_ms: Annotated[int, Field(ge=2_000, le=600_000)] = 30_000
    """How long a silent worker keeps its messages before others recover them."""
    worker_state_dir: Path = Field(default_factory=default_state_dir)
    """Local state (boards, metrics), one per pool; full or read-only: exit 78."""
    health_stalled_after_s: StalledAfterS = DEFAULT_STALLED_AFTER_S
    """Liveness fails when a handler makes no progress for this long; unset: the job timeout
    plus 30 s (``contract.liveness_threshold_s``, the rule of worker_infra's probes)."""
    metrics_port: MetricsPort = DEFAULT_METRICS_PORT
    """Port of /metrics, /livez and /readyz."""
    console_in_exporter: bool = False
    """Also serve the web console under /console/ on METRICS_PORT (read-only unless
    CONSOLE_TOKEN is set); false: not served."""
    redis_url: SecretStr = SecretStr("redis://localhost:6379/0")
    """The broker: redis://, rediss:// (TLS), unix:// or
    redis+sentinel://host:port[,host:port...]/<service>[/<db>][?sentinel_password=...];
    passwords are masked."""
    max_message_bytes: MaxMessageBytes = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message accepted: bigger sends are refused, bigger fetches dead-lettered."""
    redis_allow_eviction: bool = False
    """Boot on a Redis whose maxmemory-policy is not noeviction (it then drops queued
    messages when full); false: refuse to boot (exit 78)."""
    redis_require_persistence: bool = False
    """Refuse to boot (exit 78) on a Redis with neither AOF nor RDB save points (a restart
    loses every queued message); false: not checked."""
    dlq_retention_days: Annotated[int, Field(ge=1, le=3650)] = DLQ_RETENTION_DAYS
    """Days a dead letter is kept before the worker deletes it."""
    result_ttl_ms: Annotated[int, Field(ge=1_000, le=7 * 86_400_000)] = DEFAULT_RESULT_TTL_MS
    """How long a result of an actor with store_results=True is kept."""
    result_max_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * 1024)] = DEFAULT_RESULT_MAX_BYTES
    """Largest result stored; a bigger one is stored as an error naming its size."""
    database_url: Annotated[SecretStr | None, Field(validate_default=True)] = None
    """PostgreSQL; required by pools that use postgres; the password is masked."""
    db_pool_size: DbPoolSize
    """Connections per process; at least WORKER_CONCURRENCY."""
    otel_service_name: ServiceName = Field(default_factory=lambda: current().project)
    """Service name in logs and telemetry."""
    log_level: LogLevel = DEFAULT_LOG_LEVEL
    """DEBUG, INFO, WARNING or ERROR."""
    log_format: LogFormat = DEFAULT_LOG_FORMAT
    """json (one object per line, for production) or console (readable at a desk)."""
    sandbox_allow_uncontained_writes: bool = False
    """Removed (issue #25): true is refused. The sandbox pool never runs with neither
    Landlock nor user namespaces, where a snippet would have the worker uid's file rights
    and see the pod's processes; it refuses to boot there (exit 78, docs/sandbox.md)."""

    @model_validator(mode="before")
    @classmethod
    def _pool_defaults(cls, data: Any) -> Any:
        """Fill unset WORKER_* values from the pool that WORKER_POOL names, then each
        variable the pool leaves unset that defaults to another (``WORKER_PREFETCH``,
        ``DB_POOL_SIZE``: to ``WORKER_CONCURRENCY``) from that variable's value.

        The pool model says which variables a pool supplies (:meth:`Pool.worker_defaults`)
        and which default to another (:func:`derived_env_defaults`).
        """
        if not isinstance(data, dict):
            return data
        pool = load_pools().pools.get(str(data.get("worker_pool", "")))
        if pool is None:
            return data
        for var, value in pool.worker_defaults().items():
            if var.lower() in cls.model_fields:
                data.setdefault(var.lower(), value)
        for var, source in derived_env_defaults().items():
            if var.lower() in cls.model_fields and source.lower() in data:
                data.setdefault(var.lower(), data[source.lower()])
        job_timeout = str(data.get("worker_job_timeout_ms", ""))
        if job_timeout.isdigit():  # else the field's own check reports it
            # One liveness rule with worker_infra's probes: the job timeout and a margin.
            threshold = contract.liveness_threshold_s(int(job_timeout))
            data.setdefault("health_stalled_after_s", threshold)
        return data

    @field_validator("worker_pool")
    @classmethod
    def _known_pool(cls, value: str) -> str:
        pools = load_pools().pools
        if value not in pools:
            raise ValueError(f"not a pool of pools.toml (one of: {', '.join(pools)})")
        return value

    @field_validator("worker_queues", mode="before")
    @classmethod
    def _split_queues(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [queue.strip() for queue in value.split(",") if queue.strip()]
        return value

    @field_validator("worker_queues")
    @classmethod
    def _queues_of_pool(cls, value: list[str], info: ValidationInfo) -> list[str]:
        if not value:
            raise ValueError("must name at least one queue")
        pools = load_pools()
        pool = info.data.get("worker_pool")
        for queue in value:
            owner = pools.pool_of_queue(queue)
            if owner is None:
                raise ValueError(f"queue {queue!r} is not declared in pools.toml")
            if pool is not None and owner != pool:
                raise ValueError(
                    f"queue {queue!r} belongs to pool {owner!r}, not {pool!r} "
                    "(a queue is served by exactly one pool)"
                )
        return value

    @field_validator("worker_prefetch")
    @classmethod
    def _prefetch_feeds_every_thread(cls, value: int, info: ValidationInfo) -> int:
        concurrency = info.data.get("worker_concurrency")
        if concurrency is not None and not prefetch_feeds_every_thread(value, concurrency):
            raise ValueError(
                f"must be at least WORKER_CONCURRENCY ({concurrency}): threads would sit idle"
            )
        return value

    @field_validator("worker_shutdown_timeout_ms")
    @classmethod
    def _drain_outlasts_job(cls, value: int, info: ValidationInfo) -> int:
        job = info.data.get("worker_job_timeout_ms")
        if job is not None and timing_problems(job, value):
            raise ValueError(
                f"must exceed WORKER_JOB_TIMEOUT_MS ({job}) so a running job can finish "
                "within the drain window"
            )
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: SecretStr) -> SecretStr:
        problem = url_problem(value.get_secret_value())
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if value is None:
            pool = load_pools().pools.get(str(info.data.get("worker_pool")))
            if pool is not None and DATABASE_RESOURCE in pool.uses:
                raise ValueError(
                    f"required: pool {info.data['worker_pool']!r} uses {DATABASE_RESOURCE!r}"
                )
            return None
        parts = urlsplit(value.get_secret_value())
        if parts.scheme not in {"postgresql", "postgres"}:
            raise ValueError("must start with postgresql://")
        return value

    @field_validator("db_pool_size")
    @classmethod
    def _pool_holds_every_handler(cls, value: int, info: ValidationInfo) -> int:
        concurrency = info.data.get("worker_concurrency")
        if concurrency is not None and not pool_holds_every_handler(value, concurrency):
            raise ValueError(
                f"must be at least WORKER_CONCURRENCY ({concurrency}): "
                "every handler thread may hold a connection"
            )
        return value

    @field_validator("sandbox_allow_uncontained_writes")
    @classmethod
    def _no_uncontained_sandbox(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "true is no longer accepted: with neither Landlock nor user namespaces a "
                "snippet reaches other runs' files and the pod's processes; run the sandbox "
                "pool under gVisor or on a kernel with Landlock (docs/sandbox.md)"
            )
        return value

    @property
    def prefetch(self) -> int:
        """Messages one process holds, running or waiting (default: its concurrency)."""
        return self.worker_prefetch

    @property
    def uses_database(self) -> bool:
        """True when this pool's handlers use the database (pools.toml ``uses``)."""
        return DATABASE_RESOURCE in self.pool.uses

    @cached_property
    def pool(self) -> Pool:
        """The pools.toml entry of ``worker_pool``."""
        return load_pools().pools[self.worker_pool]

    @cached_property
    def downstreams(self) -> dict[str, Downstream]:
        """The downstream resources this pool ``uses``, with this environment's overrides
        (``DOWNSTREAM_<NAME>_CAPACITY|RESERVED|RATE``); raises :class:`PoolsFileError`
        naming each bad variable (:func:`load_settings` refuses to boot on it)."""
        return effective_downstreams(load_pools(), os.environ, self.pool.uses)

    @property
    def gates(self) -> dict[str, tuple[Gate, ...]]:
        """Each queue this process serves -> the downstream budgets its deliveries hold
        (the pool's ``uses``), enforced at the fetch (:mod:`.layout.flow`)."""
        gates = tuple(
            Gate(name, resource.budget, resource.calls_per_s or 0.0, resource.effective_burst)
            for name, resource in self.downstreams.items()
        )
        return {queue: gates for queue in self.worker_queues} if gates else {}

    @property
    def admission_lease_ms(self) -> int:
        """How long a downstream slot stays taken when nothing frees it (ms)."""
        return admission_lease_ms(self.worker_job_timeout_ms, self.worker_heartbeat_timeout_ms)

    def masked(self) -> dict[str, Any]:
        """The effective config as JSON-ready values (defaults resolved), secrets masked."""
        shown: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name in _SECRET_FIELDS and value is not None:
                value = mask_url(value.get_secret_value())
            elif isinstance(value, Path):
                value = str(value)
            shown[name.upper()] = value
        return shown

    def sources(self) -> dict[str, str]:
        """Where each value of :meth:`masked` comes from: ``environment`` (its variable is
        set), ``pool <name>`` (pools.toml supplies it) or ``default``."""
        environment = {key.upper() for key in os.environ}
        supplied = {var for var, value in self.pool.worker_defaults().items() if value is not None}
        found: dict[str, str] = {}
        for name in type(self).model_fields:
            var = name.upper()
            if var in environment:
                found[var] = "environment"
            elif var in supplied or var == "HEALTH_STALLED_AFTER_S":  # the pool's job timeout
                found[var] = f"pool {self.worker_pool}"
            else:
                found[var] = "default"
        return found


def _describe(error: dict[str, Any]) -> str:
    field = str(error["loc"][0]) if error["loc"] else "configuration"
    value = error.get("input")
    if field in _SECRET_FIELDS and isinstance(value, str | SecretStr):
        value = mask_url(value.get_secret_value() if isinstance(value, SecretStr) else value)
    shown = "unset" if error["type"] == "missing" or value is None else repr(value)
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{field.upper()}={shown}: {message}"


def config_errors(error: ValidationError | PoolsFileError) -> list[str]:
    """One line per bad variable, or per problem of pools.toml.

    When WORKER_POOL itself is bad, the variables it would have supplied are not
    reported as missing: the one line about WORKER_POOL says it all. A variable left unset
    that took its value from a bad one (``WORKER_PREFETCH`` and ``DB_POOL_SIZE`` from
    ``WORKER_CONCURRENCY``) is not reported either: only what the user set is.
    """
    if isinstance(error, PoolsFileError):
        return str(error).splitlines()
    problems: list[dict[str, Any]] = [dict(problem) for problem in error.errors()]
    bad = {str(problem["loc"][0]).upper() for problem in problems if problem["loc"]}
    bad_pool = "WORKER_POOL" in bad
    environment = {key.upper() for key in os.environ}
    derived = derived_env_defaults()

    def inherited(variable: str) -> bool:
        return variable not in environment and derived.get(variable) in bad

    return [
        _describe(problem)
        for problem in problems
        if not (bad_pool and problem["type"] == "missing" and problem["loc"] != ("worker_pool",))
        and not (problem["loc"] and inherited(str(problem["loc"][0]).upper()))
    ]


#: Prefixes of the variables this service reads: a variable with one of them that nothing
#: reads is most likely a typo, warned at boot (:func:`unknown_variables`).
OWNED_PREFIXES = ("WORKER_", "HEALTH_", "REDIS_")
#: Variables with those prefixes read outside the settings: the pools file's path, and the
#: baked Makefile's (passed through by ``make``).
OTHER_VARIABLES = (POOLS_FILE_ENV, "WORKER_STATE_ROOT", "WORKER_TEMPLATE")


def unknown_variables(
    environ: Mapping[str, str], settings: type[BaseSettings] | None = None
) -> list[str]:
    """One line per variable of ``environ`` with an owned prefix (:data:`OWNED_PREFIXES`)
    that no setting reads, naming the closest known name (``difflib``) when one is close.

    Parameters:
      environ: the environment (``os.environ``).
      settings: the settings class whose fields are the known names (default: the
        service's).
    """
    fields = (settings or current().settings_class() or WorkerSettings).model_fields
    known = sorted({name.upper() for name in fields} | set(OTHER_VARIABLES))
    lines = []
    for name in sorted(environ):
        variable = name.upper()
        if not variable.startswith(OWNED_PREFIXES) or variable in known:
            continue
        close = difflib.get_close_matches(variable, known, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{name} is not a setting of this service{hint}; it is ignored")
    return lines


def warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """Log each line of :func:`unknown_variables` once (a warning, event
    ``unknown_variable``): the worker and the scheduler call it at boot."""
    for line in unknown_variables(environ):
        logger.warning(line, extra={"event": "unknown_variable"})


class RedisSettings(BaseSettings):
    """Only ``REDIS_URL`` and ``MAX_MESSAGE_BYTES`` (and how to log, for the console): all
    that producers (an API enqueuing jobs), the ``dlq`` commands and the console need; they
    never require worker settings such as ``WORKER_POOL``."""

    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore", frozen=True)

    redis_url: SecretStr = SecretStr("redis://localhost:6379/0")
    max_message_bytes: MaxMessageBytes = DEFAULT_MAX_MESSAGE_BYTES
    log_level: LogLevel = DEFAULT_LOG_LEVEL
    log_format: LogFormat = DEFAULT_LOG_FORMAT

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: SecretStr) -> SecretStr:
        checked: SecretStr = WorkerSettings._redis_url(value)  # the worker's rule, one owner
        return checked


def load_redis_settings() -> RedisSettings:
    """``REDIS_URL`` validated, or exit 78 with one line."""
    try:
        return RedisSettings()
    except ValidationError as error:
        refuse(config_errors(error))


def load_settings() -> WorkerSettings:
    """The service's settings (its ``Settings`` class: the runtime's and its own variables),
    validated, or exit 78 with one line per bad variable (the downstream overrides of the
    pool's resources included)."""
    try:
        kind: type[WorkerSettings] = current().settings_class() or WorkerSettings
        settings = kind()  # type: ignore[call-arg]  # the values come from the environment
        settings.downstreams  # noqa: B018  (validated now, at boot)
        return settings
    except (ValidationError, PoolsFileError) as error:
        refuse(config_errors(error))


class ConfigRefused(SystemExit):
    """Exit with EX_CONFIG (no traceback, like ``sys.exit``), keeping the problems: a worker
    process hands them to its supervisor, which exits 78 with them instead of retrying."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(EX_CONFIG)
        self.lines = lines


#: Where :func:`refuse` writes instead of printing (see :func:`report_refusals_to`).
_refusal_report: Path | None = None


def report_refusals_to(path: Path) -> None:
    """Write later refusals to ``path`` instead of stderr: a worker process started by its
    supervisor, which prints the reason once for the container (one line, not two)."""
    global _refusal_report
    _refusal_report = path


def _wrote(report: Path, lines: list[str]) -> bool:
    try:
        report.write_text("".join(f"{line}\n" for line in lines))
    except OSError:
        return False
    return True


def refuse(lines: list[str]) -> NoReturn:
    """Print the configuration problems (or write them to the refusal report, when one was
    set and can be written) and exit with EX_CONFIG."""
    if _refusal_report is None or not _wrote(_refusal_report, lines):
        for line in lines:
            print(f"config error: {line}", file=sys.stderr, flush=True)
    raise ConfigRefused(lines)


def pools() -> PoolsFile:
    """pools.toml, validated (exit 78 when it is not)."""
    try:
        return load_pools()
    except PoolsFileError as error:
        refuse(config_errors(error))


def database_enabled() -> bool:
    """True when the service uses the database: pools.toml declares the
    ``[downstream.postgres]`` resource (the bake's database option)."""
    return DATABASE_RESOURCE in pools().downstream
