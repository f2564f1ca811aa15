"""Memory, timing, isolation and environment guards (pure)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from templatepools import TIMING, pool
from worker_runtime import pools

from worker_infra import GuardError, Timing, check_memory, check_timing, grace_period_s, plan
from worker_infra.guards import check_env, check_isolation, memory_needed, secret_like

MI = 2**20
# supervisor 50Mi + 2 probes x 56Mi
FIXED = 162


def test_memory_guard_accepts_the_boundary_and_refuses_one_handler_more() -> None:
    # 2 processes x (4 handlers x 100Mi + 96Mi base) + 162Mi = 1154Mi
    fits = pool("bulk", processes=2, concurrency=4, memory="1154Mi", handler_memory="100Mi")
    assert memory_needed(fits) == (992 + FIXED) * MI
    check_memory(fits)
    over = pool("bulk", processes=2, concurrency=5, memory="1154Mi", handler_memory="100Mi")
    with pytest.raises(GuardError) as refused:
        check_memory(over)
    assert str(refused.value) == (
        "memory guard: pool 'bulk' needs 1354Mi = handler_memory 100Mi x concurrency 5 x "
        "processes 2 + base 96Mi x processes 2 + supervisor 50Mi + 2 probes x 56Mi, "
        "above its memory limit 1154Mi"
    )


def test_memory_guard_counts_the_supervisor_and_the_probes() -> None:
    # Fits on handlers and base alone (4 x 32 + 96 = 224Mi), not with the rest.
    small = pool("p", concurrency=4, memory="256Mi", handler_memory="32Mi")
    with pytest.raises(GuardError, match="needs 386Mi"):
        check_memory(small)


def test_memory_guard_skips_pools_without_handler_memory() -> None:
    check_memory(pool("p", concurrency=256, memory="1Mi"))


def test_grace_is_the_drain_window_rounded_up_plus_margin() -> None:
    p = pool("p", job_timeout_ms=30_000, shutdown_timeout_ms=40_500)
    assert grace_period_s(p) == 41 + 15
    assert grace_period_s(p, margin_s=0) == 41


def test_job_timeout_at_or_above_shutdown_timeout_is_the_models_to_refuse() -> None:
    with pytest.raises(ValueError, match=r"job_timeout_ms \(40000\) must be below"):
        pool("slow", job_timeout_ms=40_000, shutdown_timeout_ms=40_000)
    assert pools.timing_problems(39_999, 40_000) == []
    assert pools.timing_problems(40_000, 40_000) != []


def test_timing_guard_leaves_room_for_the_supervisors_kill_after_the_drain() -> None:
    """grace must exceed drain + KILL_AFTER_DRAIN_S (10 s): a margin of 5 s passed the old
    guard (drain < grace), and the kubelet's SIGKILL came before the supervisor's kill."""
    assert TIMING.kill_after_drain_s == 10.0
    p = pool("p", job_timeout_ms=30_000, shutdown_timeout_ms=40_000)
    for margin in (0, 5, 10):
        with pytest.raises(
            GuardError,
            match=rf"timing guard: pool 'p': grace period {40 + margin} s must exceed "
            r"shutdown_timeout_ms \(40000\) \+ the supervisor's kill after 10 s = 50 s",
        ):
            check_timing(p, grace_period_s(p, margin_s=margin), TIMING)
    check_timing(p, grace_period_s(p, margin_s=11), TIMING)
    check_timing(p, grace_period_s(p), TIMING)


def test_the_timing_guard_is_the_services_rule() -> None:
    """worker_infra applies the rule it is handed, not a copy of its own."""
    calls = []

    def rule(job: int, drain: int, grace_s: float, kill_after_s: float) -> list[str]:
        calls.append((job, drain, grace_s, kill_after_s))
        return ["no"]

    p = pool("p", job_timeout_ms=30_000, shutdown_timeout_ms=40_000)
    with pytest.raises(GuardError, match="timing guard: pool 'p': no"):
        plan([p], [], Timing(rule, 7.5))
    assert calls == [(30_000, 40_000, 55, 7.5)]


@given(st.integers(100, 10**6), st.integers(1_000, 10**6), st.integers(0, 120))
def test_a_plan_always_orders_job_shutdown_kill_and_grace(
    job: int, shutdown: int, margin: int
) -> None:
    try:
        p = pool("p", job_timeout_ms=job, shutdown_timeout_ms=shutdown)
        result = plan([p], [], TIMING, grace_margin_s=margin)
    except (GuardError, ValueError):
        grace_s = -(-shutdown // 1000) + margin
        assert job >= shutdown or grace_s * 1000 <= shutdown + 10_000
    else:
        assert job < shutdown < shutdown + 10_000 < result.pools[0].grace_s * 1000


def test_a_queue_served_by_two_pools_is_refused() -> None:
    with pytest.raises(GuardError, match="queue 'emails' is served by pools 'a' and 'b'"):
        check_isolation([pool("a", ("emails",)), pool("b", ("sms", "emails"))])


def test_a_sandbox_pool_using_a_downstream_resource_is_refused() -> None:
    with pytest.raises(ValueError, match="a sandbox pool uses no downstream resource"):
        pool("sandbox", ("untrusted",), sandbox=True, uses=["postgres"])
    sneaked = dataclasses.replace(pool("sandbox", ("untrusted",), sandbox=True), uses=("postgres",))
    with pytest.raises(GuardError, match="sandbox pool 'sandbox' uses postgres"):
        check_isolation([sneaked])


def test_min_above_max_replicas_is_refused() -> None:
    with pytest.raises(ValueError, match=r"min_replicas \(3\) exceeds max_replicas \(2\)"):
        pool("p", min_replicas=3, max_replicas=2)
    sneaked = dataclasses.replace(pool("p"), min_replicas=3)
    with pytest.raises(GuardError, match=r"min_replicas \(3\)"):
        plan([sneaked], [], TIMING)


POOL_ENV = frozenset(pools.pool_env_fields().values())


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("WORKER_PROCESSES", "16", "env WORKER_PROCESSES: shapes the pool"),
        ("WORKER_CONCURRENCY", "64", "env WORKER_CONCURRENCY: shapes the pool"),
        ("DB_POOL_SIZE", "64", "env DB_POOL_SIZE: shapes the pool"),
        ("WORKER_PREFETCH", "1000", "env WORKER_PREFETCH: shapes the pool"),
        ("WORKER_POOLS_FILE", "/app/pools.toml", "env WORKER_POOLS_FILE: set by worker_infra"),
        ("DATABASE_URL", "postgresql://db/app", "env DATABASE_URL: set by worker_infra"),
        ("SENTRY_DSN", "https://key@sentry.io/1", "env SENTRY_DSN: looks like a secret"),
        ("API_TOKEN", "abc", "env API_TOKEN: looks like a secret"),
        ("UPSTREAM", "https://user:pw@api.example.com", "env UPSTREAM: looks like a secret"),
    ],
)
def test_stack_env_cannot_set_pool_shaping_managed_or_secret_variables(
    name: str, value: str, problem: str
) -> None:
    with pytest.raises(GuardError, match=problem):
        check_env({"LOG_LEVEL": "INFO", name: value}, POOL_ENV)


def test_every_pool_shaping_variable_is_named_by_the_model() -> None:
    assert {
        "WORKER_QUEUES",
        "WORKER_PROCESSES",
        "WORKER_CONCURRENCY",
        "WORKER_JOB_TIMEOUT_MS",
        "WORKER_SHUTDOWN_TIMEOUT_MS",
        "WORKER_MAX_ATTEMPTS",
        "WORKER_PREFETCH",
        "WORKER_PRIORITY_BOUND",
        "DB_POOL_SIZE",
    } == POOL_ENV
    check_env({"LOG_LEVEL": "DEBUG", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4317"}, POOL_ENV)
    assert not secret_like("LOG_LEVEL", "INFO")


class _OlderModel:
    """The model of a service baked from an older template: ``missing`` is not a field yet."""

    def __init__(self, model: object, missing: str) -> None:
        self._model, self._missing = model, missing

    def __getattr__(self, name: str) -> object:
        if name == self._missing:
            raise AttributeError(name)
        return getattr(self._model, name)


def test_a_service_model_older_than_worker_infra_is_refused_in_one_line() -> None:
    from worker_infra import DownstreamSpec, PoolSpec

    model = pools.Pool(queues=["q"])
    with pytest.raises(GuardError) as refused:
        PoolSpec.of("bulk", _OlderModel(model, "critical"))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("pool 'bulk': the service's model has no field 'critical'")
    assert "infra/requirements.txt" in message
    downstream = pools.Downstream(capacity=10)
    with pytest.raises(GuardError, match="downstream 'pg': .* no field 'reserved'"):
        DownstreamSpec.of("pg", _OlderModel(downstream, "reserved"))
