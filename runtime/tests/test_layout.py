"""The broker layout against Dramatiq's own names and a real Redis."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import dq_name, q_name, xq_name

from worker_runtime import layout


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.mark.parametrize("queue", ["q", "q.DQ"])
def test_names_agree_with_dramatiq(queue: str) -> None:
    default = inspect.signature(RedisBroker).parameters["namespace"].default
    assert default == layout.NAMESPACE
    assert layout.canonical(queue) == q_name(queue)
    assert layout.delay_queue(queue) == dq_name(queue)
    assert layout.dead_letter_keys(queue)[0] == f"{default}:{xq_name(queue)}"
    assert layout.with_delay_queues([q_name(queue)]) == ["q", "q.DQ"]


@pytest.mark.parametrize("queue", [layout.SANDBOX_QUEUE, layout.SANDBOX_QUEUE + ".DQ"])
def test_every_key_of_the_sandbox_queue_is_in_its_own_namespace(queue: str) -> None:
    """The sandbox pool's Redis user is limited to ``dramatiq-sandbox:*``: every key its
    workers touch must be there, and no key of another queue."""
    prefix = layout.SANDBOX_NAMESPACE + ":"
    keys = [
        *layout.fetch_keys("w", queue),
        *layout.settle_keys("w", queue, layout.delay_queue(queue)),
        *layout.backlog_keys(queue),
        layout.acks_pattern("w", layout.namespace_of(queue)),
    ]
    assert all(key.startswith(prefix) for key in keys), keys
    other = [*layout.fetch_keys("w", "payments"), *layout.settle_keys("w", "payments", "payments")]
    assert not any(key.startswith(prefix) for key in other), other
    assert all(key.startswith(layout.NAMESPACE + ":") for key in other)
    assert layout.heartbeats_key() == layout.HEARTBEATS


def test_queue_keys_name_every_key_of_a_queue() -> None:
    keys = layout.QueueKeys.of("q.DQ")
    assert keys == layout.QueueKeys(
        "dramatiq:q", "dramatiq:q.msgs", "dramatiq:q.DQ", "dramatiq:q.DQ.msgs",
        "dramatiq:q.XQ", "dramatiq:q.XQ.msgs", "dramatiq:q.DQ.due",
    )  # fmt: skip


def test_requeue_and_dead_letter_move_a_held_message_once(client: redis.Redis) -> None:
    client.sadd(layout.acks_key("w", "q"), "a", "b")
    client.hset(layout.bodies_key("q"), mapping={"a": b"old", "b": b"body"})
    assert layout.requeue_held(client, "w", "q", "a", b"new")
    assert not layout.requeue_held(client, "w", "q", "a", b"newer")
    assert client.lrange(layout.queue_key("q"), 0, -1) == [b"a"]
    assert client.hget(layout.bodies_key("q"), "a") == b"new"

    # The index names b's copy under its message id "m", and a later copy of "n" elsewhere.
    index = layout.message_index_key()
    client.hset(index, mapping={"m": layout.message_place("q", "b"), "n": "elsewhere"})
    assert layout.dead_letter_held(client, "w", "q", "b", b"dead body", "m")
    assert not layout.dead_letter_held(client, "w", "q", "b", b"dead body", "m")
    zset, bodies = layout.dead_letter_keys("q")
    assert client.zrange(zset, 0, -1) == [b"b"]
    assert client.hget(bodies, "b") == b"dead body"
    assert not client.hexists(layout.bodies_key("q"), "b")
    assert not client.exists(layout.acks_key("w", "q"))
    # Its entry went with it; an entry naming another copy stays (a wrong guess is harmless).
    client.sadd(layout.acks_key("w", "q"), "c")
    assert layout.dead_letter_held(client, "w", "q", "c", b"dead body", "n")
    assert client.hgetall(index) == {b"n": b"elsewhere"}


def test_a_silent_workers_message_moves_only_while_it_is_still_silent(
    client: redis.Redis,
) -> None:
    """Recovery judged ``w`` dead; ``w`` woke, beat and checked its hold (STILL_HELD) before
    the recovery reached its message: the message stays with ``w``."""
    client.sadd(layout.acks_key("w", "q"), "a", "b")
    client.hset(layout.bodies_key("q"), mapping={"a": b"body", "b": b"body"})
    now = layout.redis_now_ms(client)
    client.zadd(layout.heartbeats_key(), {"w": now - 60_000})
    assert layout.still_held(client, "w", "q", "a")  # it beats, then finds its hold
    assert not layout.requeue_held(client, "w", "q", "a", silent_ms=30_000)
    assert not layout.dead_letter_held(client, "w", "q", "b", b"dead", "", silent_ms=30_000)
    assert client.smembers(layout.acks_key("w", "q")) == {b"a", b"b"}
    client.zadd(layout.heartbeats_key(), {"w": now - 60_000})  # silent again
    assert layout.requeue_held(client, "w", "q", "a", silent_ms=30_000)
    assert not layout.still_held(client, "w", "q", "a")


def test_replay_and_purge_take_a_dead_letter_once(client: redis.Redis) -> None:
    zset, bodies = layout.dead_letter_keys("q")
    client.zadd(zset, {"x": 1, "y": 2})
    client.hset(bodies, mapping={"x": b"x", "y": b"y"})
    assert layout.replay_dead_letters(client, "q", [("x", "x2", b"fresh", "mx")]) == 1
    assert layout.replay_dead_letters(client, "q", [("x", "x3", b"fresh", "mx")]) == 0
    assert client.lrange(layout.queue_key("q"), 0, -1) == [b"x2"]
    assert client.hget(layout.bodies_key("q"), "x2") == b"fresh"
    # The replayed copy is the message's latest: found by its id (cancel).
    index = client.hget(layout.message_index_key(), "mx")
    assert index == layout.message_place("q", "x2").encode()
    assert layout.purge_dead_letters(client, "q", ["y", "y"]) == 1
    assert layout.purge_dead_letters(client, "q", ["y"]) == 0
    assert client.zcard(zset) == 0 and client.hlen(bodies) == 0


def test_backlog_records_have_the_stated_width(client: redis.Redis) -> None:
    assert len(layout.backlog_keys("q")) == layout.BACKLOG_KEYS
    client.rpush(layout.queue_key("b"), "gone", "m1")
    client.hset(layout.bodies_key("b"), "m1", b"{}")
    client.rpush(layout.queue_key("c.DQ"), "d1")
    client.hset(layout.bodies_key("c.DQ"), "d1", b"[]")
    client.zadd(layout.dead_letter_keys("c")[0], {"z": 1})
    records = layout.read_backlog_records(client, ["a", "b", "c"], head_probe=3)
    assert [set(record) for record in records] == [set(layout.BACKLOG_FIELDS)] * 3
    assert records[0] == dict.fromkeys(layout.BACKLOG_FIELDS, 0) | {
        "delayed_head": None,
        "next_due": None,
    } | dict.fromkeys(layout.LANE_HEADS)
    assert records[1]["depth"] == 2 and records[1]["head"] == b"{}"
    assert records[2]["delayed"] == 1 and records[2]["delayed_head"] == b"[]"
    assert records[2]["dead_letters"] == 1
    assert layout.read_backlog_records(client, [], head_probe=3) == []


@pytest.mark.parametrize(
    ("body", "fields"),
    [(None, None), (b"", None), (b"not json", None), (b"[1]", None), (b'{"a": 1}', {"a": 1})],
)
def test_message_fields(body: bytes | None, fields: dict[str, int] | None) -> None:
    assert layout.message_fields(body) == fields
