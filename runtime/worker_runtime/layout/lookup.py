"""Finding messages: by the job id the logs print (its ``message_id``), not its redis id;
a page of the messages waiting in a queue or its delay queue; and what each queue did in
each of the last minutes (:func:`.keys.activity_key`), written by the workers' passes.

A live message (queued, delayed, held) is found in one look-up in the message index
(:func:`.keys.message_index_key`); a dead letter has left the index, so its queue's dead
letters are read inside Redis, newest first, a page per call (:data:`DEAD_WITH_MESSAGE_ID`):
the bodies never cross the network, no call holds Redis longer than a page takes, and the
job that just failed, the one a log line names, is found in the first call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Final

from .keys import (
    ACTIVITY_MINUTES,
    DELAY_SUFFIX,
    QueueKeys,
    activity_key,
    dead_letter_keys,
    fair_keys,
    lane_keys,
    message_index_key,
    namespace_of,
)
from .schema import text

if TYPE_CHECKING:
    import redis

#: Dead letters one :data:`DEAD_WITH_MESSAGE_ID` call reads.
SCAN_PAGE: Final = 1_000

#: One page of a queue's dead letters, newest first from rank ARGV[1]: the redis ids whose
#: body holds ARGV[3] (the quoted message id; the caller checks each candidate's parsed
#: ``message_id``). Paged by rank: a letter added or removed meanwhile shifts the pages.
#: KEYS: the dead zset, the dead bodies.  ARGV: first rank, page size, text sought.
#: Returns [the next page's first rank (-1: none), redis id...].
DEAD_WITH_MESSAGE_ID: Final = """
local first, size = tonumber(ARGV[1]), tonumber(ARGV[2])
local ids = redis.call('zrevrange', KEYS[1], first, first + size - 1)
local found = {-1}
if #ids == size then found[1] = first + size end
for _, id in ipairs(ids) do
  local body = redis.call('hget', KEYS[2], id)
  if body and string.find(body, ARGV[3], 1, true) then table.insert(found, id) end
end
return found
"""


def dead_letter_candidates(client: redis.Redis, queue: str, message_id: str) -> Iterator[list[str]]:
    """Page by page, newest first, the redis ids of ``queue``'s dead letters whose body
    names ``message_id`` (a candidate may only mention it: parse to be sure); one call a
    page, ``count / SCAN_PAGE`` calls when read to the end."""
    zset, bodies = dead_letter_keys(queue)
    sought = f'"{message_id}"'
    first = 0
    while first >= 0:
        reply = client.eval(DEAD_WITH_MESSAGE_ID, 2, zset, bodies, first, SCAN_PAGE, sought)
        first = int(reply[0])
        yield [text(redis_id) for redis_id in reply[1:]]


def live_place(client: redis.Redis, queue: str, message_id: str) -> str | None:
    """Where the live copy of ``message_id`` is stored in ``queue``'s namespace (the message
    index's ``"<bodies key> <redis id>"``), None when it has none (settled, dead, unknown)."""
    place = client.hget(message_index_key(namespace_of(queue)), message_id)
    return None if place is None else text(place)


def waiting_page(
    client: redis.Redis, queue: str, start: int, size: int
) -> tuple[int, list[tuple[str, bytes | None]]]:
    """Page ``start`` .. ``start + size - 1`` of the messages waiting on ``queue``, in line
    order (its lanes one after the other, highest priority first, the fair lane after the
    plain normal list: :func:`.keys.lane_keys`), or, for its delay queue ``q.DQ``, of its
    delayed messages by due time (those a producer just appended and no worker has ordered
    yet come last), in one round trip whatever the queue holds: (how many wait, [(redis
    id, body or None when taken meanwhile)])."""
    keys = QueueKeys.of(queue)
    used: tuple[str, ...]
    if queue.endswith(DELAY_SUFFIX):
        script, used = DELAYED_PAGE, (keys.due, keys.delayed, keys.delayed_bodies)
    else:
        high, normal, low = lane_keys(queue)
        script, used = WAITING_PAGE, (keys.ready_bodies, high, normal, fair_keys(queue)[0], low)
    reply = client.eval(script, len(used), *used, start, size)
    count, pairs = int(reply[0]), reply[1:]
    return count, [
        (text(pairs[i]), None if not pairs[i + 1] else bytes(pairs[i + 1]))
        for i in range(0, len(pairs), 2)
    ]


#: Lua: append each of ``ids`` and its body in ``bodies`` (false: none) to ``out``.
_WITH_BODIES: Final = """
local function with_bodies(out, ids, bodies)
  for _, id in ipairs(ids) do
    table.insert(out, id)
    table.insert(out, redis.call('hget', bodies, id))
  end
  return out
end
"""

#: A page of lists (and the fair lane's zset, KEYS[4], in turn order) of redis ids read one
#: after the other, and their bodies.  KEYS: the bodies, then the lanes.
#: ARGV: first index, how many.  Returns [the lanes' length summed, id1, body1 or false, ...].
WAITING_PAGE: Final = (
    _WITH_BODIES
    + """
local first, size = tonumber(ARGV[1]), tonumber(ARGV[2])
local total, ids = 0, {}
for i = 2, #KEYS do
  local sorted = i == 4
  local length
  if sorted then length = redis.call('zcard', KEYS[i]) else length = redis.call('llen', KEYS[i]) end
  local from = math.max(0, first - total)
  if #ids < size and from < length then
    local last = from + size - #ids - 1
    local page
    if sorted then
      page = redis.call('zrange', KEYS[i], from, last)
    else
      page = redis.call('lrange', KEYS[i], from, last)
    end
    for _, id in ipairs(page) do
      table.insert(ids, id)
    end
  end
  total = total + length
end
return with_bodies({total}, ids, KEYS[1])
"""
)

#: A page of a queue's delayed messages: by due time (the due zset), then those still on the
#: delay list.  KEYS: the due zset, the delay list, its bodies.  ARGV: first index, how many.
#: Returns [how many, id1, body1 or false, ...].
DELAYED_PAGE: Final = (
    _WITH_BODIES
    + """
local ordered = redis.call('zcard', KEYS[1])
local out = {ordered + redis.call('llen', KEYS[2])}
local first, size = tonumber(ARGV[1]), tonumber(ARGV[2])
local ids = {}
if first < ordered then
  ids = redis.call('zrange', KEYS[1], first, first + size - 1)
end
if #ids < size then
  local from = math.max(0, first - ordered)
  for _, id in ipairs(redis.call('lrange', KEYS[2], from, from + size - #ids - 1)) do
    table.insert(ids, id)
  end
end
return with_bodies(out, ids, KEYS[3])
"""
)


#: Add a pass's counts to each queue's hash of this minute, keep the oldest due age seen.
#: KEYS: :func:`.keys.activity_key` of each queue.  ARGV: lifetime ms, then per key: jobs
#: done, jobs failed, oldest due age ms.
RECORD_ACTIVITY: Final = """
for i, key in ipairs(KEYS) do
  local at = 2 + 3 * (i - 1)
  if tonumber(ARGV[at]) > 0 then redis.call('hincrby', key, 'done', ARGV[at]) end
  if tonumber(ARGV[at + 1]) > 0 then redis.call('hincrby', key, 'failed', ARGV[at + 1]) end
  if tonumber(ARGV[at + 2]) > tonumber(redis.call('hget', key, 'age_ms') or '-1') then
    redis.call('hset', key, 'age_ms', ARGV[at + 2])
  end
  redis.call('pexpire', key, ARGV[1])
end
return 1
"""


def record_activity(
    client: redis.Redis, now_ms: int, activity: dict[str, tuple[int, int, int]]
) -> None:
    """:data:`RECORD_ACTIVITY`: per queue (jobs done, jobs failed, oldest due age ms) in the
    minute of ``now_ms`` (Redis's clock), in one call."""
    if not activity:
        return
    minute = now_ms // 60_000
    keys = [activity_key(queue, minute) for queue in activity]
    argv = [n for counts in activity.values() for n in counts]
    lifetime_ms = (ACTIVITY_MINUTES + 5) * 60_000
    client.eval(RECORD_ACTIVITY, len(keys), *keys, lifetime_ms, *argv)


def read_activity(
    client: redis.Redis, queues: Sequence[str], now_ms: int
) -> dict[str, list[tuple[int, int, int, int | None]]]:
    """The last :data:`ACTIVITY_MINUTES` minutes of each of ``queues``, oldest first, in one
    round trip: per queue [(minute, done, failed, oldest due age ms or None)]."""
    last = now_ms // 60_000
    minutes = range(last - ACTIVITY_MINUTES + 1, last + 1)
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        for minute in minutes:
            pipe.hmget(activity_key(queue, minute), "done", "failed", "age_ms")
    replies = iter(pipe.execute() if queues else [])
    found: dict[str, list[tuple[int, int, int, int | None]]] = {}
    for queue in queues:
        found[queue] = [
            (minute, int(done or 0), int(failed or 0), None if age is None else int(age))
            for minute, (done, failed, age) in zip(
                minutes, (next(replies) for _ in minutes), strict=True
            )
        ]
    return found
