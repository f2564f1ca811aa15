"""Memory, timing and isolation guards (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker_infra import GuardError, PoolSpec, check_memory, check_timing, grace_period_s, plan
from worker_infra.guards import check_isolation, memory_bytes, memory_needed

MI = 2**20


def test_memory_bytes() -> None:
    assert memory_bytes("512Mi") == 512 * MI
    assert memory_bytes("1Gi") == 1024 * MI
    assert memory_bytes("1G") == 10**9
    with pytest.raises(ValueError, match="not a Kubernetes memory quantity"):
        memory_bytes("lots")


def test_memory_guard_accepts_the_boundary_and_refuses_one_handler_more() -> None:
    # 2 processes x (4 handlers x 100Mi + 96Mi base) = 992Mi
    fits = PoolSpec(
        "bulk", ("r",), processes=2, concurrency=4, memory="992Mi", handler_memory="100Mi"
    )
    assert memory_needed(fits) == 992 * MI
    check_memory(fits)
    over = PoolSpec(
        "bulk", ("r",), processes=2, concurrency=5, memory="992Mi", handler_memory="100Mi"
    )
    with pytest.raises(GuardError) as refused:
        check_memory(over)
    assert str(refused.value) == (
        "memory guard: pool 'bulk' needs 1192Mi = handler_memory 100Mi x concurrency 5 x "
        "processes 2 + base 96Mi x processes 2, above its memory limit 992Mi"
    )


def test_memory_guard_skips_pools_without_handler_memory() -> None:
    check_memory(PoolSpec("p", ("q",), concurrency=256, memory="1Mi"))


def test_grace_is_the_drain_window_rounded_up_plus_margin() -> None:
    pool = PoolSpec("p", ("q",), job_timeout_ms=30_000, shutdown_timeout_ms=40_500)
    assert grace_period_s(pool) == 41 + 15
    assert grace_period_s(pool, margin_s=0) == 41


def test_timing_guard_refuses_job_timeout_at_or_above_shutdown_timeout() -> None:
    pool = PoolSpec("slow", ("q",), job_timeout_ms=40_000, shutdown_timeout_ms=40_000)
    with pytest.raises(
        GuardError, match=r"pool 'slow' job timeout 40000 ms >= shutdown timeout 40000 ms"
    ):
        check_timing(pool, grace_period_s(pool))


def test_timing_guard_refuses_grace_at_or_below_shutdown_timeout() -> None:
    pool = PoolSpec("p", ("q",), job_timeout_ms=30_000, shutdown_timeout_ms=40_000)
    with pytest.raises(GuardError, match=r"grace period 40 s <= shutdown timeout 40000 ms"):
        check_timing(pool, grace_period_s(pool, margin_s=0))
    check_timing(pool, grace_period_s(pool, margin_s=1))


@given(st.integers(100, 10**6), st.integers(1_000, 10**6), st.integers(0, 120))
def test_a_plan_always_orders_job_shutdown_and_grace(job: int, shutdown: int, margin: int) -> None:
    pool = PoolSpec("p", ("q",), job_timeout_ms=job, shutdown_timeout_ms=shutdown)
    try:
        result = plan([pool], [], grace_margin_s=margin)
    except GuardError:
        assert job >= shutdown or grace_period_s(pool, margin) * 1000 <= shutdown
    else:
        assert job < shutdown < result.pools[0].grace_s * 1000


def test_a_queue_served_by_two_pools_is_refused() -> None:
    with pytest.raises(GuardError, match="queue 'emails' is served by pools 'a' and 'b'"):
        check_isolation([PoolSpec("a", ("emails",)), PoolSpec("b", ("sms", "emails"))])


def test_a_sandbox_pool_using_a_downstream_resource_is_refused() -> None:
    with pytest.raises(GuardError, match="sandbox pool 'sandbox' uses postgres"):
        check_isolation([PoolSpec("sandbox", ("u",), sandbox=True, uses=("postgres",))])


def test_min_above_max_replicas_is_refused() -> None:
    with pytest.raises(GuardError, match=r"min_replicas \(3\)"):
        plan([PoolSpec("p", ("q",), min_replicas=3, max_replicas=2)], [])
