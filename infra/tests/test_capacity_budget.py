"""The capacity arithmetic, without Pulumi: examples and properties.

Worst case per resource: sum of (max_replicas + 2 draining) x (processes x per_process
+ 1 readiness-probe connection for a database resource).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from templatepools import downstream, pool

from worker_infra import DownstreamSpec, GuardError, PoolSpec, capped_max_replicas, check_capacity
from worker_infra.capacity import TRANSITION_PODS, capacity_report, per_replica_usage

POSTGRES = downstream("postgres", capacity=150, reserved=40)
PARTNER = downstream("partner_api", capacity=60, reserved=4, per_process="concurrency")
DEFAULT_POOLS = (
    pool("interactive", ("notifications",), concurrency=8, max_replicas=4, uses=["postgres"]),
    pool("bulk", ("reports",), processes=2, concurrency=2, max_replicas=3, uses=["postgres"]),
    pool("external", ("partner",), concurrency=4, max_replicas=5, uses=["partner_api"]),
    pool(
        "critical",
        ("payments",),
        concurrency=4,
        max_replicas=3,
        uses=["postgres", "partner_api"],
    ),
)


def test_default_pools_fit_with_the_numbers_of_pools_toml() -> None:
    postgres, partner = check_capacity(DEFAULT_POOLS, (POSTGRES, PARTNER))
    assert (postgres.total, postgres.budget) == (6 * 9 + 5 * 5 + 5 * 5, 110) == (104, 110)
    assert (partner.total, partner.budget) == (7 * 4 + 5 * 4, 56) == (48, 56)


def test_draining_pods_and_probe_connections_count() -> None:
    (usage,) = check_capacity(DEFAULT_POOLS[:1], (POSTGRES,))
    assert str(usage.shares[0]) == "interactive (4 + 2) x (1 x 8 + 1) = 54"
    # Without the two draining pods and the probe it would be 4 x 8 = 32.
    assert usage.total == (4 + TRANSITION_PODS) * (8 + 1)


def test_over_budget_is_refused_naming_resource_shares_and_numbers() -> None:
    pools = (
        *DEFAULT_POOLS[:1],
        pool("bulk", ("reports",), processes=2, concurrency=2, max_replicas=10, uses=["postgres"]),
    )
    with pytest.raises(GuardError) as refused:
        check_capacity(pools, (POSTGRES,))
    message = str(refused.value)
    assert "postgres: pools use 114 > budget 110 (capacity 150 - reserved 40)" in message
    assert "interactive (4 + 2) x (1 x 8 + 1) = 54" in message
    assert "bulk (10 + 2) x (2 x 2 + 1) = 60" in message


def test_db_pool_size_counts_instead_of_concurrency_when_set() -> None:
    p = pool("p", processes=3, concurrency=4, db_pool_size=6, uses=["postgres"])
    assert per_replica_usage(p, POSTGRES) == 3 * 6 + 1
    assert per_replica_usage(p, PARTNER) == 12


def test_unknown_resource_is_refused() -> None:
    with pytest.raises(GuardError, match="uses 'redis_cache'"):
        check_capacity((pool("p", uses=["redis_cache"]),), (POSTGRES,))


pools_st = st.lists(
    st.builds(
        lambda i, processes, concurrency, extra_db, replicas, uses: pool(
            f"p{i}",
            (f"q{i}",),
            processes=processes,
            concurrency=concurrency,
            db_pool_size=None if extra_db is None else concurrency + extra_db,
            max_replicas=replicas,
            min_replicas=1,
            uses=uses,
        ),
        st.integers(0, 10**6),
        st.integers(1, 8),
        st.integers(1, 32),
        st.none() | st.integers(0, 32),
        st.integers(1, 50),
        st.lists(st.sampled_from(["postgres", "partner_api"]), unique=True),
    ),
    max_size=6,
    unique_by=lambda p: p.name,
)
resources_st = st.tuples(
    st.builds(
        lambda c, r: downstream("postgres", c + r + 1, r),
        st.integers(0, 2000),
        st.integers(0, 500),
    ),
    st.builds(
        lambda c, r: downstream("partner_api", c + r + 1, r, "concurrency"),
        st.integers(0, 2000),
        st.integers(0, 500),
    ),
)


def brute_force_total(pools: list[PoolSpec], resource: DownstreamSpec) -> int:
    """Pod by pod: every pod that may hold connections at once, and what it holds."""
    total = 0
    for p in pools:
        if resource.name in p.uses:
            db = resource.per_process == "db_pool_size"
            per = p.db_pool_size if db else p.concurrency
            for _pod in range(p.max_replicas + 2):  # + a rollout/scale-down and an eviction
                total += p.processes * per + (1 if db else 0)
    return total


@given(pools_st, resources_st)
def test_refused_exactly_when_some_resource_is_over_budget(
    pools: list[PoolSpec], resources: tuple[DownstreamSpec, DownstreamSpec]
) -> None:
    over = [r for r in resources if brute_force_total(pools, r) > r.capacity - r.reserved]
    if over:
        with pytest.raises(GuardError) as refused:
            check_capacity(pools, resources)
        for resource in over:
            assert f"{resource.name}: pools use {brute_force_total(pools, resource)} >" in str(
                refused.value
            )
    else:
        report = check_capacity(pools, resources)
        assert all(u.total == brute_force_total(pools, u.resource) for u in report)


@given(pools_st, resources_st)
def test_capped_maximum_never_exceeds_a_budget_alone_and_equals_max_when_it_fits(
    pools: list[PoolSpec], resources: tuple[DownstreamSpec, DownstreamSpec]
) -> None:
    fits = all(u.fits for u in capacity_report(pools, resources))
    for p in pools:
        cap = capped_max_replicas(p, resources)
        assert cap <= p.max_replicas
        for r in resources:
            if r.name in p.uses:
                assert (cap + TRANSITION_PODS) * per_replica_usage(p, r) <= r.budget
        if fits:
            assert cap == p.max_replicas


@given(pools_st, resources_st, st.integers(1, 20))
def test_more_replicas_never_turns_a_refusal_into_a_pass(
    pools: list[PoolSpec], resources: tuple[DownstreamSpec, DownstreamSpec], extra: int
) -> None:
    if not pools:
        return
    grown = [
        dataclasses.replace(p, max_replicas=p.max_replicas + extra) if i == 0 else p
        for i, p in enumerate(pools)
    ]
    fits = all(u.fits for u in capacity_report(pools, resources))
    fits_grown = all(u.fits for u in capacity_report(grown, resources))
    assert fits or not fits_grown
