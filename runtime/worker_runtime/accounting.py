"""Crash-safe delivery accounting: lost messages come back counted, poison ones are dead-lettered.

Dramatiq's Redis broker keeps each fetched message in the fetching worker's acks
set (:func:`.layout.acks_key`) until it is acked. When a worker
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

A held message whose job ran past its time limit and would not stop (:mod:`.overrun`: its
thread abandoned, or its process killed by the supervisor) is charged as a failed attempt
(``options["retries"]``), not as a crash: :func:`charge_time_limit`, dead-lettered with
:data:`.settlement.TIME_LIMIT_REASON` once its attempts are used up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import redis
from dramatiq.message import Message

from . import layout, overrun
from .messages import dead_letter_body, indexed_id, inspect
from .settlement import TIME_LIMIT_REASON
from .telemetry import record_lost_delivery

logger = logging.getLogger(__name__)


def deliveries(message: Message[Any]) -> int:
    """Deliveries so far that ended in a failure or a crash."""
    return layout.deliveries(message.options)


def dead_letter(
    client: redis.Redis,
    broker_id: str,
    queue: str,
    message: Message[Any],
    reason: str,
    silent_ms: int = 0,
) -> bool:
    """Move ``message`` (held in ``broker_id``'s acks set of ``queue``) to the dead letters.

    The stored body gains ``options["dead_letter_reason"]``. Returns False when the
    message was no longer held (someone else moved it), or its holder beat within
    ``silent_ms`` (:func:`.layout.requeue_held`).
    """
    message = message.copy(options={layout.DEAD_LETTER_REASON: reason})
    redis_id = message.options[layout.REDIS_MESSAGE_ID]
    lock = message.options.get(layout.UNIQUE_LOCK, "")
    moved = layout.dead_letter_held(
        client, broker_id, queue, redis_id, message.encode(), message.message_id, silent_ms, lock
    )
    if moved:
        _said("dead-lettered message", message, queue, "dead_letter", reason=reason)
    return moved


def _said(what: str, message: Message[Any], queue: str, outcome: str, **more: Any) -> None:
    """Log (warning) what recovery did to ``message`` of ``queue``: its ids and ``outcome``."""
    logger.warning(
        what,
        extra={
            "job_id": message.message_id,
            "queue": layout.canonical(queue),
            "actor": message.actor_name,
            "outcome": outcome,
            **more,
        },
    )


def requeue(
    client: redis.Redis,
    broker_id: str,
    queue: str,
    redis_ids: Iterable[str],
) -> int:
    """Put messages held by ``broker_id`` back at the tail of ``queue``, uncounted."""
    return sum(layout.requeue_held(client, broker_id, queue, redis_id) for redis_id in redis_ids)


def recover_worker(
    client: redis.Redis,
    broker_id: str,
    queues: Iterable[str],
    max_attempts: int,
    running: set[str] | None = None,
    silent_ms: int = 0,
    timed_out: set[str] | None = None,
) -> tuple[int, int]:
    """Recover every message a dead worker held on ``queues`` (and their delay queues).

    Parameters:
      broker_id: the dead worker's broker id.
      max_attempts: ``WORKER_MAX_ATTEMPTS``; a message that reaches it is dead-lettered.
      running: redis message ids that were running when it died (counted as a
        crash); None when unknown, and then every held message counts as one,
        except those of delay queues (they wait for their time and never run there).
      silent_ms: > 0 when it was judged dead for a heartbeat this old: each message moves
        only while it still is (a worker that was frozen and woke keeps what it holds).
      timed_out: redis message ids whose job was past its time limit when the supervisor
        killed the process for it (charged as a time limit, :func:`charge_time_limit`).

    Returns:
      (requeued, dead_lettered)
    """
    requeued = dead = 0
    for queue in layout.with_delay_queues(queues):
        for raw_id in client.smembers(layout.acks_key(broker_id, queue)):
            redis_id = layout.text(raw_id)
            if timed_out and redis_id in timed_out:
                moved, died = charge_time_limit(client, broker_id, queue, redis_id, max_attempts)
                requeued, dead = requeued + moved, dead + died
                continue
            delayed = queue == layout.delay_queue(queue)
            crashed = not delayed if running is None else redis_id in running
            body = layout.raw_bytes(client.hget(layout.bodies_key(queue), redis_id))
            if body is None or not crashed:
                requeued += layout.requeue_held(
                    client, broker_id, queue, redis_id, silent_ms=silent_ms
                )
                continue
            try:
                moved, died = _recover_crashed(
                    client, broker_id, queue, redis_id, body, max_attempts, silent_ms
                )
            except redis.RedisError:
                raise
            except Exception:  # one bad message never stops the recovery of the others
                logger.exception(
                    "could not recover a message", extra={"queue": queue, "redis_id": redis_id}
                )
                continue
            requeued, dead = requeued + moved, dead + died
    if requeued or dead:
        logger.warning(
            "recovered the messages of a dead worker",
            extra={"broker_id": broker_id, "requeued": requeued, "dead_lettered": dead},
        )
    return requeued, dead


def _recover_crashed(
    client: redis.Redis,
    broker_id: str,
    queue: str,
    redis_id: str,
    body: bytes,
    max_attempts: int,
    silent_ms: int,
) -> tuple[int, int]:
    """Count a crash against one held message: requeue it, or dead-letter it when its
    attempts are used up or it is not a Dramatiq message. Returns (requeued, dead)."""
    problem, message, fields = inspect(body, queue, redis_id, None)
    if message is None or (problem is not None and layout.REDIS_MESSAGE_ID not in problem):
        reason = f"malformed message: {problem}"
        stored = dead_letter_body(body, queue, reason, message, fields)
        message_id = indexed_id(fields)
        return 0, int(
            _dead_letter_raw(
                client, broker_id, queue, redis_id, stored, reason, message_id, silent_ms
            )
        )
    message = message.copy(
        options={
            layout.CRASHES: layout.crashes(message.options) + 1,
            layout.REDIS_MESSAGE_ID: redis_id,
        }
    )
    if deliveries(message) >= max_attempts:
        reason = (
            f"its worker process died during {layout.crashes(message.options)} of "
            f"{deliveries(message)} deliveries (WORKER_MAX_ATTEMPTS={max_attempts})"
        )
        dead = dead_letter(client, broker_id, queue, message, reason, silent_ms)
        if dead:
            record_lost_delivery(message, queue, reason)
        return 0, int(dead)
    requeued = layout.requeue_held(client, broker_id, queue, redis_id, message.encode(), silent_ms)
    if requeued:
        record_lost_delivery(message, queue, None)
    return int(requeued), 0


def charge_time_limit(
    client: redis.Redis, broker_id: str, queue: str, redis_id: str, max_attempts: int
) -> tuple[int, int]:
    """Charge the held ``redis_id``, whose job ran past its time limit and would not stop, as
    a failed attempt: requeued with ``retries`` + 1, or dead-lettered with
    :data:`.settlement.TIME_LIMIT_REASON` once its attempts are used up; counted in
    ``jobs_time_limit_exceeded_total``. Returns (requeued, dead_lettered)."""
    body = layout.raw_bytes(client.hget(layout.bodies_key(queue), redis_id))
    _, message, _ = inspect(body or b"", queue, redis_id, None)
    if message is None:  # no body, or not a message: nothing to charge
        return int(layout.requeue_held(client, broker_id, queue, redis_id)), 0
    retries = int(message.options.get(layout.RETRIES) or 0) + 1
    message = message.copy(options={layout.RETRIES: retries, layout.REDIS_MESSAGE_ID: redis_id})
    overrun.count_time_limit(layout.canonical(queue), message.actor_name)
    if deliveries(message) >= max_attempts:
        return 0, int(dead_letter(client, broker_id, queue, message, TIME_LIMIT_REASON))
    requeued = layout.requeue_held(client, broker_id, queue, redis_id, message.encode())
    if requeued:
        what = "requeued a job that would not stop after its time limit"
        _said(what, message, queue, "retry", retries=retries)
    return int(requeued), 0


def _dead_letter_raw(
    client: redis.Redis,
    broker_id: str,
    queue: str,
    redis_id: str,
    body: bytes,
    reason: str,
    message_id: str,
    silent_ms: int,
) -> bool:
    """Move the held ``redis_id`` to the dead letters with ``body`` (any bytes), and its
    entry of the message index (``message_id``, :func:`.messages.indexed_id`)."""
    moved = layout.dead_letter_held(client, broker_id, queue, redis_id, body, message_id, silent_ms)
    if moved:
        logger.warning(
            "dead-lettered message",
            extra={
                "redis_id": redis_id,
                "queue": layout.canonical(queue),
                "outcome": "dead_letter",
                "reason": reason,
            },
        )
    return moved


def recover_dead_workers(
    client: redis.Redis, queues: list[str], heartbeat_timeout_ms: int, max_attempts: int
) -> tuple[int, int]:
    """Recover the messages of every worker whose heartbeat is older than the timeout, by
    Redis's clock (:data:`.layout.STALE_WORKERS`): a host whose clock is off judges no
    live worker dead. Each message moves only while its worker is still silent: one that
    was frozen and beats again (it checks its holds, :data:`.layout.STILL_HELD`) keeps
    what this pass has not moved yet, so the two never both run a message.

    Looks only at the heartbeats of the namespaces of ``queues``
    (:func:`.layout.namespace_of`): the sandbox pool's workers and the others never see,
    nor touch, each other's heartbeats.
    """
    requeued = dead = 0
    for namespace in layout.namespaces_of(queues):
        heartbeats = layout.heartbeats_key(namespace)
        own = [queue for queue in queues if layout.namespace_of(queue) == namespace]
        for broker_id in layout.stale_workers(client, namespace, heartbeat_timeout_ms):
            moved, died = recover_worker(
                client, broker_id, own, max_attempts, silent_ms=heartbeat_timeout_ms
            )
            requeued, dead = requeued + moved, dead + died
            pattern = layout.acks_pattern(broker_id, namespace)
            if not any(client.scan_iter(match=pattern, count=1000)):
                client.zrem(heartbeats, broker_id)
                client.delete(layout.process_key(broker_id, namespace))
    return requeued, dead


def heartbeat(
    client: redis.Redis,
    broker_id: str,
    queues: Iterable[str],
    record: bytes = b"",
    ttl_ms: int = 0,
) -> dict[str, tuple[int, Any]]:
    """Tell the other workers of ``queues``' namespaces that ``broker_id`` is alive (the
    fetches do the same), at Redis's time; return, per namespace, that time (ms) and its
    epoch token as read in the same call (None: none; see :mod:`.brokerstate`).
    ``record``: what the process says of itself (:func:`.layout.process_key`), kept
    ``ttl_ms``; empty: none written."""
    return {
        namespace: layout.heartbeat(client, broker_id, namespace, record, ttl_ms)
        for namespace in layout.namespaces_of(queues)
    }


def forget_worker(client: redis.Redis, broker_id: str, queues: Iterable[str]) -> None:
    """Remove the heartbeat of ``broker_id`` (a dead worker of ``queues``, recovered)."""
    for namespace in layout.namespaces_of(queues):
        client.zrem(layout.heartbeats_key(namespace), broker_id)
        client.delete(layout.process_key(broker_id, namespace))


def expire_dead_letters(client: redis.Redis, queues: Iterable[str], ttl_ms: int) -> None:
    """Drop dead letters older than ``ttl_ms`` by Redis's clock (Dramatiq's maintenance, which
    we turn off); one round trip looks at every queue."""
    cutoff = layout.redis_now_ms(client) - ttl_ms
    keys = [layout.dead_letter_keys(queue) for queue in queues]
    pipe = client.pipeline(transaction=False)
    for zset, _ in keys:
        pipe.zrangebyscore(zset, 0, cutoff)
    for (zset, bodies), old in zip(keys, pipe.execute(), strict=True):
        if old:
            client.zrem(zset, *old)
            client.hdel(bodies, *old)
