"""pools.toml: the pools this service runs and the downstream capacity they share.

The worker reads it at boot (``WORKER_POOL`` picks the pool that supplies the
defaults of :mod:`.settings`); ``infra/`` reads it to build one Deployment and
one scaler per pool. A malformed file is refused with the file, the key and the
problem named (:class:`PoolsFileError`).
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from . import contract
from .layout import DEFAULT_PRIORITY_BOUND, NAMESPACE, SANDBOX_NAMESPACE, SANDBOX_QUEUE
from .scheduling.schedules import Schedule, ScheduleName

# The timing rule and kill-after, re-exported for the pool model's readers (worker_infra).
from .timing import KILL_AFTER_DRAIN_S as KILL_AFTER_DRAIN_S
from .timing import timing_problems as timing_problems

POOLS_FILE_ENV = "WORKER_POOLS_FILE"
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_CPU = re.compile(r"^[0-9]+(\.[0-9]+)?m?$")
_NAME = r"^[a-z][a-z0-9_-]*$"
_BINARY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL_UNITS = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}

PositiveInt = Annotated[int, Field(ge=1)]
QueueName = Annotated[str, Field(pattern=_NAME, max_length=64)]

# Bounds of the pool-shaping numbers, stated once: the pool model and the worker's
# settings (which read the same numbers from the environment) both use these types.
Processes = Annotated[int, Field(ge=1, le=64)]
Concurrency = Annotated[int, Field(ge=1, le=256)]
JobTimeoutMs = Annotated[int, Field(ge=100, le=86_400_000)]
ShutdownTimeoutMs = Annotated[int, Field(ge=1_000, le=86_400_000)]
MaxAttempts = Annotated[int, Field(ge=1, le=100)]
Prefetch = Annotated[int, Field(ge=1, le=65_535)]
DbPoolSize = Annotated[int, Field(ge=1, le=1000)]
#: Jobs of higher priority lanes a waiting job may be passed over by (:mod:`.layout.queuelanes`).
PriorityBound = Annotated[int, Field(ge=1, le=100_000)]

#: How a pool field reaches a running pod (``json_schema_extra["reaches"]`` of each field):
#: ``"env:<VAR>"``: the worker's settings take it as the default of ``<VAR>``;
#: ``"worker"``: the worker reads it from the pools file itself;
#: ``"infra"``: only the infra program reads it (Deployment, scaler, guards).
REACHES = "reaches"
#: A pool field whose default is another field's value (``json_schema_extra["defaults_to"]``):
#: unset, ``prefetch`` and ``db_pool_size`` take the concurrency. The one statement of that
#: rule: the model (:meth:`Pool.effective`), the settings (against WORKER_CONCURRENCY,
#: :func:`derived_env_defaults`) and worker_infra (which the template's tests check against
#: :func:`derived_defaults`) resolve it from here.
DEFAULTS_TO = "defaults_to"


def _reaches(how: str, defaults_to: str | None = None) -> Any:
    extra: dict[str, Any] = {REACHES: how}
    if defaults_to is not None:
        extra[DEFAULTS_TO] = defaults_to
    return Field(json_schema_extra=extra)


def bounds(kind: Any) -> tuple[int, int]:
    """The lowest and highest value of a bounded type such as :data:`Concurrency` (its
    ``ge`` and ``le``), for a command that checks a number against it outside a model."""
    found: dict[str, int] = {}
    for meta in get_args(kind)[1:]:
        for item in getattr(meta, "metadata", [meta]):
            for key in ("ge", "le"):
                if (value := getattr(item, key, None)) is not None:
                    found[key] = int(value)
    return found["ge"], found["le"]


def memory_bytes(quantity: str) -> int:
    """Bytes of a Kubernetes memory quantity such as ``512Mi`` or ``1G``."""
    match = _QUANTITY.match(quantity)
    if match is None:
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity such as 512Mi")
    unit = match.group(2) or ""
    number = float(quantity[: len(quantity) - len(unit)])
    return int(number * _BINARY_UNITS.get(unit, _DECIMAL_UNITS.get(unit, 1)))


def cpu_millis(quantity: str) -> int:
    """Millicores of a Kubernetes CPU quantity such as ``250m`` or ``1.5``."""
    if not _CPU.match(quantity):
        raise ValueError(f"cpu {quantity!r} is not a Kubernetes CPU quantity such as 250m")
    if quantity.endswith("m"):
        return int(float(quantity[:-1]))
    return int(float(quantity) * 1000)


def prefetch_feeds_every_thread(prefetch: int, concurrency: int) -> bool:
    """``prefetch >= concurrency``: no handler thread sits idle for want of a message."""
    return prefetch >= concurrency


#: Redis connections a worker process may use beyond its consumers' and handlers' own: the
#: Recovery pass, the schedule lock's renewals, the drain's sweep, a middleware's call.
SPARE_REDIS_CONNECTIONS = 8


def redis_connections(queues: int, concurrency: int) -> int:
    """The Redis connections one worker process may hold at once, its client pool's size:
    a fetch of each queue's and each delay queue's consumer thread, two per handler thread
    (its settlement lane, and a call through the client: an enqueue from the handler, the
    lane's fallback), and :data:`SPARE_REDIS_CONNECTIONS`. redis-py's default pool stops at
    100 ("Too many connections"), which 100 queues or 50 threads would reach."""
    return 2 * queues + 2 * concurrency + SPARE_REDIS_CONNECTIONS


def pool_holds_every_handler(db_pool_size: int, concurrency: int) -> bool:
    """``DB_POOL_SIZE >= WORKER_CONCURRENCY``: every handler thread may hold a connection."""
    return db_pool_size >= concurrency


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: A rate of calls: ``<calls>/s``, ``<calls>/min`` (or ``/h``); e.g. ``100/s``, ``6000/min``.
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*/\s*(s|sec|second|min|minute|h|hour)\s*$")
_RATE_PERIOD_S = {"s": 1, "sec": 1, "second": 1, "min": 60, "minute": 60, "h": 3600, "hour": 3600}


def default_burst(calls_per_s: float) -> int:
    """The burst of a rate that names none: one second's worth, at least 1."""
    return max(1, math.ceil(calls_per_s))


def parse_rate(text: str) -> float:
    """Calls per second of a rate such as ``100/s`` or ``6000/min``; ``ValueError`` naming
    the rule when it does not parse or is not above 0."""
    match = _RATE.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a rate above 0 such as 100/s or 6000/min")
    return float(match.group(1)) / _RATE_PERIOD_S[match.group(2)]


class Downstream(_Strict):
    """A resource the handlers share, e.g. PostgreSQL connections or a partner's call limit.

    Parameters:
      capacity: what the resource can hold in total.
      reserved: held back for the API, admin and migrations (default 0).
      per_process: what one worker process holds: ``db_pool_size`` or ``concurrency``.
      rate: the calls a second (``"100/s"``, ``"6000/min"``) the resource allows across
        every pool that uses it (default: none); enforced at the fetch (:mod:`.flow`).
      burst: calls that may start at once after a quiet spell (default: one second's worth
        of ``rate``, at least 1); only with ``rate``.

    ``capacity - reserved`` is the run-time budget of jobs in flight across every process
    of every pool that ``uses`` the resource (:func:`budgets`); the infra's capacity guard
    checks the static worst case against the same number.
    """

    capacity: PositiveInt
    reserved: Annotated[int, Field(ge=0)] = 0
    per_process: contract.PerProcess = contract.PER_PROCESS_DB_POOL
    rate: str | None = None
    burst: PositiveInt | None = None

    @model_validator(mode="after")
    def _reserved_below_capacity(self) -> Downstream:
        if self.reserved >= self.capacity:
            raise ValueError(f"reserved ({self.reserved}) must be below capacity ({self.capacity})")
        if self.rate is not None:
            parse_rate(self.rate)
        elif self.burst is not None:
            raise ValueError("burst is set without a rate")
        return self

    @property
    def budget(self) -> int:
        """Jobs in flight at once across every pool using it: ``capacity - reserved``."""
        return self.capacity - self.reserved

    @property
    def calls_per_s(self) -> float | None:
        """``rate`` in calls a second (None: no rate)."""
        return None if self.rate is None else parse_rate(self.rate)

    @property
    def effective_burst(self) -> int:
        """``burst``, by default one second of ``rate`` (at least 1); 0 without a rate."""
        calls = self.calls_per_s
        if calls is None:
            burst = 0
        elif self.burst is not None:
            burst = self.burst
        else:
            burst = default_burst(calls)
        return burst


class Pool(_Strict):
    """One pool: one Deployment, one scaler, the queues it alone serves.

    Defaults: 1 process, 4 threads, 30 s job timeout, 40 s drain window,
    5 attempts, 512Mi memory, 1 to 2 replicas, a waiting job passed over by at most 10 jobs
    of higher priority (``priority_bound``, each of its queues), prefetch = concurrency (a process
    holds no message it cannot start at once, so none waits behind a long job while
    another replica is idle; raise it for very short jobs), DB pool = concurrency.

    This is the only definition of a pool's fields, bounds and defaults: the worker's
    settings take their defaults from it (fields marked ``env:``), the infra program
    validates the stack-merged file with it and mounts the result into the pods.
    """

    queues: Annotated[list[QueueName], Field(min_length=1), _reaches("env:WORKER_QUEUES")]
    processes: Annotated[Processes, _reaches("env:WORKER_PROCESSES")] = 1
    concurrency: Annotated[Concurrency, _reaches("env:WORKER_CONCURRENCY")] = 4
    job_timeout_ms: Annotated[JobTimeoutMs, _reaches("env:WORKER_JOB_TIMEOUT_MS")] = 30_000
    shutdown_timeout_ms: Annotated[
        ShutdownTimeoutMs, _reaches("env:WORKER_SHUTDOWN_TIMEOUT_MS")
    ] = 40_000
    max_attempts: Annotated[MaxAttempts, _reaches("env:WORKER_MAX_ATTEMPTS")] = 5
    prefetch: Annotated[Prefetch | None, _reaches("env:WORKER_PREFETCH", "concurrency")] = None
    db_pool_size: Annotated[DbPoolSize | None, _reaches("env:DB_POOL_SIZE", "concurrency")] = None
    memory: Annotated[str, _reaches("infra")] = "512Mi"
    cpu: Annotated[str, _reaches("infra")] = "250m"
    handler_memory: Annotated[str | None, _reaches("infra")] = None
    min_replicas: Annotated[int, Field(ge=0, le=1000), _reaches("infra")] = 1
    max_replicas: Annotated[int, Field(ge=1, le=1000), _reaches("infra")] = 2
    backlog_age_target_s: Annotated[int, Field(ge=1, le=86_400), _reaches("infra")] = 30
    priority_bound: Annotated[PriorityBound, _reaches("env:WORKER_PRIORITY_BOUND")] = (
        DEFAULT_PRIORITY_BOUND
    )
    uses: Annotated[list[str], _reaches("worker")] = []
    sandbox: Annotated[bool, _reaches("infra")] = False
    critical: Annotated[bool, _reaches("infra")] = False

    @model_validator(mode="after")
    def _consistent(self) -> Pool:
        memory_bytes(self.memory)
        if self.handler_memory is not None:
            memory_bytes(self.handler_memory)
        cpu_millis(self.cpu)
        if len(set(self.queues)) != len(self.queues):
            raise ValueError("queues lists a queue twice")
        if len(set(self.uses)) != len(self.uses):
            raise ValueError("uses lists a resource twice")
        timing = timing_problems(self.job_timeout_ms, self.shutdown_timeout_ms)
        if timing:
            raise ValueError(timing[0])
        if self.prefetch is not None and not prefetch_feeds_every_thread(
            self.prefetch, self.concurrency
        ):
            raise ValueError(
                f"prefetch ({self.prefetch}) is below concurrency ({self.concurrency}): "
                "handler threads would sit idle"
            )
        if self.db_pool_size is not None and not pool_holds_every_handler(
            self.db_pool_size, self.concurrency
        ):
            raise ValueError(
                f"db_pool_size ({self.db_pool_size}) is below concurrency ({self.concurrency}): "
                "every handler thread may hold a connection"
            )
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        if self.sandbox and self.uses:
            raise ValueError(
                f"a sandbox pool uses no downstream resource (uses {self.uses}): "
                "it reaches nothing but DNS and the broker"
            )
        if self.sandbox and self.queues != [SANDBOX_QUEUE]:
            raise ValueError(
                f"a sandbox pool serves the queue {SANDBOX_QUEUE!r} alone (queues "
                f"{self.queues}): its keys live in the broker namespace {SANDBOX_NAMESPACE!r}, "
                "the only one its Redis user may touch"
            )
        if not self.sandbox and SANDBOX_QUEUE in self.queues:
            raise ValueError(
                f"queue {SANDBOX_QUEUE!r} runs untrusted code: only a pool with "
                "sandbox = true serves it"
            )
        return self

    @property
    def broker_namespace(self) -> str:
        """The prefix of the Redis keys of this pool's queues (``layout.namespace_of``):
        ``dramatiq-sandbox`` for the sandbox pool, ``dramatiq`` for the others."""
        return SANDBOX_NAMESPACE if self.sandbox else NAMESPACE

    def effective(self, field: str) -> Any:
        """The value in effect of pool field ``field``: its own, or, unset, the value of the
        field it defaults to (:func:`derived_defaults`)."""
        value = getattr(self, field)
        source = derived_defaults().get(field)
        return getattr(self, source) if value is None and source is not None else value

    @property
    def effective_db_pool_size(self) -> int:
        """Connections per process: ``db_pool_size``, by default the pool's concurrency."""
        return int(self.effective("db_pool_size"))

    @property
    def effective_prefetch(self) -> int:
        """Messages one process holds, running or waiting: ``prefetch``, by default the
        concurrency (a process holds no message it cannot start at once)."""
        return int(self.effective("prefetch"))

    @property
    def memory_bytes(self) -> int:
        """The container memory limit in bytes."""
        return memory_bytes(self.memory)

    @property
    def handler_memory_bytes(self) -> int | None:
        """Peak bytes of one handler, None when not declared."""
        return None if self.handler_memory is None else memory_bytes(self.handler_memory)

    @property
    def cpu_millis(self) -> int:
        """The CPU request in millicores."""
        return cpu_millis(self.cpu)

    def worker_defaults(self) -> dict[str, Any]:
        """The defaults this pool gives the worker's environment variables (``env:`` fields);
        a field this pool leaves unset that defaults to another (:func:`derived_defaults`)
        is left out: the settings resolve it against the variable of that field."""
        return {
            var: getattr(self, name)
            for name, var in pool_env_fields().items()
            if getattr(self, name) is not None or name not in derived_defaults()
        }


def pool_slug(pool: str) -> str:
    """Pool ``pool``'s name as a DNS label (``_`` becomes ``-``): its pods' label value
    (``worker-template/pool``, the series label the scheduler sets on the backlog) and the
    suffix of the Kubernetes names worker_infra gives it (``PoolSpec.slug``, which the
    template's ``infra/tests/test_pool_slug.py`` checks against this)."""
    return pool.replace("_", "-")


def reaches(field: str) -> str:
    """How pool field ``field`` reaches a pod: ``env:<VAR>``, ``worker`` or ``infra``."""
    extra = Pool.model_fields[field].json_schema_extra
    if not isinstance(extra, dict) or not isinstance(extra.get(REACHES), str):
        raise LookupError(f"pool field {field!r} does not say how it reaches a pod")
    return str(extra[REACHES])


def derived_defaults() -> dict[str, str]:
    """Pool field -> the pool field whose value it takes when unset (:data:`DEFAULTS_TO`)."""
    return {
        name: str(extra[DEFAULTS_TO])
        for name, field in Pool.model_fields.items()
        if isinstance(extra := field.json_schema_extra, dict) and DEFAULTS_TO in extra
    }


def derived_env_defaults() -> dict[str, str]:
    """:func:`derived_defaults` as environment variables: ``WORKER_PREFETCH`` and
    ``DB_POOL_SIZE`` -> ``WORKER_CONCURRENCY``."""
    env = pool_env_fields()
    return {env[name]: env[source] for name, source in derived_defaults().items()}


def pool_env_fields() -> dict[str, str]:
    """Pool field -> the environment variable whose default it is (``WORKER_*``, ``DB_POOL_SIZE``).

    These variables shape a pool: a deployment sets them only through the pools file.
    """
    return {
        name: how.removeprefix("env:")
        for name in Pool.model_fields
        if (how := reaches(name)).startswith("env:")
    }


class PoolsFile(_Strict):
    """The whole of pools.toml."""

    downstream: dict[Annotated[str, Field(pattern=_NAME)], Downstream] = {}
    pools: Annotated[dict[Annotated[str, Field(pattern=_NAME)], Pool], Field(min_length=1)]
    schedules: dict[ScheduleName, Schedule] = {}

    @model_validator(mode="after")
    def _queues_and_uses(self) -> PoolsFile:
        owner: dict[str, str] = {}
        for name, pool in self.pools.items():
            for queue in pool.queues:
                if queue in owner:
                    raise ValueError(
                        f"queue {queue!r} is served by pools {owner[queue]!r} and {name!r}; "
                        "a queue belongs to exactly one pool"
                    )
                owner[queue] = name
            for resource in pool.uses:
                if resource not in self.downstream:
                    raise ValueError(
                        f"pool {name!r} uses {resource!r}, which is not a [downstream.*] table"
                    )
        return self

    def with_overrides(self, overrides: Mapping[str, Any], source: str) -> PoolsFile:
        """This file with a deployment's overrides merged in, validated by this same model.

        ``overrides`` maps a table (``pools``, ``downstream``) to entries of this file and
        their new values, e.g. ``{"pools": {"bulk": {"max_replicas": 8}}}``. An override
        may not add an entry, nor turn a sandbox pool into an ordinary one. Raises
        :class:`PoolsFileError` naming ``source``, the key and the problem.
        """
        data = self.model_dump(exclude_unset=True)
        problems: list[str] = []
        for table, entries in overrides.items():
            if table not in data and table not in type(self).model_fields:
                problems.append(f"{source}: {table}: not a table of pools.toml")
                continue
            base = data.setdefault(table, {})
            if not isinstance(entries, Mapping):
                problems.append(f"{source}: {table}: expected a mapping of entries")
                continue
            for name, values in entries.items():
                if name not in base:
                    problems.append(f"{source}: {table}.{name}: no such entry in pools.toml")
                elif not isinstance(values, Mapping):
                    problems.append(f"{source}: {table}.{name}: expected a mapping of keys")
                else:
                    base[name] = {**base[name], **values}
        pool_overrides = overrides.get("pools", {})
        for name, pool in self.pools.items():
            override = pool_overrides.get(name, {}) if isinstance(pool_overrides, Mapping) else {}
            if (
                pool.sandbox
                and isinstance(override, Mapping)
                and override.get("sandbox", True) is not True
            ):
                problems.append(
                    f"{source}: pools.{name}.sandbox: a deployment cannot turn off the "
                    "sandbox of an untrusted-code pool (set it in pools.toml and review it)"
                )
        if problems:
            raise PoolsFileError("\n".join(problems))
        try:
            return type(self).model_validate(data)
        except ValidationError as error:
            raise PoolsFileError("\n".join(_problems(error, source))) from None

    def for_pool(self, name: str) -> PoolsFile:
        """The file the pods of pool ``name`` read (``WORKER_POOLS_FILE`` in Kubernetes).

        The pool's own entry in full and the downstream resources it uses; every other
        pool by its queues alone (:meth:`routing`), so a worker still refuses an actor whose
        queue no pool serves; no schedules (the scheduler's file has them). A change to
        another pool's numbers, to a resource the pool does not use or to a schedule leaves
        this file, and so this pool's pods, as they are; a change to any pool's queues
        changes every pool's file (queues are shared routing). Validated by this same
        model; its own entry and resources are set in full, the other pools' entries only
        by their queues (dump it with ``exclude_unset``). Raises ``KeyError`` for an
        unknown pool.
        """
        own = self.pools[name]
        pools = self.routing()
        pools[name] = own.model_dump(mode="json", exclude_none=True)
        return type(self).model_validate(
            {
                "downstream": {
                    resource: self.downstream[resource].model_dump(mode="json")
                    for resource in own.uses
                },
                "pools": pools,
            }
        )

    def for_scheduler(self) -> PoolsFile:
        """The file the scheduler's pods read: every pool by its queues alone
        (:meth:`routing`: the backlog it exports per pool, the actors its schedules call)
        and the schedules in full. A change to a pool's numbers leaves it as it is."""
        return type(self).model_validate(
            {
                "pools": self.routing(),
                "schedules": {
                    name: schedule.model_dump(mode="json", exclude_none=True)
                    for name, schedule in self.schedules.items()
                },
            }
        )

    def routing(self) -> dict[str, dict[str, Any]]:
        """Every pool by what routing needs: its queues (and ``sandbox``, which the
        untrusted queue requires)."""
        return {
            name: {"queues": list(pool.queues), **({"sandbox": True} if pool.sandbox else {})}
            for name, pool in self.pools.items()
        }

    def pool_of_queue(self, queue: str) -> str | None:
        """The pool that serves ``queue``, or None."""
        for name, pool in self.pools.items():
            if queue in pool.queues:
                return name
        return None


#: The numbers of a ``[downstream.<name>]`` table an environment may override
#: (:func:`downstream_env`); a value's rule is the table's own.
DOWNSTREAM_ENV_FIELDS = ("capacity", "reserved", "rate")


def downstream_env(name: str, field: str) -> str:
    """The variable that overrides ``field`` of downstream ``name`` in an environment:
    ``DOWNSTREAM_<NAME>_<FIELD>`` (NAME upper-cased, ``-`` as ``_``)."""
    return f"DOWNSTREAM_{name.upper().replace('-', '_')}_{field.upper()}"


def effective_downstreams(
    file: PoolsFile, env: Mapping[str, str], names: Iterable[str] | None = None
) -> dict[str, Downstream]:
    """The downstream resources ``names`` (default: all) of ``file`` with the environment's
    overrides (:func:`downstream_env`) applied, each validated by :class:`Downstream`.
    Raises :class:`PoolsFileError`, one line per bad variable (its name, value and the
    rule): a number that is not one, a budget of zero or less, a rate that does not parse.
    A variable naming a resource the file does not have is not read."""
    found: dict[str, Downstream] = {}
    problems: list[str] = []
    for name in file.downstream if names is None else names:
        base = file.downstream[name]
        values = base.model_dump(exclude_unset=True)
        given = {
            field: env[downstream_env(name, field)]
            for field in DOWNSTREAM_ENV_FIELDS
            if downstream_env(name, field) in env
        }
        bad = False
        for field, raw in given.items():
            if field == "rate":
                values[field] = raw.strip()
                continue
            try:
                values[field] = int(raw.strip())
            except ValueError:
                problems.append(f"{downstream_env(name, field)}={raw!r}: not a whole number")
                bad = True
        if bad:
            continue
        try:
            found[name] = Downstream.model_validate(values)
        except ValidationError as error:
            shown = ", ".join(f"{downstream_env(name, f)}={v!r}" for f, v in given.items())
            for problem in error.errors():
                field = ".".join(str(part) for part in problem["loc"])
                message = str(problem["msg"]).removeprefix("Value error, ")
                where = shown or f"downstream.{name}"
                problems.append(f"{where}: {field + ': ' if field else ''}{message}")
    if problems:
        raise PoolsFileError("\n".join(problems))
    return found


class PoolsFileError(Exception):
    """pools.toml is missing or malformed; the message names the file, key and problem."""


def default_pools_path() -> Path:
    """``$WORKER_POOLS_FILE``, else ./pools.toml, else the service's own pools.toml (beside
    its ``src/``)."""
    if env := os.environ.get(POOLS_FILE_ENV):
        return Path(env)
    cwd = Path.cwd() / "pools.toml"
    if cwd.is_file():
        return cwd
    from .service import current

    return current().root / "pools.toml"


def load_pools(path: Path | None = None) -> PoolsFile:
    """Read and validate pools.toml; raise :class:`PoolsFileError` with one line per problem."""
    path = path or default_pools_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise PoolsFileError(f"{path}: cannot read ({error.strerror})") from None
    except tomllib.TOMLDecodeError as error:
        raise PoolsFileError(f"{path}: not valid TOML: {error}") from None
    try:
        return PoolsFile.model_validate(data)
    except ValidationError as error:
        raise PoolsFileError("\n".join(_problems(error, str(path)))) from None


def _problems(error: ValidationError, source: str) -> list[str]:
    """One line per problem: ``<source>: <key>: <message>``."""
    lines = []
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        lines.append(f"{source}: {key}: {problem['msg']}")
    return lines
