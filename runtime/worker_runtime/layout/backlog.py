"""The backlog of several queues in one call (:data:`BACKLOG`, constant work per queue):
per queue every lane's depth and head, the delayed, the dead letters, the next due.
Its record widths are :data:`BACKLOG_KEYS` and :data:`BACKLOG_FIELDS`; the Lua reads the
width from ARGV.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from .keys import (
    DEFAULT_PRIORITY,
    PRIORITIES,
    QueueKeys,
    canonical,
    fair_keys,
    lane_key,
)

if TYPE_CHECKING:
    import redis


#: The lanes beside a queue's own list (:func:`.keys.lane_key`), in :data:`BACKLOG`'s order.
_OTHER_LANES: Final = tuple(p for p in PRIORITIES if p != DEFAULT_PRIORITY)


#: What :data:`BACKLOG` returns per queue, in order (its record width is the length): the
#: depth counts every lane; ``head`` is the queue's own list's, ``<priority>_head`` each
#: other lane's (the oldest waiting message is one of them: each lane is in line order).
BACKLOG_FIELDS: Final = (
    "depth",
    "head",
    "delayed",
    "delayed_head",
    "dead_letters",
    "next_due",
    *(f"{priority}_head" for priority in _OTHER_LANES),
    "fair_head",
)
#: The :data:`BACKLOG_FIELDS` holding the head of each lane of a queue (the fair lane's:
#: its message waiting the longest).
LANE_HEADS: Final = ("head", *(f"{priority}_head" for priority in _OTHER_LANES), "fair_head")


#: The backlog of several queues in one call (constant work per queue).
#: KEYS: :func:`backlog_keys` of each queue, :data:`BACKLOG_KEYS` keys per queue.
#: ARGV: ids tried at a list's head when one has no body; keys per queue.
#: Returns per queue the :data:`BACKLOG_FIELDS`: every lane's llen summed, head body or
#: false, delayed (the delay list's llen plus the due set's zcard), the delay list's head
#: body or false, dead-letter count, the due set's earliest score (ms) or false, then the
#: head body (or false) of each other lane (keys 7 on of a queue's), and of the fair lane's
#: message waiting the longest (its zset by due time, the last key of a queue's).
BACKLOG: Final = """
local out = {}
local probe = tonumber(ARGV[1])
local width = tonumber(ARGV[2])
local function head(list, bodies)
  local ids = redis.call('lrange', list, 0, probe - 1)
  for _, id in ipairs(ids) do
    local body = redis.call('hget', bodies, id)
    if body then return body end
  end
  return false
end
for i = 1, #KEYS, width do
  local depth = redis.call('llen', KEYS[i]) + redis.call('zcard', KEYS[i + width - 2])
  for j = i + 6, i + width - 3 do depth = depth + redis.call('llen', KEYS[j]) end
  table.insert(out, depth)
  table.insert(out, head(KEYS[i], KEYS[i + 1]))
  table.insert(out, redis.call('llen', KEYS[i + 2]) + redis.call('zcard', KEYS[i + 5]))
  table.insert(out, head(KEYS[i + 2], KEYS[i + 3]))
  table.insert(out, redis.call('zcard', KEYS[i + 4]))
  table.insert(out, redis.call('zrange', KEYS[i + 5], 0, 0, 'WITHSCORES')[2] or false)
  for j = i + 6, i + width - 3 do table.insert(out, head(KEYS[j], KEYS[i + 1])) end
  local oldest = redis.call('zrange', KEYS[i + width - 1], 0, 0)[1]
  table.insert(out, oldest and redis.call('hget', KEYS[i + 1], oldest) or false)
end
return out
"""


def backlog_keys(queue: str) -> tuple[str, ...]:
    """The keys :data:`BACKLOG` reads for ``queue``, in its order."""
    keys = QueueKeys.of(queue)
    own = keys.ready, keys.ready_bodies, keys.delayed, keys.delayed_bodies, keys.dead, keys.due
    fair, since = fair_keys(queue)[:2]
    return (*own, *(lane_key(canonical(queue), p) for p in _OTHER_LANES), fair, since)


#: Keys :data:`BACKLOG` takes per queue.
BACKLOG_KEYS: Final = len(backlog_keys("q"))


def read_backlog_records(
    client: redis.Redis, queues: Sequence[str], head_probe: int
) -> list[dict[str, Any]]:
    """One :data:`BACKLOG` call; per queue a dict of the :data:`BACKLOG_FIELDS` (raw replies)."""
    if not queues:
        return []
    keys = [key for queue in queues for key in backlog_keys(queue)]
    raw: list[Any] = client.eval(BACKLOG, len(keys), *keys, head_probe, BACKLOG_KEYS)
    width = len(BACKLOG_FIELDS)
    return [
        dict(zip(BACKLOG_FIELDS, raw[start : start + width], strict=True))
        for start in range(0, len(raw), width)
    ]
