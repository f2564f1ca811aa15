"""CrashAwareRetries on Dramatiq's StubBroker: what ends each failed delivery.

The broker records the settlement each delivery ends with, as the worker's broker stores
it with the ack (:class:`stub_brokers.SettlingStubBroker`): the retry copy is part of
the settlement, never enqueued from the hook.
"""

from __future__ import annotations

import time
from typing import Any

import dramatiq
from dramatiq import Message
from dramatiq.common import dq_name

from worker_runtime.layout import CRASHES, DEAD_LETTER_REASON, REDIS_MESSAGE_ID, RETRIES
from worker_runtime.lifecycle import Requeue
from worker_runtime.middleware import CrashAwareRetries, GracefulShutdown
from worker_runtime.middleware.time_limit import TimeLimitExceeded
from worker_runtime.settlement import TIME_LIMIT_REASON, Settlement

from stub_brokers import SettlingStubBroker, work_off

MAX_RETRIES = 2  # WORKER_MAX_ATTEMPTS = 3
BACKOFF_MS = 60_000


def options(pairs: dict[str, Any]) -> dict[str, Any]:
    """Message options keyed by our constants, typed for ``send_with_options(**...)``."""
    return pairs


def retrying_broker() -> SettlingStubBroker:
    return SettlingStubBroker(
        middleware=[
            GracefulShutdown(),
            CrashAwareRetries(
                max_retries=MAX_RETRIES, min_backoff=BACKOFF_MS, max_backoff=BACKOFF_MS
            ),
        ]
    )


def settle_all(broker: SettlingStubBroker, queue: str) -> list[Settlement]:
    work_off(broker, queue)
    return broker.settlements()


def reason_of(settlement: Settlement) -> str:
    return str(Message.decode(settlement.body).options[DEAD_LETTER_REASON])


def test_a_failure_with_attempts_left_is_a_delayed_copy_stored_with_the_ack() -> None:
    broker = retrying_broker()

    @dramatiq.actor(broker=broker, queue_name="retried")
    def fails() -> None:
        raise ValueError("boom")

    sent = fails.send()
    started = time.time() * 1000
    (settlement,) = settle_all(broker, "retried")

    assert settlement.kind == "retry"
    assert settlement.target_queue == dq_name("retried")
    copy = Message.decode(settlement.body)
    assert copy.message_id == sent.message_id
    assert copy.queue_name == dq_name("retried")
    assert copy.options[RETRIES] == 1
    assert copy.options[REDIS_MESSAGE_ID] == settlement.target_id
    assert started + BACKOFF_MS / 2 <= copy.options["eta"] <= time.time() * 1000 + BACKOFF_MS
    assert settlement.sent is not None and settlement.delay is not None
    assert broker.queues[dq_name("retried")].qsize() == 0, "not enqueued from the hook"


def test_crashes_use_up_the_same_budget() -> None:
    broker = retrying_broker()

    @dramatiq.actor(broker=broker, queue_name="crashed")
    def fails(n: int) -> None:
        raise ValueError(f"boom {n}")

    fails.send_with_options(args=(1,), **options({CRASHES: MAX_RETRIES - 1}))  # one attempt left
    fails.send_with_options(args=(2,), **options({CRASHES: MAX_RETRIES}))  # the last attempt
    last = options({CRASHES: 1, RETRIES: MAX_RETRIES - 1})  # the last attempt too
    fails.send_with_options(args=(3,), **last)
    kinds = [s.kind for s in settle_all(broker, "crashed")]
    assert kinds == ["retry", "dead_letter", "dead_letter"]
    dead = broker.settlements()[1:]
    assert [reason_of(s) for s in dead] == ["ValueError: boom 2", "ValueError: boom 3"]


def test_an_actor_may_lower_the_budget_but_not_raise_it() -> None:
    broker = retrying_broker()

    @dramatiq.actor(broker=broker, queue_name="budget", max_retries=0)
    def frail() -> None:
        raise ValueError("once")

    @dramatiq.actor(broker=broker, queue_name="budget", max_retries=50)
    def greedy() -> None:
        raise ValueError("again")

    frail.send()
    greedy.send_with_options(**options({RETRIES: MAX_RETRIES}))
    assert [s.kind for s in settle_all(broker, "budget")] == ["dead_letter", "dead_letter"]


def test_a_time_limit_is_the_dead_letters_reason() -> None:
    broker = retrying_broker()

    @dramatiq.actor(broker=broker, queue_name="slow", max_retries=0)
    def slow() -> None:
        raise TimeLimitExceeded()

    slow.send()
    (settlement,) = settle_all(broker, "slow")
    assert settlement.kind == "dead_letter"
    assert reason_of(settlement) == TIME_LIMIT_REASON


def test_a_shutdown_is_not_a_failure() -> None:
    broker = retrying_broker()

    @dramatiq.actor(broker=broker, queue_name="stopped")
    def stopped() -> None:
        raise Requeue("shutdown")

    # would be dead-lettered as a failure
    stopped.send_with_options(**options({RETRIES: MAX_RETRIES}))
    (settlement,) = settle_all(broker, "stopped")
    assert settlement == Settlement("requeue")
    assert broker.dead_letters == []
