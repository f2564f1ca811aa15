"""The capacity arithmetic, without Pulumi: examples and properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker_infra import DownstreamSpec, GuardError, PoolSpec, capped_max_replicas, check_capacity
from worker_infra.capacity import capacity_report, per_replica_usage

POSTGRES = DownstreamSpec("postgres", capacity=100, reserved=40)
PARTNER = DownstreamSpec("partner_api", capacity=40, reserved=4, per_process="concurrency")
DEFAULT_POOLS = (
    PoolSpec("interactive", ("notifications",), 1, 8, max_replicas=4, uses=("postgres",)),
    PoolSpec("bulk", ("reports",), 2, 2, max_replicas=3, uses=("postgres",)),
    PoolSpec("external", ("partner",), 1, 4, max_replicas=5, uses=("partner_api",)),
    PoolSpec("critical", ("payments",), 1, 4, max_replicas=3, uses=("postgres", "partner_api")),
)


def test_default_pools_fit_with_the_numbers_of_pools_toml() -> None:
    postgres, partner = check_capacity(DEFAULT_POOLS, (POSTGRES, PARTNER))
    assert (postgres.total, postgres.budget) == (4 * 8 + 3 * 2 * 2 + 3 * 4, 60) == (56, 60)
    assert (partner.total, partner.budget) == (5 * 4 + 3 * 4, 36) == (32, 36)


def test_over_budget_is_refused_naming_resource_shares_and_numbers() -> None:
    pools = (
        *DEFAULT_POOLS[:1],
        PoolSpec("bulk", ("reports",), 2, 2, max_replicas=8, uses=("postgres",)),
    )
    with pytest.raises(GuardError) as refused:
        check_capacity(pools, (POSTGRES,))
    message = str(refused.value)
    assert "postgres: pools use 64 > budget 60 (capacity 100 - reserved 40)" in message
    assert "interactive 4 x 1 x 8 = 32" in message
    assert "bulk 8 x 2 x 2 = 32" in message


def test_db_pool_size_counts_instead_of_concurrency_when_set() -> None:
    pool = PoolSpec("p", ("q",), processes=3, concurrency=4, db_pool_size=6, uses=("postgres",))
    assert per_replica_usage(pool, POSTGRES) == 18
    assert per_replica_usage(pool, PARTNER) == 12


def test_unknown_resource_is_refused() -> None:
    with pytest.raises(GuardError, match="uses 'redis_cache'"):
        check_capacity((PoolSpec("p", ("q",), uses=("redis_cache",)),), (POSTGRES,))


pools_st = st.lists(
    st.builds(
        lambda i, processes, concurrency, db, replicas, uses: PoolSpec(
            f"p{i}",
            (f"q{i}",),
            processes=processes,
            concurrency=concurrency,
            db_pool_size=db,
            max_replicas=replicas,
            min_replicas=1,
            uses=tuple(uses),
        ),
        st.integers(0, 10**6),
        st.integers(1, 8),
        st.integers(1, 32),
        st.none() | st.integers(1, 32),
        st.integers(1, 50),
        st.lists(st.sampled_from(["postgres", "partner_api"]), unique=True),
    ),
    max_size=6,
    unique_by=lambda p: p.name,
)
resources_st = st.tuples(
    st.builds(
        lambda c, r: DownstreamSpec("postgres", c + r + 1, r),
        st.integers(0, 2000),
        st.integers(0, 500),
    ),
    st.builds(
        lambda c, r: DownstreamSpec("partner_api", c + r + 1, r, "concurrency"),
        st.integers(0, 2000),
        st.integers(0, 500),
    ),
)


def brute_force_total(pools: list[PoolSpec], resource: DownstreamSpec) -> int:
    total = 0
    for pool in pools:
        if resource.name in pool.uses:
            per = (
                pool.concurrency
                if resource.per_process == "concurrency"
                else (pool.db_pool_size or pool.concurrency)
            )
            for _replica in range(pool.max_replicas):
                total += pool.processes * per
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
    for pool in pools:
        cap = capped_max_replicas(pool, resources)
        assert cap <= pool.max_replicas
        for r in resources:
            if r.name in pool.uses:
                assert cap * per_replica_usage(pool, r) <= r.budget
        if fits:
            assert cap == pool.max_replicas


@given(pools_st, resources_st, st.integers(1, 20))
def test_more_replicas_never_turns_a_refusal_into_a_pass(
    pools: list[PoolSpec], resources: tuple[DownstreamSpec, DownstreamSpec], extra: int
) -> None:
    if not pools:
        return
    grown = [
        PoolSpec(**{**p.__dict__, "max_replicas": p.max_replicas + extra}) if i == 0 else p
        for i, p in enumerate(pools)
    ]
    fits = all(u.fits for u in capacity_report(pools, resources))
    fits_grown = all(u.fits for u in capacity_report(grown, resources))
    assert fits or not fits_grown
