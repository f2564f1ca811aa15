"""worker_runtime.timing: the timing relations hold, and each check fails when a number
breaks its rule; the runtime's modules use timing's numbers, not their own."""

from __future__ import annotations

import pytest

from worker_runtime import consumer, idempotency, layout, pools, redisbroker, timing, worker
from worker_runtime.middleware import CrashAwareRetries

#: (number, a value that breaks its rule, words of the line that says so).
BROKEN = [
    ("KILL_AFTER_DRAIN_S", 5.0, "KILL_AFTER_DRAIN_S (5) must be at least"),
    ("INTERRUPT_GRACE_S", 7.0, "KILL_AFTER_DRAIN_S (10) must be at least"),
    ("ORPHAN_AFTER_S", 10.0, "ORPHAN_AFTER_S (10) must exceed REDIS_SOCKET_TIMEOUT_S"),
    ("REDIS_SOCKET_TIMEOUT_S", 60, "ORPHAN_AFTER_S (60) must exceed"),
    ("CLOCK_FRESH_S", 5.0, "CLOCK_FRESH_S (5) must exceed HEARTBEAT_INTERVAL_MAX_S"),
    ("MAX_BACKOFF_MS", 8 * 86_400_000, "the 7-day windows"),
    ("COMPOSE_GRACE_MARGIN_S", 10, "COMPOSE_GRACE_MARGIN_S (10) must exceed"),
]


def test_every_relation_holds() -> None:
    assert timing.relation_problems() == []


@pytest.mark.parametrize(("name", "value", "words"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_number_that_breaks_its_rule_is_named(
    monkeypatch: pytest.MonkeyPatch, name: str, value: float, words: str
) -> None:
    monkeypatch.setattr(timing, name, value)
    problems = timing.relation_problems()
    assert len(problems) == 1 and words in problems[0], problems


def test_the_runtime_uses_timings_numbers() -> None:
    assert pools.KILL_AFTER_DRAIN_S is timing.KILL_AFTER_DRAIN_S
    assert pools.timing_problems is timing.timing_problems
    for module, names in (
        (worker, ("INTERRUPT_GRACE_S", "CONSUMER_STOP_S", "DRAIN_REDIS_TIMEOUT_S")),
        (consumer, ("ORPHAN_AFTER_S",)),
        (redisbroker, ("CLOCK_FRESH_S",)),
    ):
        for name in names:  # imported from timing, never stated again
            assert vars(module)[name] is vars(timing)[name], (module.__name__, name)
    # the 7-day windows and the retries' longest backoff (Dramatiq's default, kept)
    assert layout.CANCEL_TTL_MS == timing.SEVEN_DAYS_MS
    assert idempotency.KEEP_S * 1000 == timing.SEVEN_DAYS_MS
    assert CrashAwareRetries().max_backoff == timing.MAX_BACKOFF_MS


def test_compose_grace_is_the_drain_window_and_the_margin() -> None:
    assert timing.compose_grace_s(40_000) == 55
    assert timing.compose_grace_s(40_001) == 56
