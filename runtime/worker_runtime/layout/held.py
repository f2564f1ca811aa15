"""A delivery a worker holds (its redis id in the worker's acks set): whether it still
holds it, its requeue and its dead letter (by its holder, or by recovery once the holder has
been silent: :data:`SILENT`), and the ids a worker holds, read in one call (:data:`MEMBERS`).
Each a Lua constant stating its KEYS and ARGV, called through the typed function beside it.
The removal from the acks set is the guard: only the caller that removes it moves the
message. Times are Redis's (:data:`.clock.CLOCK`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from .clock import CLOCK
from .flow import RELEASE, gated_name
from .index import INDEX
from .keys import (
    acks_key,
    bodies_key,
    dead_letter_keys,
    gates_key,
    heartbeats_key,
    message_index_key,
    namespace_of,
    waiting_keys,
)
from .queuelanes import LANES
from .unique import UNLOCK

if TYPE_CHECKING:
    import redis


#: Lua (needs :data:`CLOCK`): whether worker ``owner`` has been silent for ``ms`` (its
#: heartbeat older, or gone); always true for ``ms`` 0. Recovery moves a silent worker's
#: message only while it is still silent: one that woke and beat since (and checked its
#: hold: :data:`STILL_HELD`) keeps it, so the two never both run it.
SILENT: Final = """
local function silent(heartbeats, owner, ms)
  if ms <= 0 then return true end
  local beat = redis.call('zscore', heartbeats, owner)
  return (not beat) or tonumber(beat) <= now_ms() - ms
end
"""


#: Requeue a held message, at the tail of its own lane (:mod:`.queuelanes`, read from its
#: body). Only the caller that removes the id from the acks set moves it, and only while its
#: holder has been silent for ARGV[4] ms (0: whatever it did, see :data:`SILENT`); it frees
#: the downstream slots the delivery held (:data:`.flow.RELEASE`).
#: KEYS: acks set, bodies of the queue, heartbeats, the gates hash, then the queue's lanes
#: block (:func:`.keys.waiting_keys`).  ARGV: redis id, new body or '', the holder's broker
#: id, silent ms, the queue's name ('' for a delay queue).
REQUEUE_SCRIPT: Final = (
    CLOCK
    + SILENT
    + RELEASE
    + LANES
    + """
if not silent(KEYS[3], ARGV[3], tonumber(ARGV[4])) then return 0 end
if redis.call('srem', KEYS[1], ARGV[1]) == 1 then
  release(KEYS[4], ARGV[5], ARGV[1])
  unfair(5, #KEYS - 4, ARGV[1])
  local body = redis.call('hget', KEYS[2], ARGV[1])
  if body then
    if ARGV[2] ~= '' then
      body = ARGV[2]
      redis.call('hset', KEYS[2], ARGV[1], body)
    end
    put(5, #KEYS - 4, ARGV[1], body, now_ms())
  end
  return 1
end
return 0
"""
)


def requeue_held(
    client: redis.Redis,
    broker_id: str,
    queue: str,
    redis_id: str,
    body: bytes = b"",
    silent_ms: int = 0,
) -> bool:
    """Put a message held by ``broker_id`` back at the tail of its lane of ``queue``
    (:mod:`.queuelanes`, read from its body), storing ``body``
    first when given. False when it was no longer held (someone else moved it), or when
    ``silent_ms`` (> 0: the recovery of a silent worker) is given and ``broker_id`` has
    beaten since (:data:`SILENT`)."""
    keys = (
        acks_key(broker_id, queue),
        bodies_key(queue),
        heartbeats_key(namespace_of(queue)),
        gates_key(namespace_of(queue)),
        *waiting_keys(queue),
    )
    name = gated_name(queue)
    return bool(
        client.eval(REQUEUE_SCRIPT, len(keys), *keys, redis_id, body, broker_id, silent_ms, name)
    )


#: Dead-letter a held message: the same guards, then the zset and bodies, as Dramatiq's
#: nack; its index entry, its downstream slots (:data:`.flow.RELEASE`) and its unique
#: job's lock (:data:`.unique.UNLOCK`) go with it.
#: KEYS: acks set, bodies of the queue, dead zset, dead bodies, the message index,
#: heartbeats, the gates hash, the queue's lanes block (:func:`.keys.waiting_keys`: a keyed
#: delivery's count in flight).  ARGV: id, body, message id ('': not known), the holder's
#: broker id, silent ms, the queue's name ('' for a delay queue), its lock ('': none).
DEAD_LETTER: Final = (
    CLOCK
    + INDEX
    + SILENT
    + RELEASE
    + LANES
    + UNLOCK
    + """
if not silent(KEYS[6], ARGV[4], tonumber(ARGV[5])) then return 0 end
if redis.call('srem', KEYS[1], ARGV[1]) == 1 then
  release(KEYS[7], ARGV[6], ARGV[1])
  unfair(8, #KEYS - 7, ARGV[1])
  unlock(ARGV[7], ARGV[3])
  redis.call('zadd', KEYS[3], now_ms(), ARGV[1])
  redis.call('hset', KEYS[4], ARGV[1], ARGV[2])
  redis.call('hdel', KEYS[2], ARGV[1])
  drop_place(KEYS[5], ARGV[3], KEYS[2] .. ' ' .. ARGV[1])
  return 1
end
return 0
"""
)


def dead_letter_held(
    client: redis.Redis,
    broker_id: str,
    queue: str,
    redis_id: str,
    body: bytes,
    message_id: str,
    silent_ms: int = 0,
    lock: str = "",
) -> bool:
    """Move a message held by ``broker_id`` to the dead letters of ``queue``, stored as
    ``body``; its entry of the message index goes too (``message_id``; '' when not known),
    and its unique job's ``lock`` ('': none). False when it was no longer held, or
    ``broker_id`` beat within ``silent_ms`` (as :func:`requeue_held`)."""
    keys = (
        acks_key(broker_id, queue),
        bodies_key(queue),
        *dead_letter_keys(queue),
        message_index_key(namespace_of(queue)),
        heartbeats_key(namespace_of(queue)),
        gates_key(namespace_of(queue)),
        *waiting_keys(queue),
    )
    name = gated_name(queue)
    return bool(
        client.eval(
            DEAD_LETTER,
            len(keys),
            *keys,
            *(redis_id, body, message_id, broker_id, silent_ms, name, lock),
        )
    )


#: Whether this worker still holds a delivery, asked before it starts one it may have lost
#: (:mod:`..holds`); the heartbeat first, so a hold found is kept a heartbeat timeout more.
#: KEYS: the acks set, heartbeats.  ARGV: redis id, broker id.  Returns 1 held, 0 not.
STILL_HELD: Final = (
    CLOCK
    + """
beat(KEYS[2], ARGV[2], now_ms())
return redis.call('sismember', KEYS[1], ARGV[1])
"""
)


def still_held(client: redis.Redis, broker_id: str, queue: str, redis_id: str) -> bool:
    """:data:`STILL_HELD`: whether ``broker_id`` still holds ``redis_id`` on ``queue``."""
    keys = (acks_key(broker_id, queue), heartbeats_key(namespace_of(queue)))
    return bool(client.eval(STILL_HELD, len(keys), *keys, redis_id, broker_id))


#: The members of every set of KEYS (this worker's acks sets), in one call (the
#: Recovery pass's look for orphans: one round trip, however many queues).
#: Returns per key: its member count, then its members.
MEMBERS: Final = """
local out = {}
for _, key in ipairs(KEYS) do
  local members = redis.call('smembers', key)
  table.insert(out, #members)
  for _, member in ipairs(members) do table.insert(out, member) end
end
return out
"""


def members_of(raw: list[Any]) -> list[list[Any]]:
    """:data:`MEMBERS`' reply, split per key (in KEYS' order)."""
    found: list[list[Any]] = []
    index = 0
    while index < len(raw):
        count = int(raw[index])
        found.append(raw[index + 1 : index + 1 + count])
        index += 1 + count
    return found
