"""Capacity budget: pure arithmetic over pools and downstream resources (no Pulumi).

For every downstream resource ``r``::

    sum over pools p using r of  p.max_replicas x p.processes x per_process(p, r)
        <= r.capacity - r.reserved

where ``per_process`` is the pool's DB pool size (``per_process = "db_pool_size"``,
the default size being the pool's concurrency) or its concurrency
(``per_process = "concurrency"``, e.g. a partner's concurrent-call limit).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .args import DownstreamSpec, PoolSpec
from .errors import GuardError


@dataclass(frozen=True)
class Share:
    """One pool's worst-case use of one resource: ``replicas x processes x per_process``."""

    pool: str
    replicas: int
    processes: int
    per_process: int

    @property
    def total(self) -> int:
        return self.replicas * self.processes * self.per_process

    def __str__(self) -> str:
        return f"{self.pool} {self.replicas} x {self.processes} x {self.per_process} = {self.total}"


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
        per = "DB_POOL_SIZE" if r.per_process == "db_pool_size" else "concurrency"
        shares = ", ".join(str(share) for share in self.shares) or "no pool"
        return (
            f"{r.name}: pools use {self.total} > budget {self.budget} "
            f"(capacity {r.capacity} - reserved {r.reserved}); "
            f"max_replicas x processes x {per}: {shares}"
            if not self.fits
            else f"{r.name}: {self.total} of {self.budget} "
            f"(capacity {r.capacity} - reserved {r.reserved}); {shares}"
        )


def per_process_usage(pool: PoolSpec, resource: DownstreamSpec) -> int:
    """What one process of ``pool`` holds of ``resource``: DB pool size or concurrency."""
    if resource.per_process == "concurrency":
        return pool.concurrency
    return pool.effective_db_pool_size


def per_replica_usage(pool: PoolSpec, resource: DownstreamSpec) -> int:
    """What one replica of ``pool`` holds of ``resource``: ``processes x per_process``."""
    return pool.processes * per_process_usage(pool, resource)


def share(pool: PoolSpec, resource: DownstreamSpec, replicas: int | None = None) -> Share:
    """The pool's share of the resource at ``replicas`` (default: its ``max_replicas``)."""
    return Share(
        pool=pool.name,
        replicas=pool.max_replicas if replicas is None else replicas,
        processes=pool.processes,
        per_process=per_process_usage(pool, resource),
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
    """``max_replicas``, lowered to what each used resource's budget could hold of this pool alone.

    Once :func:`check_capacity` passes this equals ``max_replicas``; it is what the scaler's
    ``maxReplicaCount`` is set to, so no scaler can be configured past a resource's budget.
    """
    cap = pool.max_replicas
    for resource in downstream:
        if resource.name in pool.uses:
            cap = min(cap, resource.budget // per_replica_usage(pool, resource))
    return cap
