"""CappedTimeLimit on Dramatiq's StubBroker: fast, no Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq import Message, Worker
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker

from worker_runtime.middleware.time_limit import CappedTimeLimit, TimeLimitExceeded

CEILING_MS = 300


@pytest.fixture
def broker() -> Iterator[StubBroker]:
    broker = StubBroker(middleware=[CappedTimeLimit(time_limit=CEILING_MS, interval=10)])
    broker.emit_after("process_boot")
    yield broker
    broker.close()


def proxy(actor: dramatiq.Actor[..., None], **options: Any) -> MessageProxy:
    message: Message[None] = actor.message_with_options(**options)
    return MessageProxy(message)


def test_limit_is_the_setting_lowered_never_raised(broker: StubBroker) -> None:
    limiter = next(m for m in broker.middleware if isinstance(m, CappedTimeLimit))

    @dramatiq.actor(broker=broker)
    def plain() -> None: ...

    @dramatiq.actor(broker=broker, time_limit=60_000)
    def greedy() -> None: ...

    @dramatiq.actor(broker=broker, time_limit=100)
    def modest() -> None: ...

    assert limiter.limit_ms(broker, proxy(plain)) == CEILING_MS
    assert limiter.limit_ms(broker, proxy(greedy)) == CEILING_MS
    assert limiter.limit_ms(broker, proxy(plain, time_limit=60_000)) == CEILING_MS
    assert limiter.limit_ms(broker, proxy(modest)) == 100
    assert limiter.limit_ms(broker, proxy(greedy, time_limit=50)) == 50


def test_watchdog_starts_once_whichever_hook_comes_first(broker: StubBroker) -> None:
    limiter = next(m for m in broker.middleware if isinstance(m, CappedTimeLimit))
    assert limiter.running
    broker.emit_after("process_boot")  # a second boot hook does not start a second thread
    fresh = CappedTimeLimit(time_limit=CEILING_MS)
    assert not fresh.running
    fresh.before_worker_boot(broker, Worker(broker))
    assert fresh.running


def test_actor_declaring_a_larger_limit_is_interrupted_at_the_ceiling(
    broker: StubBroker,
) -> None:
    ended: list[float] = []

    @dramatiq.actor(broker=broker, time_limit=60_000)
    def slow() -> None:
        started = time.monotonic()
        try:
            while time.monotonic() - started < 5:
                time.sleep(0.01)
        except TimeLimitExceeded:
            ended.append(time.monotonic() - started)
            raise
        ended.append(float("inf"))  # ran to the end

    slow.send()
    worker = Worker(broker, worker_timeout=50)
    worker.start()
    try:
        broker.join(slow.queue_name, timeout=10_000)
        worker.join()
    finally:
        worker.stop()
    # Cut at the ceiling, not at the actor's 60 s nor at the loop's end (5 s): a busy
    # machine may only delay the watchdog's tick, never bring it forward.
    (cut,) = ended
    assert CEILING_MS / 1000 <= cut < 5, cut
