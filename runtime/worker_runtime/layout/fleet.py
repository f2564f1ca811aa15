"""The fleet as Redis knows it: each worker's heartbeat (Redis's time, its process record,
the namespace's epoch), the workers silent too long, a worker forgotten once it holds
nothing, and every worker of some queues read at once (:func:`read_fleet`: ``status`` and
the console). A heartbeat frees its old entry before it writes the new one, so a full Redis
takes it (:data:`.clock.CLOCK`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .clock import CLOCK
from .keys import (
    DELAY_SUFFIX,
    acks_key,
    epoch_key,
    heartbeats_key,
    namespace_of,
    namespaces_of,
    process_key,
    with_delay_queues,
)
from .schema import message_fields, text

if TYPE_CHECKING:
    import redis


#: This worker is alive: its heartbeat at Redis's time, and its process record
#: (:func:`process_key`) when ARGV[2] is not empty, kept ARGV[3] ms; returns that time and
#: the namespace's epoch token (false: none), so one call also notices a reset.
#: KEYS: heartbeats, the epoch key, the process record.  ARGV: broker id, record or '',
#: record lifetime ms.  Returns [ms, epoch].
HEARTBEAT: Final = (
    CLOCK
    + """
local now = now_ms()
beat(KEYS[1], ARGV[1], now)
if ARGV[2] ~= '' then redis.call('set', KEYS[3], ARGV[2], 'PX', ARGV[3]) end
return {now, redis.call('get', KEYS[2])}
"""
)


def heartbeat(
    client: redis.Redis, broker_id: str, namespace: str, record: bytes = b"", ttl_ms: int = 0
) -> tuple[int, Any]:
    """:data:`HEARTBEAT` for ``broker_id`` in ``namespace``: (Redis's ms, epoch or None).
    ``record`` (JSON, :func:`process_key`) is stored too, for ``ttl_ms``, unless empty."""
    keys = (heartbeats_key(namespace), epoch_key(namespace), process_key(broker_id, namespace))
    now, epoch = client.eval(HEARTBEAT, len(keys), *keys, broker_id, record, ttl_ms)
    return int(now), epoch


#: Workers whose heartbeat is older than ARGV[1] ms by Redis's clock.
#: KEYS: heartbeats.  ARGV: timeout ms.  Returns their ids.
STALE_WORKERS: Final = (
    CLOCK
    + """
return redis.call('zrangebyscore', KEYS[1], 0, now_ms() - tonumber(ARGV[1]))
"""
)


def stale_workers(client: redis.Redis, namespace: str, timeout_ms: int) -> list[str]:
    """:data:`STALE_WORKERS`: ids of ``namespace``'s workers silent for ``timeout_ms``."""
    raw: list[Any] = client.eval(STALE_WORKERS, 1, heartbeats_key(namespace), timeout_ms)
    return [text(worker) for worker in raw]


#: Forget a worker that holds nothing (a process that drained and exits): its heartbeat and
#: its process record go, only while every acks set named is empty, so ``status`` drops it at
#: once; one that still holds a message keeps its heartbeat for recovery to find.
#: KEYS: heartbeats, its process record, then its acks sets.  ARGV: broker id.
#: Returns 1 when it was forgotten, else 0.
FORGET_IDLE: Final = """
for i = 3, #KEYS do
  if redis.call('scard', KEYS[i]) > 0 then return 0 end
end
redis.call('zrem', KEYS[1], ARGV[1])
redis.call('del', KEYS[2])
return 1
"""


def forget_idle(client: redis.Redis, broker_id: str, queues: Sequence[str]) -> bool:
    """:data:`FORGET_IDLE` for ``broker_id`` in each namespace of ``queues`` (its queues and
    their delay queues); True when it was forgotten in every one."""
    forgotten = True
    for namespace in namespaces_of(queues):
        own = [q for q in with_delay_queues(queues) if namespace_of(q) == namespace]
        keys = (
            heartbeats_key(namespace),
            process_key(broker_id, namespace),
            *(acks_key(broker_id, queue) for queue in own),
        )
        forgotten &= bool(client.eval(FORGET_IDLE, len(keys), *keys, broker_id))
    return forgotten


@dataclass(frozen=True)
class FleetMember:
    """One worker (broker id) of a namespace as Redis knows it: its last heartbeat (ms,
    Redis's clock), its process record (decoded JSON, None: none or expired), how many
    deliveries each of its acks sets holds (queue or delay queue -> count) and the redis
    ids it holds on the queues themselves (not their delay queues): a job of its record
    whose id is not among them has been settled since the record was written."""

    namespace: str
    broker_id: str
    beat_ms: int
    record: dict[str, Any] | None
    held: dict[str, int]
    holding: frozenset[str] = frozenset()


def read_fleet(client: redis.Redis, queues: Sequence[str]) -> tuple[int, list[FleetMember]]:
    """Every worker of the namespaces of ``queues``, in two round trips: (Redis's ms, the
    workers by heartbeat, oldest first). Work is one small read per worker and per worker
    and queue (its acks sets: the members of a queue's, bounded by the prefetch; the size of
    a delay queue's), whatever the queues hold. The record, the sizes and the members are
    read in one pipeline, after the settlement that removed an id from an acks set or not:
    a settled job is never among :attr:`FleetMember.holding`."""
    namespaces = namespaces_of(queues)
    pipe = client.pipeline(transaction=False)
    pipe.time()
    for namespace in namespaces:
        pipe.zrange(heartbeats_key(namespace), 0, -1, withscores=True)
    first = pipe.execute()
    seconds, micros = first[0]
    now = int(seconds) * 1000 + int(micros) // 1000
    workers = [
        (namespace, text(broker_id), int(score))
        for namespace, beats in zip(namespaces, first[1:], strict=True)
        for broker_id, score in beats
    ]
    served = {
        namespace: [
            queue for queue in with_delay_queues(queues) if namespace_of(queue) == namespace
        ]
        for namespace in namespaces
    }
    pipe = client.pipeline(transaction=False)
    for namespace, broker_id, _ in workers:
        pipe.get(process_key(broker_id, namespace))
        for queue in served[namespace]:
            if queue.endswith(DELAY_SUFFIX):
                pipe.scard(acks_key(broker_id, queue))
            else:
                pipe.smembers(acks_key(broker_id, queue))
    replies = iter(pipe.execute() if workers else [])
    members = []
    for namespace, broker_id, beat_ms in workers:
        record = message_fields(next(replies))
        held: dict[str, int] = {}
        holding: set[str] = set()
        for queue in served[namespace]:
            reply = next(replies)
            if isinstance(reply, set):
                holding.update(text(member) for member in reply)
                held[queue] = len(reply)
            else:
                held[queue] = int(reply)
        members.append(FleetMember(namespace, broker_id, beat_ms, record, held, frozenset(holding)))
    return now, members
