"""pools.toml: the pools this service runs and the downstream capacity they share.

The worker reads it at boot (``WORKER_POOL`` picks the pool that supplies the
defaults of :mod:`.settings`); ``infra/`` reads it to build one Deployment and
one scaler per pool. A malformed file is refused with the file, the key and the
problem named (:class:`PoolsFileError`).
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .schedules import Schedule, ScheduleName

POOLS_FILE_ENV = "WORKER_POOLS_FILE"
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_CPU = re.compile(r"^[0-9]+(\.[0-9]+)?m?$")
_NAME = r"^[a-z][a-z0-9_-]*$"
_BINARY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL_UNITS = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}

PositiveInt = Annotated[int, Field(ge=1)]
QueueName = Annotated[str, Field(pattern=_NAME, max_length=64)]


def memory_bytes(quantity: str) -> int:
    """Bytes of a Kubernetes memory quantity such as ``512Mi`` or ``1G``."""
    match = _QUANTITY.match(quantity)
    if match is None:
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity such as 512Mi")
    unit = match.group(2) or ""
    number = float(quantity[: len(quantity) - len(unit)])
    return int(number * _BINARY_UNITS.get(unit, _DECIMAL_UNITS.get(unit, 1)))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Downstream(_Strict):
    """A resource the handlers share, e.g. PostgreSQL connections or a partner's call limit.

    Parameters:
      capacity: what the resource can hold in total.
      reserved: held back for the API, admin and migrations (default 0).
      per_process: what one worker process holds: ``db_pool_size`` or ``concurrency``.
    """

    capacity: PositiveInt
    reserved: Annotated[int, Field(ge=0)] = 0
    per_process: Literal["db_pool_size", "concurrency"] = "db_pool_size"

    @model_validator(mode="after")
    def _reserved_below_capacity(self) -> Downstream:
        if self.reserved >= self.capacity:
            raise ValueError(f"reserved ({self.reserved}) must be below capacity ({self.capacity})")
        return self


class Pool(_Strict):
    """One pool: one Deployment, one scaler, the queues it alone serves.

    Defaults: 1 process, 4 threads, 30 s job timeout, 40 s drain window,
    5 attempts, 512Mi memory, 1 to 2 replicas, prefetch = concurrency (a process
    holds no message it cannot start at once, so none waits behind a long job while
    another replica is idle; raise it for very short jobs).
    """

    queues: Annotated[list[QueueName], Field(min_length=1)]
    processes: Annotated[int, Field(ge=1, le=64)] = 1
    concurrency: Annotated[int, Field(ge=1, le=256)] = 4
    job_timeout_ms: Annotated[int, Field(ge=100, le=86_400_000)] = 30_000
    shutdown_timeout_ms: Annotated[int, Field(ge=1_000, le=86_400_000)] = 40_000
    max_attempts: Annotated[int, Field(ge=1, le=100)] = 5
    prefetch: Annotated[int, Field(ge=1, le=65_535)] | None = None
    db_pool_size: PositiveInt | None = None
    memory: str = "512Mi"
    cpu: str = "250m"
    handler_memory: str | None = None
    min_replicas: Annotated[int, Field(ge=0, le=1000)] = 1
    max_replicas: Annotated[int, Field(ge=1, le=1000)] = 2
    backlog_age_target_s: Annotated[int, Field(ge=1)] = 30
    uses: list[str] = []
    sandbox: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> Pool:
        memory_bytes(self.memory)
        if self.handler_memory is not None:
            memory_bytes(self.handler_memory)
        if not _CPU.match(self.cpu):
            raise ValueError(f"cpu {self.cpu!r} is not a Kubernetes CPU quantity such as 250m")
        if len(set(self.queues)) != len(self.queues):
            raise ValueError("queues lists a queue twice")
        if self.job_timeout_ms >= self.shutdown_timeout_ms:
            raise ValueError(
                f"job_timeout_ms ({self.job_timeout_ms}) must be below "
                f"shutdown_timeout_ms ({self.shutdown_timeout_ms})"
            )
        if self.prefetch is not None and self.prefetch < self.concurrency:
            raise ValueError(
                f"prefetch ({self.prefetch}) is below concurrency ({self.concurrency}): "
                "handler threads would sit idle"
            )
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        return self

    @property
    def effective_db_pool_size(self) -> int:
        """Connections per process: ``db_pool_size``, by default the pool's concurrency."""
        return self.db_pool_size or self.concurrency


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

    def pool_of_queue(self, queue: str) -> str | None:
        """The pool that serves ``queue``, or None."""
        for name, pool in self.pools.items():
            if queue in pool.queues:
                return name
        return None


class PoolsFileError(Exception):
    """pools.toml is missing or malformed; the message names the file, key and problem."""


def default_pools_path() -> Path:
    """``$WORKER_POOLS_FILE``, else ./pools.toml, else the project's own pools.toml."""
    if env := os.environ.get(POOLS_FILE_ENV):
        return Path(env)
    cwd = Path.cwd() / "pools.toml"
    if cwd.is_file():
        return cwd
    return Path(__file__).resolve().parents[2] / "pools.toml"


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
        lines = []
        for problem in error.errors():
            key = ".".join(str(part) for part in problem["loc"]) or "(top level)"
            lines.append(f"{path}: {key}: {problem['msg']}")
        raise PoolsFileError("\n".join(lines)) from None
