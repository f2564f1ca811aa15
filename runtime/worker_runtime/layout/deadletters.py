"""A queue's dead letters replayed onto its lanes or purged, each in one round trip; the
removal from the dead zset is each one's guard (exactly once, whoever runs it). A message
becomes one in :mod:`.held` and :mod:`.delivery` (a settlement); :mod:`.lookup` finds one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from .clock import CLOCK
from .index import INDEX
from .keys import (
    bodies_key,
    canonical,
    dead_letter_keys,
    message_index_key,
    namespace_of,
    waiting_keys,
)
from .queuelanes import LANES

if TYPE_CHECKING:
    import redis


#: Replay a dead letter onto its lane (:mod:`.queuelanes`); the removal from the dead zset
#: is the guard (exactly once). The new copy is the message's latest in the index (a
#: replayed job can be cancelled by its id).
#: KEYS: dead zset, dead bodies, bodies of the queue, the message index, the queue's lanes
#: block (:func:`.keys.waiting_keys`).  ARGV: old redis id, new redis id, new body, message id.
REPLAY: Final = (
    CLOCK
    + INDEX
    + LANES
    + """
if redis.call('zrem', KEYS[1], ARGV[1]) == 1 then
  redis.call('hdel', KEYS[2], ARGV[1])
  redis.call('hset', KEYS[3], ARGV[2], ARGV[3])
  put(5, #KEYS - 4, ARGV[2], ARGV[3], now_ms())
  keep_place(KEYS[4], ARGV[4], KEYS[3] .. ' ' .. ARGV[2])
  return 1
end
return 0
"""
)


def replay_dead_letters(
    client: redis.Redis, queue: str, moves: Sequence[tuple[str, str, bytes, str]]
) -> int:
    """Move each dead letter ``redis id`` of ``queue`` to the tail of its lane of ``queue``
    as ``new redis id`` with ``body``, indexed under ``message id`` (:data:`REPLAY`, for each
    of ``moves``), in one round trip; returns how many moved (the others were already gone:
    the removal is the guard)."""
    keys = (
        *dead_letter_keys(queue),
        bodies_key(queue),
        message_index_key(namespace_of(queue)),
        *waiting_keys(canonical(queue)),
    )
    pipe = client.pipeline(transaction=False)
    for redis_id, new_redis_id, body, message_id in moves:
        pipe.eval(REPLAY, len(keys), *keys, redis_id, new_redis_id, body, message_id)
    return sum(bool(moved) for moved in pipe.execute()) if moves else 0


#: Delete a dead letter, with the same guard.  KEYS: dead zset, dead bodies.  ARGV: redis id.
PURGE: Final = """
if redis.call('zrem', KEYS[1], ARGV[1]) == 1 then
  redis.call('hdel', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


def purge_dead_letters(client: redis.Redis, queue: str, redis_ids: Sequence[str]) -> int:
    """Delete each dead letter of ``redis_ids`` of ``queue`` (:data:`PURGE`), in one round
    trip; returns how many were deleted (the others were already gone)."""
    keys = dead_letter_keys(queue)
    pipe = client.pipeline(transaction=False)
    for redis_id in redis_ids:
        pipe.eval(PURGE, len(keys), *keys, redis_id)
    return sum(bool(gone) for gone in pipe.execute()) if redis_ids else 0
