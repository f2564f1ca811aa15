"""``broker.join()`` waits for delayed work, and delayed messages move in due order.

The first test is our adaptation of Dramatiq 2.2.1's ``test_redis_join_race_condition``
(its ``tests/test_redis.py``): an actor sends another with a one-second delay, and
``broker.join()`` must not return before that one has run. Dramatiq's counts differ by
one: its delay consumer held the delayed message in this worker's acks set (counted by
``do_qsize`` beside its body); ours never holds a delayed message, its body is counted
once, in the delay queue's hash, until it moves to its queue in the same step that makes
it ready (:data:`.layout.MOVE_DUE`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import dramatiq
import redis
from dramatiq import Message
from dramatiq.common import dq_name

from worker_runtime import layout
from worker_runtime.redisbroker import SettlingRedisBroker


def test_join_returns_only_once_the_delayed_work_it_waits_for_has_run(redis_url: str) -> None:
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    queue = "joined"
    called = threading.Event()
    sizes: list[int] = []

    @dramatiq.actor(broker=broker, queue_name=queue)
    def go_again() -> None:
        called.set()
        sizes.append(broker.do_qsize(queue))  # its body and its ack
        sizes.append(broker.do_qsize(dq_name(queue)))  # the same count

    @dramatiq.actor(broker=broker, queue_name=queue)
    def go() -> None:
        go_again.send_with_options(delay=1000)
        time.sleep(0.25)
        sizes.append(broker.do_qsize(queue))  # go's body and ack, go_again's delayed body
        sizes.append(broker.do_qsize(dq_name(queue)))

    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        go.send()
        broker.join(queue, timeout=20_000)
        assert called.is_set(), "join returned before the delayed message ran"
        worker.join()
    finally:
        worker.stop()
        broker.close()
    assert sizes == [3, 3, 2, 2]


def stored(client: redis.Redis, queue: str, job: str, eta_ms: int) -> str:
    """A delayed message as a bare Dramatiq producer stores it; returns its redis id."""
    redis_id = f"id-{job}"
    message: Message[Any] = Message(
        queue_name=dq_name(queue),
        actor_name="job",
        args=(job,),
        kwargs={},
        options={layout.REDIS_MESSAGE_ID: redis_id, "eta": eta_ms},
    )
    client.hset(layout.bodies_key(dq_name(queue)), redis_id, message.encode())
    client.rpush(layout.queue_key(dq_name(queue)), redis_id)
    return redis_id


def test_due_messages_move_earliest_first_and_once(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    script = client.register_script(layout.MOVE_DUE)
    queue = "moved"
    now = layout.redis_now_ms(client)
    later = [stored(client, queue, f"later{n}", now + 3_600_000) for n in range(5)]
    due = stored(client, queue, "due", now - 1)
    client.hset(layout.bodies_key(dq_name(queue)), "garbled", b"not json")
    client.rpush(layout.queue_key(dq_name(queue)), "garbled", "no-body")

    step = layout.move_due(script, queue)
    assert (step.moved, step.more) == (2, False)  # the due one, and the garbled one (due now)
    assert step.next_due_ms == now + 3_600_000
    assert client.lrange(layout.queue_key(queue), 0, -1) == [due.encode(), b"garbled"]
    raw = client.hget(layout.bodies_key(queue), due)
    assert isinstance(raw, bytes)
    body = Message.decode(raw)
    assert body.queue_name == queue and body.options[layout.REDIS_MESSAGE_ID] == due
    assert client.hget(layout.message_index_key(), body.message_id) == (
        layout.message_place(queue, due).encode()
    )
    assert client.hlen(layout.bodies_key(dq_name(queue))) == len(later)
    assert client.zcard(layout.due_key(queue)) == len(later)
    assert client.llen(layout.queue_key(dq_name(queue))) == 0
    again = layout.move_due(script, queue)
    assert again.moved == 0 and client.llen(layout.queue_key(queue)) == 2
    assert 3_590 < again.wait_s(10_000) <= 3_600 and again.wait_s(1.0) == 1.0
