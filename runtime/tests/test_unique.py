"""Unique jobs (issue #42 item 3) against a real Redis and a real Dramatiq worker (the
service's broker and middleware): the lock is taken with the enqueue, kept by a retry,
freed by the ack or the dead letter, left to a newer holder once its TTL lapsed; debounce
replaces a pending delayed job; bad input is one line and enqueues nothing. The real
processes (producers racing, a worker SIGKILLed, a Sentinel failover) are the template's
``tests/test_unique_jobs.py``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import pytest
import redis

from worker_runtime import layout
from worker_runtime.testing import Jobs
from worker_runtime.unique import DuplicateJob, Unique, UniqueError

QUEUE = "notifications"


#: The test's Redis, set by the ``record`` fixture (not Dramatiq's global broker: another
#: test of this process may have set a stub broker there).
_clients: list[redis.Redis] = []


def _record(key: str, n: int, fail_times: int = 0, wait_for_go: bool = False) -> None:
    """Fails its first ``fail_times`` attempts; the next waits for ``uq:go:<n>`` when
    ``wait_for_go``, then records its run."""
    client = _clients[-1]
    if client.incr(f"uq:attempt:{n}") <= fail_times:
        raise RuntimeError("failing on purpose")
    if wait_for_go:
        deadline = time.monotonic() + 20
        while not client.exists(f"uq:go:{n}") and time.monotonic() < deadline:
            time.sleep(0.02)
    client.rpush(f"uq:runs:{key}", n)


@pytest.fixture
def record(jobs: Jobs) -> Iterator[dramatiq.Actor[Any, Any]]:
    """``uq_record(key, n, fail_times, wait_for_go)`` on the notifications queue, unique by
    ``key`` (an hour), retried after 50-100 ms; the queue paused until a test resumes it."""
    broker = jobs.broker
    if "uq_record" not in broker.actors:
        dramatiq.actor(
            broker=broker,
            actor_name="uq_record",
            queue_name=QUEUE,
            min_backoff=50,
            max_backoff=100,
            max_retries=1,
            unique=Unique(key="key", ttl_ms=3_600_000),
        )(_record)
    jobs.queues.add(QUEUE)
    _clients.append(jobs.client)
    layout.pause(jobs.client, QUEUE)
    yield broker.actors["uq_record"]
    layout.resume(jobs.client, QUEUE)


def runs(client: redis.Redis, key: str) -> list[int]:
    return [int(n) for n in client.lrange(f"uq:runs:{key}", 0, -1)]


def lock(client: redis.Redis, key: str) -> str | None:
    found = client.get(layout.unique_key("uq_record", f'key="{key}"'))
    return None if found is None else layout.text(found)


def until(predicate: Callable[[], object], what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def counts(client: redis.Redis) -> dict[tuple[str, str], int]:
    return layout.dedupe_counts(client, [QUEUE])


def test_an_equal_send_is_skipped_while_the_job_is_queued_and_accepted_once_it_ran(
    jobs: Jobs, record: dramatiq.Actor[Any, Any]
) -> None:
    first = record.send("a", 1)
    with pytest.raises(DuplicateJob) as raised:
        record.send("a", 2)
    assert raised.value.holder == first.message_id
    assert str(raised.value).count("\n") == 0 and "uq_record: not enqueued" in str(raised.value)
    other = record.send("b", 3)  # another key: its own lock
    assert jobs.client.llen(f"dramatiq:{QUEUE}") == 2, "the skipped send stored nothing"
    assert lock(jobs.client, "a") == first.message_id
    assert counts(jobs.client)[(QUEUE, layout.DEDUPE_SKIPPED)] == 1
    layout.resume(jobs.client, QUEUE)
    until(lambda: runs(jobs.client, "a") == [1] and runs(jobs.client, "b") == [3], "the runs")
    # each job's own ack frees its lock, after its handler recorded the run
    until(lambda: lock(jobs.client, "a") is None, "the ack to free a's lock")
    until(lambda: lock(jobs.client, "b") is None, "the ack to free b's lock")
    assert other.message_id
    record.send("a", 4)  # accepted again
    until(lambda: runs(jobs.client, "a") == [1, 4], "the new job")


def test_a_retry_keeps_the_lock_and_a_dead_letter_frees_it(
    jobs: Jobs, record: dramatiq.Actor[Any, Any]
) -> None:
    layout.resume(jobs.client, QUEUE)
    retried = record.send("r", 10, 1, True)  # fails once; its retry waits for uq:go:10
    until(lambda: int(jobs.client.get("uq:attempt:10") or 0) == 2, "the retry to start")
    with pytest.raises(DuplicateJob):  # failed, settled as a retry, running again
        record.send("r", 11)
    jobs.client.set("uq:go:10", 1)
    until(lambda: runs(jobs.client, "r") == [10], "the retry to run")
    until(lambda: lock(jobs.client, "r") is None, "the ack to free the lock")
    assert retried.message_id

    record.send("d", 20, 5)  # fails on both attempts: dead-lettered
    until(lambda: jobs.client.zcard(f"dramatiq:{QUEUE}.XQ") == 1, "the dead letter")
    until(lambda: lock(jobs.client, "d") is None, "the dead letter to free the lock")
    record.send("d", 21)
    until(lambda: runs(jobs.client, "d") == [21], "the next job of the key")


def test_a_lapsed_lock_admits_an_equal_job_and_the_older_ones_end_leaves_the_newer_lock(
    jobs: Jobs, record: dramatiq.Actor[Any, Any]
) -> None:
    older = record.send_with_options(args=("t", 30, 0, True), unique=Unique(key="key", ttl_ms=100))
    time.sleep(0.2)
    newer = record.send_with_options(args=("t", 31, 0, True))  # the actor's TTL: an hour
    assert lock(jobs.client, "t") == newer.message_id, "both are queued: the TTL is the limit"
    layout.resume(jobs.client, QUEUE)
    jobs.client.set("uq:go:30", 1)
    until(lambda: runs(jobs.client, "t") == [30], "the older job")
    time.sleep(0.2)
    assert lock(jobs.client, "t") == newer.message_id, "the older job's ack left it alone"
    jobs.client.set("uq:go:31", 1)
    until(lambda: lock(jobs.client, "t") is None, "the newer job's ack")
    assert runs(jobs.client, "t") == [30, 31] and older.message_id


def test_debounce_replaces_a_delayed_job_and_skips_once_it_is_due(
    jobs: Jobs, record: dramatiq.Actor[Any, Any]
) -> None:
    debounce = Unique(key="key", ttl_ms=60_000, debounce=True)
    first = record.send_with_options(args=("w", 40), delay=60_000, unique=debounce)
    second = record.send_with_options(args=("w", 41), delay=60_000, unique=debounce)
    assert lock(jobs.client, "w") == second.message_id
    delayed = jobs.client.hgetall(f"dramatiq:{QUEUE}.DQ.msgs")
    assert len(delayed) == 1 and b'"args":["w",41]' in next(iter(delayed.values()))
    assert layout.live_place(jobs.client, QUEUE, first.message_id) is None
    assert counts(jobs.client)[(QUEUE, layout.DEDUPE_REPLACED)] == 1
    with pytest.raises(UniqueError, match=r"^uq_record: unique debounce needs a delay"):
        record.send_with_options(args=("w", 42), unique=debounce)

    due = record.send_with_options(args=("v", 50), delay=1, unique=debounce)
    until(lambda: jobs.client.llen(f"dramatiq:{QUEUE}") == 1, "the due job moved to its queue")
    with pytest.raises(DuplicateJob) as raised:  # queued (due), no longer replaceable
        record.send_with_options(args=("v", 51), delay=60_000, unique=debounce)
    assert raised.value.holder == due.message_id


def test_a_unique_id_given_per_send(jobs: Jobs, record: dramatiq.Actor[Any, Any]) -> None:
    by_id = Unique(id="nightly-7", ttl_ms=60_000)
    record.send_with_options(args=("x", 60), unique=by_id)
    with pytest.raises(DuplicateJob):
        record.send_with_options(args=("y", 61), unique=by_id)  # other arguments, same id
    record.send_with_options(args=("x", 62), unique=None)  # without the actor's option


@pytest.mark.parametrize(
    ("make", "line"),
    [
        (lambda: Unique(key="key", ttl_ms=0), "unique: ttl_ms must be a whole number of ms"),
        (lambda: Unique(key="key", ttl_ms=-5), "unique: ttl_ms must be a whole number of ms"),
        (lambda: Unique(ttl_ms=5), "unique: give key=<argument field(s)> or id="),
    ],
)
def test_a_bad_unique_option_is_one_line(make: Callable[[], Unique], line: str) -> None:
    with pytest.raises(UniqueError) as raised:
        make()
    assert str(raised.value).startswith(line) and "\n" not in str(raised.value)


def test_an_unknown_key_field_is_one_line_and_enqueues_nothing(
    jobs: Jobs, record: dramatiq.Actor[Any, Any]
) -> None:
    with pytest.raises(UniqueError) as raised:
        record.send_with_options(args=("z", 70), unique=Unique(key="tenant", ttl_ms=1000))
    assert str(raised.value) == (
        "uq_record: unique key field 'tenant' is not one of its arguments "
        "(key, n, fail_times, wait_for_go)"
    )
    assert jobs.client.llen(f"dramatiq:{QUEUE}") == 0

    def other(key: str) -> None: ...

    with pytest.raises(UniqueError, match=r"^uq_bad: unique key field 'tenant' is not one"):
        dramatiq.actor(
            broker=jobs.broker,
            actor_name="uq_bad",
            queue_name=QUEUE,
            unique=Unique(key="tenant", ttl_ms=1000),
        )(other)


def test_a_typed_actors_key_is_its_model_field(
    jobs: Jobs, record: dramatiq.Actor[Any, Any]
) -> None:
    notify = jobs.broker.actors["send_notification"]
    jobs.queues.add(notify.queue_name)
    layout.pause(jobs.client, notify.queue_name)
    once = Unique(key="notification_id", ttl_ms=60_000)
    try:
        first = notify.send_with_options(args=(7, "welcome", "n-1"), unique=once)
        with pytest.raises(DuplicateJob) as raised:
            notify.send_with_options(
                kwargs={"user_id": 8, "template": "x", "notification_id": "n-1"}, unique=once
            )
        assert raised.value.holder == first.message_id
        key = layout.unique_key("send_notification", 'notification_id="n-1"')
        assert layout.text(jobs.client.get(key)) == first.message_id
        notify.send_with_options(args=(7, "welcome", "n-2"), unique=once)  # another key
    finally:
        layout.resume(jobs.client, notify.queue_name)
