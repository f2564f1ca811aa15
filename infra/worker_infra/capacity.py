"""Capacity budget: pure arithmetic over pools and downstream resources (no Pulumi).

For every downstream resource ``r``, the worst case that must fit is::

    sum over pools p using r of
        (p.max_replicas + TRANSITION_PODS) x (p.processes x per_process(p, r) + probe(r))
    <= r.capacity - r.reserved

- ``per_process`` is the pool's DB pool size (``per_process = "db_pool_size"``) or its
  concurrency (``per_process = "concurrency"``, e.g. a partner's concurrent-call limit);
- ``TRANSITION_PODS`` (2): pods of a pool still holding their connections while draining
  next to ``max_replicas`` running ones. The pod spec bounds them: a rollout replaces one
  pod at a time and starts the next replacement only after the previous pod's grace
  period (``maxSurge 0``, ``maxUnavailable 1``, ``minReadySeconds = grace``), the scaler
  removes at most one pod per period of at least the grace period, so at most one pod
  drains from a rollout or a scale-down at a time; the PodDisruptionBudget lets one
  eviction run next to it;
- ``probe(r)``: 1 per pod for a ``db_pool_size`` resource, the readiness probe's own
  connection (``healthcheck ready`` opens one every period, outside the DB pool).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from worker_runtime import contract

from .args import DownstreamSpec, PoolSpec
from .errors import GuardError

#: Draining pods of one pool that may still hold connections next to its maximum.
TRANSITION_PODS = 2
#: Connections the readiness probe opens per pod (database resources only).
PROBE_CONNECTIONS = 1


class PoolShape(Protocol):
    """What the formula reads of a pool: a :class:`PoolSpec`, or the simulation's view of
    a rendered pools file (``simulate.pools_of``)."""

    @property
    def name(self) -> str: ...
    @property
    def processes(self) -> int: ...
    @property
    def concurrency(self) -> int: ...
    @property
    def db_pool_size(self) -> int: ...
    @property
    def max_replicas(self) -> int: ...


@dataclass(frozen=True)
class Share:
    """One pool's worst case on one resource:
    ``(replicas + transition) x (processes x per_process + probe)``."""

    pool: str
    replicas: int
    processes: int
    per_process: int
    transition: int = TRANSITION_PODS
    probe: int = 0

    @property
    def per_pod(self) -> int:
        return self.processes * self.per_process + self.probe

    @property
    def total(self) -> int:
        return (self.replicas + self.transition) * self.per_pod

    def __str__(self) -> str:
        probe = f" + {self.probe}" if self.probe else ""
        return (
            f"{self.pool} ({self.replicas} + {self.transition}) x "
            f"({self.processes} x {self.per_process}{probe}) = {self.total}"
        )


@dataclass(frozen=True)
class Usage:
    """A resource's budget against the shares of the pools that use it."""

    resource: DownstreamSpec
    shares: tuple[Share, ...]

    @property
    def total(self) -> int:
        return sum(share.total for share in self.shares)

    @property
    def budget(self) -> int:
        return self.resource.budget

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def __str__(self) -> str:
        r = self.resource
        per = (
            "DB_POOL_SIZE + probe"
            if r.per_process == contract.PER_PROCESS_DB_POOL
            else "concurrency"
        )
        shares = ", ".join(str(share) for share in self.shares) or "no pool"
        return (
            f"{r.name}: pools use {self.total} > budget {self.budget} "
            f"(capacity {r.capacity} - reserved {r.reserved}); "
            f"(max_replicas + draining) x (processes x {per}): {shares}"
            if not self.fits
            else f"{r.name}: {self.total} of {self.budget} "
            f"(capacity {r.capacity} - reserved {r.reserved}); {shares}"
        )


def per_process_usage(pool: PoolShape, resource: DownstreamSpec) -> int:
    """What one process of ``pool`` holds of ``resource``: DB pool size or concurrency."""
    if resource.per_process == contract.PER_PROCESS_CONCURRENCY:
        return pool.concurrency
    return pool.db_pool_size


def probe_usage(resource: DownstreamSpec) -> int:
    """What the readiness probe of one pod holds of ``resource``."""
    return PROBE_CONNECTIONS if resource.per_process == contract.PER_PROCESS_DB_POOL else 0


def per_replica_usage(pool: PoolShape, resource: DownstreamSpec) -> int:
    """What one pod of ``pool`` holds of ``resource``: ``processes x per_process + probe``."""
    return pool.processes * per_process_usage(pool, resource) + probe_usage(resource)


def share(pool: PoolShape, resource: DownstreamSpec, replicas: int | None = None) -> Share:
    """The pool's worst case on the resource at ``replicas`` (default: its ``max_replicas``)."""
    return Share(
        pool=pool.name,
        replicas=pool.max_replicas if replicas is None else replicas,
        processes=pool.processes,
        per_process=per_process_usage(pool, resource),
        probe=probe_usage(resource),
    )


def usage(pools: Iterable[PoolSpec], resource: DownstreamSpec) -> Usage:
    """The resource's usage by every pool that declares it in ``uses``."""
    return Usage(
        resource=resource,
        shares=tuple(share(p, resource) for p in pools if resource.name in p.uses),
    )


def capacity_report(
    pools: Sequence[PoolSpec], downstream: Sequence[DownstreamSpec]
) -> tuple[Usage, ...]:
    """Usage of every downstream resource, in the order given."""
    return tuple(usage(pools, resource) for resource in downstream)


def check_capacity(
    pools: Sequence[PoolSpec], downstream: Sequence[DownstreamSpec]
) -> tuple[Usage, ...]:
    """The capacity report; raise :class:`GuardError` naming each resource that does not fit.

    A pool that uses a resource missing from ``downstream`` is refused too.
    """
    known = {r.name for r in downstream}
    problems = [
        f"pool {p.name!r} uses {u!r}, which is not a downstream resource"
        for p in pools
        for u in p.uses
        if u not in known
    ]
    report = capacity_report(pools, downstream)
    problems += [f"capacity exceeded: {u}" for u in report if not u.fits]
    if problems:
        raise GuardError("; ".join(problems))
    return report


def capped_max_replicas(pool: PoolSpec, downstream: Sequence[DownstreamSpec]) -> int:
    """``max_replicas``, lowered to what each used resource's budget could hold of this pool
    alone (draining pods included).

    Once :func:`check_capacity` passes this equals ``max_replicas``; it is what the scaler's
    ``maxReplicaCount`` is set to, so no scaler can be configured past a resource's budget.
    """
    cap = pool.max_replicas
    for resource in downstream:
        if resource.name in pool.uses:
            cap = min(cap, resource.budget // per_replica_usage(pool, resource) - TRANSITION_PODS)
    return cap
