"""Recovery on a StubBroker carrying a real Redis client (the passes are Lua): a pass
heartbeats, recovers a dead worker's messages counting a crash, expires old dead letters,
and requeues what this worker holds in Redis but lost in memory; the thread of the passes
outlives errors and stops with the worker."""

from __future__ import annotations

import threading
import types

import pytest
import redis
from dramatiq import Message, Worker

from worker_runtime import layout
from worker_runtime.middleware import Recovery
from worker_runtime.middleware import recovery as recovery_module
from worker_runtime.redisbroker import SettlingRedisBroker
from worker_runtime.timing import ORPHAN_AFTER_S

from stub_brokers import RedisStubBroker

QUEUE = "work"
MAX_ATTEMPTS = 3
TIMEOUT_MS = 30_000
TTL_MS = 86_400_000


def hold(client: redis.Redis, worker: str, redis_id: str, **options: int) -> None:
    """Store a message on QUEUE as fetched, not acked, by ``worker``."""
    message: Message[None] = Message(
        queue_name=QUEUE,
        actor_name="job",
        args=(),
        kwargs={},
        options={layout.REDIS_MESSAGE_ID: redis_id, **options},
    )
    client.hset(layout.bodies_key(QUEUE), redis_id, message.encode())
    client.sadd(layout.acks_key(worker, QUEUE), redis_id)


def stored_options(client: redis.Redis, redis_id: str) -> dict[str, object]:
    body = client.hget(layout.bodies_key(QUEUE), redis_id)
    assert body is not None
    assert isinstance(body, bytes)
    return dict(Message.decode(body).options)


def test_a_pass_heartbeats_and_recovers_the_messages_of_dead_workers(
    client: redis.Redis,
) -> None:
    now = layout.now_ms()
    client.zadd(layout.HEARTBEATS, {"w-dead": now - 2 * TIMEOUT_MS, "w-alive": now})
    hold(client, "w-dead", "lost")
    hold(client, "w-dead", "poison", **{layout.CRASHES: MAX_ATTEMPTS - 1})
    hold(client, "w-alive", "busy")
    dead, dead_bodies = layout.dead_letter_keys(QUEUE)
    client.zadd(dead, {"old": now - TTL_MS - 1000, "recent": now})
    client.hset(dead_bodies, mapping={"old": b"{}", "recent": b"{}"})
    recovery = Recovery([QUEUE], TIMEOUT_MS, MAX_ATTEMPTS, dead_message_ttl_ms=TTL_MS)

    recovery.run_once(RedisStubBroker([recovery], client, broker_id="w-me"))

    assert client.zscore(layout.HEARTBEATS, "w-me") is not None, "this worker heartbeats"
    assert [layout.text(i) for i in client.lrange(layout.queue_key(QUEUE), 0, -1)] == ["lost"]
    assert stored_options(client, "lost")[layout.CRASHES] == 1, "a crash is counted"
    assert client.zscore(dead, "poison") is not None, "its crashes used up the attempts"
    poison = client.hget(dead_bodies, "poison")
    assert isinstance(poison, bytes)
    reason = Message.decode(poison).options
    assert "WORKER_MAX_ATTEMPTS=3" in str(reason[layout.DEAD_LETTER_REASON])
    assert client.smembers(layout.acks_key("w-dead", QUEUE)) == set()
    assert client.zscore(layout.HEARTBEATS, "w-dead") is None, "a recovered worker is forgotten"
    assert client.smembers(layout.acks_key("w-alive", QUEUE)) == {b"busy"}, "alive: untouched"
    assert {layout.text(i) for i in client.zrange(dead, 0, -1)} == {"poison", "recent"}
    assert client.hget(dead_bodies, "old") is None, "dead letters past the TTL expire"


def test_the_passes_run_until_the_worker_shuts_down_and_outlive_errors(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    recovery = Recovery([QUEUE], TIMEOUT_MS, MAX_ATTEMPTS, interval_s=0.001)
    broker = RedisStubBroker([recovery], client)
    failures = [redis.ConnectionError("Redis is down"), RuntimeError("a bug")]
    third_pass = threading.Event()

    def run_once(broker: object) -> None:
        if failures:
            raise failures.pop(0)
        third_pass.set()

    monkeypatch.setattr(recovery, "run_once", run_once)
    worker = Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        assert third_pass.wait(5), "the thread went on after a Redis error and a bug"
    finally:
        worker.stop()
    assert recovery.thread is not None
    recovery.thread.join(5)
    assert not recovery.thread.is_alive(), "the passes stop with the worker"


def test_the_passes_requeue_what_this_worker_holds_in_redis_but_lost(
    redis_url: str, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    broker.consume(QUEUE, prefetch=1, timeout=50)
    hold(client, broker.broker_id, "lost")  # taken by a call whose reply never came
    clock = [1000.0]
    monkeypatch.setattr(recovery_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    recovery = Recovery([QUEUE], TIMEOUT_MS, MAX_ATTEMPTS)
    try:
        recovery.run_once(broker)
        assert client.llen(layout.queue_key(QUEUE)) == 0, "not before ORPHAN_AFTER_S"
        clock[0] += ORPHAN_AFTER_S
        recovery.run_once(broker)
        assert [layout.text(i) for i in client.lrange(layout.queue_key(QUEUE), 0, -1)] == ["lost"]
        assert client.smembers(layout.acks_key(broker.broker_id, QUEUE)) == set()
    finally:
        broker.close()
