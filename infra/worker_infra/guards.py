"""Memory, timing, isolation and environment guards: pure functions (no Pulumi resources).

- memory: ``handler_memory x concurrency x processes + memory_base x processes
  + supervisor + probes x probe <= memory`` (the supervisor process and the exec probes
  run in the same container and count against its limit);
- timing: ``grace = ceil(shutdown_timeout_ms / 1000) + margin``, refused unless the
  service's timing rule (``pools.timing_problems``, handed in as :class:`.args.Timing`)
  holds: ``job timeout < drain window < drain window + kill-after < grace``;
- isolation: every queue is served by exactly one pool; pool names are unique; a sandbox
  pool uses no downstream resource (it reaches nothing but DNS and the broker);
- environment: a stack's extra env sets no pool-shaping, infra-managed or secret variable.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from worker_runtime import contract

from .args import (
    DEFAULT_GRACE_MARGIN_S,
    DEFAULT_MEMORY_BASE,
    DownstreamSpec,
    MiB,
    PoolSpec,
    SchedulerSpec,
    Timing,
)
from .capacity import Usage, capped_max_replicas, check_capacity
from .errors import GuardError

#: Resident memory of the supervisor process (measured: ~49 MB), rounded up.
SUPERVISOR_MEMORY = 50 * MiB
#: Resident memory of one exec probe (``<project> healthcheck ...``, measured: ~56 MB).
PROBE_MEMORY = 56 * MiB
#: Exec probes that can run at once in a container (liveness and readiness).
CONCURRENT_PROBES = 2

#: Variables worker_infra sets itself on every pod.
MANAGED_ENV = frozenset(
    {
        "WORKER_POOL",
        "WORKER_POOLS_FILE",
        "METRICS_PORT",
        "HEALTH_STALLED_AFTER_S",
        "OTEL_SERVICE_NAME",
        "REDIS_URL",
        "DATABASE_URL",
    }
)
_SECRET_NAME = re.compile(
    r"(PASSWORD|PASSWD|SECRET|TOKEN|CREDENTIAL|PRIVATE|API_?KEY|ACCESS_?KEY|_DSN$)",
    re.IGNORECASE,
)
_CREDENTIALS_IN_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^/@\s]*:[^/@\s]+@", re.IGNORECASE)


def secret_like(name: str, value: str) -> bool:
    """Whether a plain environment variable looks like it carries a secret or a connection
    string: its name (``*PASSWORD*``, ``*TOKEN*``, ``*_DSN``, ...) or a value with
    credentials in a URL (``scheme://user:password@host``)."""
    return bool(_SECRET_NAME.search(name) or _CREDENTIALS_IN_URL.search(value))


def check_env(env: Mapping[str, str], pool_env: Iterable[str]) -> None:
    """Refuse a stack's extra environment that would set what the guards decided.

    Parameters:
      env: the stack's ``env`` (applied to every pool).
      pool_env: the variables a pool shapes (``WORKER_CONCURRENCY``, ``DB_POOL_SIZE``, ...),
        as the service's pool model names them: they reach the pod only through the
        validated pools file.
    """
    shaping = set(pool_env)
    problems = []
    for name, value in env.items():
        if name in shaping:
            problems.append(
                f"env {name}: shapes the pool; set it in pools.toml or the stack's pools "
                "overrides, where the guards check it"
            )
        elif name in MANAGED_ENV:
            problems.append(f"env {name}: set by worker_infra itself")
        elif secret_like(name, str(value)):
            problems.append(
                f"env {name}: looks like a secret or a connection string; plain env is "
                "readable by anyone who can read the Deployment (use a Secret)"
            )
    if problems:
        raise GuardError("environment guard: " + "; ".join(problems))


def mib(n_bytes: int) -> str:
    """Bytes as ``<n>Mi`` (rounded down), for messages and quotas."""
    return f"{n_bytes // MiB}Mi"


def memory_needed(pool: PoolSpec, memory_base: int = DEFAULT_MEMORY_BASE) -> int | None:
    """Peak bytes of one container: handlers in flight, a base per process, the supervisor
    and the exec probes. None when the pool declares no ``handler_memory``."""
    if pool.handler_memory_bytes is None:
        return None
    handlers = pool.handler_memory_bytes * pool.concurrency * pool.processes
    return (
        handlers
        + memory_base * pool.processes
        + SUPERVISOR_MEMORY
        + CONCURRENT_PROBES * PROBE_MEMORY
    )


def check_memory(pool: PoolSpec, memory_base: int = DEFAULT_MEMORY_BASE) -> None:
    """Refuse a pool whose peak (see :func:`memory_needed`) exceeds its memory limit."""
    needed = memory_needed(pool, memory_base)
    if needed is not None and needed > pool.memory_bytes:
        raise GuardError(
            f"memory guard: pool {pool.name!r} needs {mib(needed)} = handler_memory "
            f"{pool.handler_memory} x concurrency {pool.concurrency} x processes "
            f"{pool.processes} + base {mib(memory_base)} x processes {pool.processes} "
            f"+ supervisor {mib(SUPERVISOR_MEMORY)} + {CONCURRENT_PROBES} probes x "
            f"{mib(PROBE_MEMORY)}, above its memory limit {pool.memory}"
        )


def grace_period_s(pool: PoolSpec, margin_s: int = DEFAULT_GRACE_MARGIN_S) -> int:
    """``terminationGracePeriodSeconds``: the drain window rounded up to seconds, plus margin."""
    return -(-pool.shutdown_timeout_ms // 1000) + margin_s


def check_timing(pool: PoolSpec, grace_s: int, timing: Timing) -> None:
    """Refuse ``pool`` unless the service's timing rule holds under a grace period of
    ``grace_s``: job timeout < drain window < drain window + kill-after < grace."""
    problems = timing.problems(pool, grace_s)
    if problems:
        raise GuardError(f"timing guard: pool {pool.name!r}: " + "; ".join(problems))


def check_isolation(pools: Sequence[PoolSpec]) -> None:
    """Refuse duplicate pool names, a queue served by two pools, or a pool without queues."""
    seen: dict[str, str] = {}
    names: set[str] = set()
    for pool in pools:
        if pool.slug in names:
            raise GuardError(f"isolation guard: pool {pool.name!r} is defined twice")
        names.add(pool.slug)
        if not pool.queues:
            raise GuardError(f"isolation guard: pool {pool.name!r} serves no queue")
        if pool.sandbox and pool.uses:
            raise GuardError(
                f"isolation guard: sandbox pool {pool.name!r} uses {', '.join(pool.uses)}; "
                "it may reach nothing but DNS and the broker"
            )
        for queue in pool.queues:
            if queue in seen:
                raise GuardError(
                    f"isolation guard: queue {queue!r} is served by pools "
                    f"{seen[queue]!r} and {pool.name!r}"
                )
            seen[queue] = pool.name


def check_replicas(pool: PoolSpec) -> None:
    """Refuse ``min_replicas > max_replicas`` or a non-positive maximum."""
    if pool.max_replicas < 1 or pool.min_replicas < 0 or pool.min_replicas > pool.max_replicas:
        raise GuardError(
            f"replica guard: pool {pool.name!r} needs 0 <= min_replicas ({pool.min_replicas})"
            f" <= max_replicas ({pool.max_replicas}) and max_replicas >= 1"
        )


@dataclass(frozen=True)
class PoolPlan:
    """What the guards derived for one pool."""

    pool: PoolSpec
    max_replicas: int
    grace_s: int


@dataclass(frozen=True)
class ServicePlan:
    """All pools' plans and the capacity report of a stack that passed every guard."""

    pools: tuple[PoolPlan, ...]
    capacity: tuple[Usage, ...]


def plan(
    pools: Sequence[PoolSpec],
    downstream: Sequence[DownstreamSpec],
    timing: Timing,
    grace_margin_s: int = DEFAULT_GRACE_MARGIN_S,
    memory_base: int = DEFAULT_MEMORY_BASE,
) -> ServicePlan:
    """Run every guard; return the derived numbers or raise :class:`GuardError`."""
    check_isolation(pools)
    for pool in pools:
        check_replicas(pool)
        check_timing(pool, grace_period_s(pool, grace_margin_s), timing)
        check_memory(pool, memory_base)
    report = check_capacity(pools, downstream)
    return ServicePlan(
        pools=tuple(
            PoolPlan(
                p,
                capped_max_replicas(p, downstream),
                grace_period_s(p, grace_margin_s),
            )
            for p in pools
        ),
        capacity=report,
    )


def check_scheduler(spec: SchedulerSpec) -> None:
    """Refuse scheduler numbers that break the leader election or the liveness probe."""
    if spec.replicas < 1:
        raise GuardError(f"scheduler: replicas ({spec.replicas}) must be at least 1")
    low, high = contract.SCHEDULER_LEADER_TTL_MIN_MS, contract.SCHEDULER_LEADER_TTL_MAX_MS
    if not low <= spec.leader_ttl_ms <= high:
        raise GuardError(
            f"scheduler: leader_ttl_ms ({spec.leader_ttl_ms}) must lie in {low}..{high}"
        )
    if spec.stalled_after_s * 1000 <= spec.leader_ttl_ms:
        raise GuardError(
            f"scheduler: stalled_after_s ({spec.stalled_after_s}) must exceed the leader "
            f"TTL ({spec.leader_ttl_ms} ms): a follower's loop ticks once per TTL/4"
        )
