"""Redis not answering is said once, then a line a minute while it lasts, then once when it
answers (:class:`worker_runtime.outage.Outage`), on a clock the test moves."""

from __future__ import annotations

import logging

import pytest
import redis

from worker_runtime.outage import SAY_EVERY_S, Outage


def test_an_outage_is_said_once_then_once_a_minute_then_once_when_redis_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1000.0]
    outage = Outage("redis://:s3cret@redis:6379/0", clock=lambda: now[0])
    error = redis.ConnectionError("Error 111 connecting to redis:6379. Connection refused.")

    def said() -> list[str]:
        return [str(getattr(r, "event", "")) for r in caplog.records]

    with caplog.at_level(logging.INFO, logger="worker_runtime.outage"):
        outage.answered()  # no outage: nothing to say
        assert said() == []
        for step in range(0, int(SAY_EVERY_S), 2):  # a try every 2 s for the first minute
            now[0] = 1000.0 + step
            outage.failed(error)
        assert said() == ["redis_unreachable"], "the first failure alone, in the first minute"
        assert "s3cret" not in caplog.text and "REDIS_URL=" in caplog.text
        now[0] = 1000.0 + SAY_EVERY_S
        outage.failed(error)
        now[0] += 1
        outage.failed(error)
        assert said() == ["redis_unreachable", "redis_still_unreachable"], "a minute on: once"
        now[0] = 1000.0 + 2 * SAY_EVERY_S
        outage.failed(error)
        assert said()[-1] == "redis_still_unreachable" and len(said()) == 3
        now[0] += 5
        outage.answered()
        outage.answered()
        assert said()[-1] == "redis_reachable" and len(said()) == 4, "answered: once"
        (back,) = [r for r in caplog.records if getattr(r, "event", "") == "redis_reachable"]
        assert back.__dict__["unreachable_s"] == 2 * SAY_EVERY_S + 5
        assert outage.failures == 0 and not outage.down
