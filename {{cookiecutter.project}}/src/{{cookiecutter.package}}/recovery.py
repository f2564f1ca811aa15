"""Crash-safe delivery accounting: lost messages come back counted, poison ones are dead-lettered.

Dramatiq's Redis broker keeps each fetched message in the fetching worker's acks
set (``dramatiq:__acks__.<broker id>.<queue>``) until it is acked. When a worker
process dies (segfault, ``os._exit``, OOM kill, SIGKILL) its messages sit there;
Dramatiq itself recovers them only during "maintenance", on 0.1% of commands, and
does not count the lost delivery. Here recovery is deterministic and counted:

* the supervisor recovers a dead child's messages at once, knowing from the
  child's progress board which of them were running (counted as a crash) and
  which were only prefetched (requeued, not counted);
* every worker process also runs :func:`recover_dead_workers` periodically, which
  recovers the messages of workers whose heartbeat is older than
  ``WORKER_HEARTBEAT_TIMEOUT_MS`` (a whole pod gone), counting each as a crash.

A recovered message carries ``options["crashes"]``; once ``retries + crashes``
reaches ``WORKER_MAX_ATTEMPTS`` it is dead-lettered with the reason instead of
being delivered again. Nothing here runs per message: the hot path is untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, cast

import redis
from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.brokers.redis import RedisBroker
from dramatiq.message import Message

NAMESPACE = "dramatiq"
HEARTBEATS = f"{NAMESPACE}:__heartbeats__"
logger = logging.getLogger(__name__)

# Requeue: only the caller that removes the id from the acks set moves the message.
_REQUEUE = """
if redis.call('srem', KEYS[1], ARGV[1]) == 1 then
  if redis.call('hexists', KEYS[2], ARGV[1]) == 1 then
    if ARGV[2] ~= '' then redis.call('hset', KEYS[2], ARGV[1], ARGV[2]) end
    redis.call('rpush', KEYS[3], ARGV[1])
  end
  return 1
end
return 0
"""
# Dead-letter: same guard, then the dead-letter zset and bodies, as Dramatiq's nack does.
_DEAD_LETTER = """
if redis.call('srem', KEYS[1], ARGV[1]) == 1 then
  redis.call('zadd', KEYS[3], ARGV[3], ARGV[1])
  redis.call('hset', KEYS[4], ARGV[1], ARGV[2])
  redis.call('hdel', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


def canonical(queue: str) -> str:
    """``q`` for the delay queue ``q.DQ``."""
    return queue.removesuffix(".DQ")


def acks_key(broker_id: str, queue: str) -> str:
    return f"{NAMESPACE}:__acks__.{broker_id}.{queue}"


def deliveries(message: Message[Any]) -> int:
    """Deliveries so far that ended in a failure or a crash."""
    return int(message.options.get("retries", 0)) + int(message.options.get("crashes", 0))


def dead_letter(
    client: redis.Redis, broker_id: str, queue: str, message: Message[Any], reason: str
) -> bool:
    """Move ``message`` (held in ``broker_id``'s acks set of ``queue``) to the dead letters.

    The stored body gains ``options["dead_letter_reason"]``. Returns False when the
    message was no longer held (someone else moved it).
    """
    message = message.copy(options={"dead_letter_reason": reason})
    base = f"{NAMESPACE}:{canonical(queue)}.XQ"
    moved = client.eval(
        _DEAD_LETTER,
        4,
        acks_key(broker_id, queue),
        f"{NAMESPACE}:{queue}.msgs",
        base,
        f"{base}.msgs",
        message.options["redis_message_id"],
        message.encode(),
        int(time.time() * 1000),
    )
    if moved:
        logger.warning(
            "dead-lettered message",
            extra={
                "job_id": message.message_id,
                "queue": canonical(queue),
                "actor": message.actor_name,
                "outcome": "dead_letter",
                "reason": reason,
            },
        )
    return bool(moved)


def dead_letter_delivery(broker: Broker, message: MessageProxy, reason: str) -> bool:
    """Dead-letter the message this worker is processing (it is held in this worker's acks)."""
    redis_broker = cast(RedisBroker, broker)
    return dead_letter(
        redis_broker.client, redis_broker.broker_id, message.queue_name, message._message, reason
    )


def requeue(
    client: redis.Redis,
    broker_id: str,
    queue: str,
    redis_ids: Iterable[str],
) -> int:
    """Put messages held by ``broker_id`` back at the tail of ``queue``, uncounted."""
    return sum(_requeue_one(client, broker_id, queue, redis_id) for redis_id in redis_ids)


def _requeue_one(
    client: redis.Redis, broker_id: str, queue: str, redis_id: str, body: bytes = b""
) -> int:
    """Requeue one held message, storing ``body`` first when given; 1 if it was moved."""
    keys = (acks_key(broker_id, queue), f"{NAMESPACE}:{queue}.msgs", f"{NAMESPACE}:{queue}")
    return int(client.eval(_REQUEUE, 3, *keys, redis_id, body))


def recover_worker(
    client: redis.Redis,
    broker_id: str,
    queues: Iterable[str],
    max_attempts: int,
    running: set[str] | None = None,
) -> tuple[int, int]:
    """Recover every message a dead worker held on ``queues`` (and their delay queues).

    Parameters:
      broker_id: the dead worker's broker id.
      max_attempts: ``WORKER_MAX_ATTEMPTS``; a message that reaches it is dead-lettered.
      running: redis message ids that were running when it died (counted as a
        crash); None when unknown, and then every held message counts as one,
        except those of delay queues (they wait for their time and never run there).

    Returns:
      (requeued, dead_lettered)
    """
    requeued = dead = 0
    for queue in [q for name in queues for q in (name, f"{name}.DQ")]:
        for raw_id in client.smembers(acks_key(broker_id, queue)):
            redis_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            crashed = not queue.endswith(".DQ") if running is None else redis_id in running
            body = client.hget(f"{NAMESPACE}:{queue}.msgs", redis_id)
            if body is None or not crashed:
                requeued += _requeue_one(client, broker_id, queue, redis_id)
                continue
            message = Message.decode(body if isinstance(body, bytes) else body.encode())
            message = message.copy(options={"crashes": int(message.options.get("crashes", 0)) + 1})
            if deliveries(message) >= max_attempts:
                reason = (
                    f"its worker process died during {message.options['crashes']} of "
                    f"{deliveries(message)} deliveries (WORKER_MAX_ATTEMPTS={max_attempts})"
                )
                dead += int(dead_letter(client, broker_id, queue, message, reason))
            else:
                requeued += _requeue_one(client, broker_id, queue, redis_id, message.encode())
    if requeued or dead:
        logger.warning(
            "recovered the messages of a dead worker",
            extra={"broker_id": broker_id, "requeued": requeued, "dead_lettered": dead},
        )
    return requeued, dead


def recover_dead_workers(
    client: redis.Redis, queues: list[str], heartbeat_timeout_ms: int, max_attempts: int
) -> tuple[int, int]:
    """Recover the messages of every worker whose heartbeat is older than the timeout."""
    cutoff = int(time.time() * 1000) - heartbeat_timeout_ms
    requeued = dead = 0
    for raw in client.zrangebyscore(HEARTBEATS, 0, cutoff):
        broker_id = raw.decode() if isinstance(raw, bytes) else str(raw)
        moved, died = recover_worker(client, broker_id, queues, max_attempts)
        requeued, dead = requeued + moved, dead + died
        if not any(client.scan_iter(match=acks_key(broker_id, "*"), count=1000)):
            client.zrem(HEARTBEATS, broker_id)
    return requeued, dead


def heartbeat(client: redis.Redis, broker_id: str) -> None:
    """Tell other workers that ``broker_id`` is alive (Dramatiq's fetches do the same)."""
    client.zadd(HEARTBEATS, {broker_id: int(time.time() * 1000)})


def expire_dead_letters(client: redis.Redis, queues: Iterable[str], ttl_ms: int) -> None:
    """Drop dead letters older than ``ttl_ms`` (Dramatiq's maintenance, which we turn off)."""
    cutoff = int(time.time() * 1000) - ttl_ms
    for queue in queues:
        base = f"{NAMESPACE}:{queue}.XQ"
        old = client.zrangebyscore(base, 0, cutoff)
        if old:
            client.zrem(base, *old)
            client.hdel(f"{base}.msgs", *old)
