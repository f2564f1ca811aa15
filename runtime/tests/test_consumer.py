"""The consumer refills a handler's slot with its settlement and never holds more than prefetch.

Against a real Redis: a settlement takes the next message in the same Lua call (no
fetch of its own), the acks set never holds more than the prefetch while several
threads settle and fetch at once, and once the drain stops fetching a settlement
takes nothing. A message taken by a call whose reply was lost is requeued, never held
for good, and a take whose reply is only late is never mistaken for one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq import Message
from dramatiq.broker import MessageProxy

from worker_runtime import consumer as consumer_module
from worker_runtime import layout
from worker_runtime.redisbroker import SettlingRedisBroker
from worker_runtime.settlement import ACK, lost_reason, settle_with, settlement_of
from worker_runtime.timing import ORPHAN_AFTER_S


def work(broker: SettlingRedisBroker, queue: str, threads: int) -> None:
    """Run a Worker with ``threads`` handler threads and as many prefetched messages until
    every message of ``queue`` is settled; then stop it and close ``broker``."""
    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=50)
    worker.queue_prefetch = threads
    worker.start()
    try:
        broker.join(queue, timeout=30_000)
    finally:
        worker.stop()
        broker.close()


def held_and_queued(redis_url: str, broker: SettlingRedisBroker, queue: str) -> tuple[int, int]:
    """How many of ``queue``'s messages ``broker`` holds, and how many wait in Redis."""
    client = redis.Redis.from_url(redis_url)
    return client.scard(layout.acks_key(broker.broker_id, queue)), client.llen(
        layout.queue_key(queue)
    )


def enqueue(broker: SettlingRedisBroker, queue: str, count: int) -> None:
    for n in range(count):
        message: Message[Any] = Message(
            queue_name=queue, actor_name="job", args=(n,), kwargs={}, options={}
        )
        broker.enqueue(message)


def declare_job(broker: SettlingRedisBroker, queue: str) -> None:
    @dramatiq.actor(broker=broker, actor_name="job", queue_name=queue)
    def job(n: int) -> None:
        pass


def counting(owner: Any, name: str) -> list[int]:
    """Count the calls of ``owner.name`` from now on (it is wrapped in place)."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    setattr(owner, name, counted)
    return calls


def counting_fetches(broker: SettlingRedisBroker) -> list[int]:
    """Count the consumer thread's own fetches (FETCH calls) from now on."""
    return counting(broker, "fetch_script")


def held_one(broker: SettlingRedisBroker, queue: str, count: int) -> Any:
    """A consumer of ``queue`` (prefetch 1) holding the first of ``count`` new messages."""
    declare_job(broker, queue)
    enqueue(broker, queue, count)
    consumer = broker.consume(queue, prefetch=1, timeout=50)
    message = next(consumer)
    assert message is not None
    return consumer, message


def test_a_settlement_takes_the_next_message_in_the_same_call(redis_url: str) -> None:
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    declare_job(broker, "refill")
    enqueue(broker, "refill", 3)
    fetches = counting_fetches(broker)
    consumer = broker.consume("refill", prefetch=1, timeout=50)
    try:
        first = next(consumer)
        assert first is not None and first.args == (0,) and len(fetches) == 1
        consumer.ack(first)
        second = next(consumer)  # taken by the ack: no fetch
        assert second is not None and second.args == (1,)
        consumer.ack(second)
        third = next(consumer)
        assert third is not None and third.args == (2,)
        assert len(fetches) == 1, "a settlement's refill must spare the consumer's fetch"
        consumer.ack(third)
        assert held_and_queued(redis_url, broker, "refill") == (0, 0)
    finally:
        broker.close()


def test_held_messages_never_exceed_the_prefetch(redis_url: str) -> None:
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    client = redis.Redis.from_url(redis_url)
    acks = layout.acks_key(broker.broker_id, "bounded")
    done: list[int] = []
    most: list[int] = [0]
    lock = threading.Lock()

    @dramatiq.actor(broker=broker, actor_name="job", queue_name="bounded")
    def job(n: int) -> None:
        held = int(client.scard(acks))
        with lock:
            most[0] = max(most[0], held)
            done.append(n)

    enqueue(broker, "bounded", 300)
    work(broker, "bounded", 4)
    assert sorted(done) == list(range(300))
    assert 1 <= most[0] <= 4, f"held {most[0]} messages with a prefetch of 4"


def test_once_fetching_stopped_a_settlement_takes_nothing(redis_url: str) -> None:
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    consumer, first = held_one(broker, "draining", 2)
    try:
        broker.stop_fetching()
        consumer.ack(first)
        assert next(consumer) is None
        assert held_and_queued(redis_url, broker, "draining") == (0, 1)
    finally:
        broker.close()


def test_in_a_worker_the_handlers_take_their_next_jobs_themselves(redis_url: str) -> None:
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    done: list[int] = []

    @dramatiq.actor(broker=broker, actor_name="job", queue_name="handed")
    def job(n: int) -> None:
        done.append(n)

    enqueue(broker, "handed", 200)
    fetches = counting_fetches(broker)
    work(broker, "handed", 2)
    assert sorted(done) == list(range(200))
    # Each settlement took the next message: the consumer thread fetched only to start
    # (and polled the empty queues), not once per job.
    assert len(fetches) < 50, f"{len(fetches)} fetches for 200 jobs"


def test_an_idle_consumer_is_woken_by_an_enqueue_and_by_the_drain(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty queue pauses its consumer (here a minute each time, IDLE_POLL_MS in the
    worker); a producer's enqueue wakes it at once (its wake-up is published in the same
    round trip), and so does stop_fetching (the drain)."""
    monkeypatch.setattr(
        consumer_module, "compute_backoff", lambda misses, **_: (misses + 1, 60_000)
    )
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    producer = SettlingRedisBroker(url=redis_url, middleware=[])  # another process's, say
    ran = threading.Event()

    @dramatiq.actor(broker=broker, actor_name="job", queue_name="woken")
    def job(n: int) -> None:
        ran.set()

    declare_job(producer, "woken")
    fetches = counting_fetches(broker)
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while not fetches and time.monotonic() < deadline:  # the queue found empty
            time.sleep(0.01)
        assert fetches
        time.sleep(0.2)  # they pause now (a minute, unless woken)
        enqueue(producer, "woken", 1)
        assert ran.wait(10), "the enqueue did not wake the idle consumer"
    finally:
        stopping = time.monotonic()
        broker.stop_fetching()
        worker.stop()
        stopped_s = time.monotonic() - stopping
        broker.close()
        producer.close()
    assert stopped_s < 10, f"the drain waited {stopped_s:.1f} s for a paused consumer"


class Hooked(dramatiq.Middleware):
    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self.name = calls, name

    def after_ack(self, broker: dramatiq.Broker, message: Any) -> None:
        self.calls.append(self.name)


class Failing(dramatiq.Middleware):
    def after_ack(self, broker: dramatiq.Broker, message: Any) -> None:
        raise RuntimeError("injected")


def test_signals_reach_exactly_the_middleware_that_handle_them(redis_url: str) -> None:
    calls: list[str] = []
    silent = dramatiq.Middleware()  # defines no hook of its own
    broker = SettlingRedisBroker(
        url=redis_url, middleware=[Hooked(calls, "first"), silent, Failing()]
    )
    try:
        broker.emit_after("ack", None)  # bottom-up; a failing hook is logged, the rest run
        assert calls == ["first"]
        broker.add_middleware(Hooked(calls, "added"))  # the stack changed: seen at once
        setattr(silent, "after_ack", lambda broker, message: calls.append("patched"))  # noqa: B010
        broker.middleware.append(broker.middleware.pop())  # same stack, rebuilt list
        calls.clear()
        broker.emit_after("ack", None)
        assert calls == ["added", "patched", "first"]
        calls.clear()
        broker.emit_before("ack", None)  # nobody defines before_ack
        assert calls == []
    finally:
        broker.close()


def test_settlements_go_on_the_threads_own_connection_not_through_the_pool(
    redis_url: str,
) -> None:
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    consumer, message = held_one(broker, "lane", 3)
    checkouts = counting(broker.client.connection_pool, "get_connection")
    try:
        for n in (1, 2):
            consumer.ack(message)
            message = next(consumer)  # the refill, taken by the ack
            assert message is not None and message.args == (n,)
        consumer.ack(message)
        assert checkouts == [], "a settlement checked a connection out of the pool"
        # Each thread has a lane of its own.
        lanes: list[Any] = [broker.lanes._mine.connection]
        other = threading.Thread(target=lambda: lanes.append(_lane_after_settle(broker)))
        other.start()
        other.join()
        assert lanes[1] is not None and lanes[1] is not lanes[0]
        assert held_and_queued(redis_url, broker, "lane") == (0, 0)
    finally:
        broker.close()
    assert all(lane._sock is None for lane in lanes), "close() left a lane connected"


def _lane_after_settle(broker: SettlingRedisBroker) -> Any:
    broker.settle("lane", "no-such-id", ACK)
    return broker.lanes._mine.connection


def test_a_settlement_survives_a_flushed_script_cache_and_a_killed_connection(
    redis_url: str,
) -> None:
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    admin = redis.Redis.from_url(redis_url)
    consumer, message = held_one(broker, "lost", 4)
    try:
        consumer.ack(message)  # the lane exists now
        message = next(consumer)
        admin.script_flush()  # as a restarted Redis: EVALSHA answers NOSCRIPT
        consumer.ack(message)
        message = next(consumer)
        assert message is not None and message.args == (2,)
        admin.client_kill_filter(_type="normal", skipme=True)  # the lane and the pool's
        consumer.ack(message)
        message = next(consumer)
        assert message is not None and message.args == (3,)
        consumer.ack(message)
        assert held_and_queued(redis_url, broker, "lost") == (0, 0)
    finally:
        broker.close()


def test_a_reply_left_unread_is_never_taken_for_the_next_settlements(redis_url: str) -> None:
    """An exception between a settlement's command and its reply (e.g. raised in the
    thread by a signal) must not leave that reply to be read as the next one's."""
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    consumer, message = held_one(broker, "stray", 2)
    try:
        broker.settle("stray", "no-such-id", ACK)  # makes this thread's lane
        lane = broker.lanes._mine.connection

        def interrupted() -> Any:
            raise KeyboardInterrupt

        lane.read_response = interrupted  # the command is sent, its reply never read
        with pytest.raises(KeyboardInterrupt):
            consumer.ack(message)  # settles message 0 and takes message 1 into the acks set
        del lane.read_response
        # Had the lane kept its socket, this would read the reply above: "settled, and
        # here is message 1", for a delivery this worker never held.
        assert broker.settle_and_take("stray", "no-such-id", ACK, 0)[:2] == (False, [])
        acks = redis.Redis.from_url(redis_url).smembers(layout.acks_key(broker.broker_id, "stray"))
        assert len(acks) == 1  # message 1, taken by the interrupted settlement
    finally:
        broker.close()


def test_a_lost_settlement_reply_leaves_no_message_held_for_good(redis_url: str) -> None:
    """The lane's reply is lost after Redis ran the settlement (a socket timeout): the retry
    through the client settles nothing twice but takes another message, and the first
    call's refill, which this process never saw, is requeued once it has been unknown
    for ORPHAN_AFTER_S."""
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    consumer, message = held_one(broker, "orphan", 3)
    lane = _lane_after_settle(broker)
    read = lane.read_response

    def lost(*args: Any, **kwargs: Any) -> Any:
        read(*args, **kwargs)  # Redis ran it: acked 0 and took 1; the reply never comes
        del lane.read_response
        raise redis.TimeoutError("Timeout reading from socket")

    lane.read_response = lost
    try:
        consumer.ack(message)  # the retry through the client takes 2
        assert held_and_queued(redis_url, broker, "orphan") == (2, 0)
        assert consumer.reclaim_orphans(now=100.0) == 0
        assert consumer.reclaim_orphans(now=100.0 + ORPHAN_AFTER_S - 1) == 0
        assert consumer.reclaim_orphans(now=100.0 + ORPHAN_AFTER_S) == 1
        assert held_and_queued(redis_url, broker, "orphan") == (1, 1)
        kept = next(consumer)  # what this process knew of is still its own
        assert kept is not None and kept.args == (2,)
        assert consumer.reclaim_orphans(now=100.0 + 10 * ORPHAN_AFTER_S) == 0
        assert held_and_queued(redis_url, broker, "orphan") == (1, 1)
        assert [m.args for m in map(Message.decode, _bodies(redis_url, "orphan"))] == [(1,)]
    finally:
        broker.close()


def test_a_take_whose_reply_is_late_is_never_taken_for_an_orphan(redis_url: str) -> None:
    """A fetch Redis has run but whose reply is not yet read holds a message nobody here
    knows of; once the reply is read, no later look requeues it."""
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    consumer, _ = held_one(broker, "late", 2)
    consumer.prefetch = 2
    try:
        claimed = consumer._claim(1)
        assert claimed == 1
        on_its_way = consumer._fetch(claimed)  # ran in Redis; the consumer has not seen it
        assert consumer.reclaim_orphans(now=0.0) == 0
        consumer._fill(claimed, on_its_way)  # the reply is read
        assert consumer.reclaim_orphans(now=ORPHAN_AFTER_S + 1) == 0
        assert held_and_queued(redis_url, broker, "late") == (2, 0)
    finally:
        broker.close()


def _bodies(redis_url: str, queue: str) -> list[bytes]:
    """The bodies of the messages waiting on ``queue``, in order."""
    client = redis.Redis.from_url(redis_url)
    ids = client.lrange(layout.queue_key(queue), 0, -1)
    return [body for body in client.hmget(layout.bodies_key(queue), ids) if isinstance(body, bytes)]


def test_a_nack_of_a_message_this_worker_does_not_hold_stores_nothing_and_says_so(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Dramatiq's own ``test_redis_consumer_nack_does_not_raise_on_missing_id`` (2.2.1,
    issue 320), on this broker: a running worker's consumer nacks a message it never
    fetched (a bare, frozen ``Message``, a bogus redis id): nothing raises, nothing is
    stored, and the log says what happened (not that another worker recovered it)."""
    broker = SettlingRedisBroker(url=redis_url, middleware=[])

    @dramatiq.actor(broker=broker, actor_name="do_work", queue_name="bogus")
    def do_work() -> None:
        raise RuntimeError

    worker = dramatiq.Worker(broker, worker_timeout=100)
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while worker.consumers["bogus"].consumer is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the consumer thread makes its consumer as it starts
        consumer = worker.consumers["bogus"].consumer
        assert consumer is not None
        message: Message[Any] = Message(
            queue_name="bogus",
            actor_name="do_work",
            args=(),
            kwargs={},
            options={"redis_message_id": "XXXXXXXXX"},
        )
        with caplog.at_level("WARNING"):
            consumer.nack(message)  # type: ignore[arg-type]  # Dramatiq's test passes a Message
    finally:
        worker.stop()
        broker.close()
    (said,) = [r for r in caplog.records if "XXXXXXXXX" in str(r.__dict__.get("redis_id"))]
    assert said.getMessage() == (
        "settled a message this worker does not hold: it never fetched it here, or settled "
        "it already; nothing was stored"
    )
    client = redis.Redis.from_url(redis_url)
    assert client.zcard(layout.dead_letter_keys("bogus")[0]) == 0
    assert held_and_queued(redis_url, broker, "bogus") == (0, 0)


def test_a_delivery_is_read_without_the_proxys_getattr_and_keeps_its_marks(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each field a handler and the middleware read, and each mark a delivery may carry, is
    an attribute of the delivery: Dramatiq's proxy ``__getattr__`` (a Python call per read,
    two exceptions for a mark not set; about a tenth of a no-op job) is never reached. The
    fields are the message's, its options the same dict; a mark set is read back."""
    reached: list[str] = []
    real = MessageProxy.__getattr__

    def spy(self: MessageProxy, name: str) -> Any:
        reached.append(name)
        return real(self, name)

    monkeypatch.setattr(MessageProxy, "__getattr__", spy)
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    consumer, delivery = held_one(broker, "fields", 1)
    try:
        assert isinstance(delivery, consumer_module.Delivery)
        message = delivery._message
        for name in ("queue_name", "actor_name", "args", "kwargs", "message_id"):
            assert getattr(delivery, name) == getattr(message, name), name
        assert delivery.message_timestamp == message.message_timestamp
        assert delivery.options is message.options
        assert settlement_of(delivery) is None and lost_reason(delivery) is None
        assert not delivery.failed
        settle_with(delivery, ACK)
        assert settlement_of(delivery) is ACK
        consumer.ack(delivery)
        assert lost_reason(delivery) is None
        assert reached == [], f"read through the proxy's __getattr__: {reached}"
        assert held_and_queued(redis_url, broker, "fields") == (0, 0)
    finally:
        broker.close()
