"""Memory, timing and isolation guards: pure functions (no Pulumi resources).

- memory: ``handler_memory x concurrency x processes + memory_base x processes <= memory``
- timing: ``grace = ceil(shutdown_timeout_ms / 1000) + margin``;
  refused unless ``job_timeout_ms < shutdown_timeout_ms < grace x 1000``
- isolation: every queue is served by exactly one pool; pool names are unique; a sandbox
  pool uses no downstream resource (it reaches nothing but DNS and the broker).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .args import DownstreamSpec, PoolSpec
from .capacity import Usage, capped_max_replicas, check_capacity
from .errors import GuardError

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_UNITS = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "": 1,
}


def memory_bytes(quantity: str) -> int:
    """Bytes of a Kubernetes memory quantity such as ``512Mi``; ValueError if malformed."""
    match = _QUANTITY.match(quantity)
    if match is None:
        raise ValueError(f"{quantity!r} is not a Kubernetes memory quantity such as 512Mi")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def mib(n_bytes: int) -> str:
    """Bytes as ``<n>Mi`` (rounded down), for messages and quotas."""
    return f"{n_bytes // 2**20}Mi"


def memory_needed(pool: PoolSpec, memory_base: str = "96Mi") -> int | None:
    """Peak bytes of one container: handlers in flight plus a base per process.

    None when the pool declares no ``handler_memory``.
    """
    if pool.handler_memory is None:
        return None
    handlers = memory_bytes(pool.handler_memory) * pool.concurrency * pool.processes
    return handlers + memory_bytes(memory_base) * pool.processes


def check_memory(pool: PoolSpec, memory_base: str = "96Mi") -> None:
    """Refuse a pool whose peak (see :func:`memory_needed`) exceeds its memory limit."""
    needed = memory_needed(pool, memory_base)
    limit = memory_bytes(pool.memory)
    if needed is not None and needed > limit:
        raise GuardError(
            f"memory guard: pool {pool.name!r} needs {mib(needed)} = handler_memory "
            f"{pool.handler_memory} x concurrency {pool.concurrency} x processes "
            f"{pool.processes} + base {memory_base} x processes {pool.processes}, "
            f"above its memory limit {pool.memory}"
        )


def grace_period_s(pool: PoolSpec, margin_s: int = 15) -> int:
    """``terminationGracePeriodSeconds``: the drain window rounded up to seconds, plus margin."""
    return -(-pool.shutdown_timeout_ms // 1000) + margin_s


def check_timing(pool: PoolSpec, grace_s: int) -> None:
    """Refuse unless ``job_timeout_ms < shutdown_timeout_ms < grace_s x 1000``."""
    if pool.job_timeout_ms >= pool.shutdown_timeout_ms:
        raise GuardError(
            f"timing guard: pool {pool.name!r} job timeout {pool.job_timeout_ms} ms >= "
            f"shutdown timeout {pool.shutdown_timeout_ms} ms; a job must end before the drain does"
        )
    if grace_s * 1000 <= pool.shutdown_timeout_ms:
        raise GuardError(
            f"timing guard: pool {pool.name!r} grace period {grace_s} s <= "
            f"shutdown timeout {pool.shutdown_timeout_ms} ms; the pod would be killed mid-drain"
        )


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
    grace_margin_s: int = 15,
    memory_base: str = "96Mi",
) -> ServicePlan:
    """Run every guard; return the derived numbers or raise :class:`GuardError`."""
    check_isolation(pools)
    for pool in pools:
        check_replicas(pool)
        check_timing(pool, grace_period_s(pool, grace_margin_s))
        check_memory(pool, memory_base)
    report = check_capacity(pools, downstream)
    return ServicePlan(
        pools=tuple(
            PoolPlan(p, capped_max_replicas(p, downstream), grace_period_s(p, grace_margin_s))
            for p in pools
        ),
        capacity=report,
    )
