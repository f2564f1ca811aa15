"""The delay queue: its one step (:data:`MOVE_DUE`), moving due messages to their queue,
its bounds, and what one step did (:class:`DueStep`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from .clock import CLOCK
from .index import INDEX
from .keys import (
    bodies_key,
    canonical,
    delay_queue,
    due_key,
    message_index_key,
    namespace_of,
    queue_key,
    waiting_keys,
)
from .queuelanes import LANES

#: The delay queue's one step: no worker ever holds a delayed message.
#:
#: First it takes up to ARGV[1] ids off the delay list (where producers, ours and bare
#: Dramatiq's, and retries append) into the due set (:func:`.keys.due_key`), each scored by
#: its ``options.eta`` (a body that does not decode, or without a numeric eta, is due now:
#: its queue's consumer dead-letters what is not a message); it stops early once ARGV[2]
#: bytes of bodies were read (one call never decodes more), and drops an id whose body is
#: gone. Then it moves up to ARGV[3] due ids (score <= Redis's now), earliest first, to the
#: queue: the removal from the due set and the push are this one step, so a message is
#: moved once whoever runs it, and nothing is held by a process that may stop or freeze.
#: A moved body names the queue (``queue_name`` rewritten; its ``eta`` stays, the age of the
#: backlog counts from it, the consumer ignores a past one) and keeps its redis id; it waits
#: on its own lane (:mod:`.queuelanes`); the message index (:func:`.keys.message_index_key`)
#: follows it.
#: Pops and removals come before the writes (a full Redis still takes the step).
#: KEYS: delay list, delay bodies, due set, the queue's bodies, the message index, the
#: queue's lanes block (:func:`.keys.waiting_keys`).
#: ARGV: most ids to stage, most bytes to stage, most to move, the delay queue's name, the
#: queue's name.  Returns [moved, more (1: call again now), next due ms or -1, now ms].
MOVE_DUE: Final = (
    CLOCK
    + INDEX
    + LANES
    + """
local now = now_ms()
local function due_of(body)
  local ok, fields = pcall(cjson.decode, body)
  if ok and type(fields) == 'table' and type(fields['options']) == 'table' then
    local eta = fields['options']['eta']
    if type(eta) == 'number' then return eta end
  end
  return now
end
local tail = '"message_id":"([^"]+)","message_timestamp":[-%d.eE+]+}$'
local function message_id_of(body)
  return string.match(string.sub(body, -160), tail) or ''
end
local more, bytes, staged = 0, 0, 0
local most, budget = tonumber(ARGV[1]), tonumber(ARGV[2])
while staged < most do
  if bytes >= budget then more = 1 break end
  local id = redis.call('lpop', KEYS[1])
  if not id then break end
  staged = staged + 1
  local body = redis.call('hget', KEYS[2], id)
  if body then
    bytes = bytes + #body
    redis.call('zadd', KEYS[3], due_of(body), id)
  end
end
if staged == most and redis.call('llen', KEYS[1]) > 0 then more = 1 end
local from = '{"queue_name":"' .. ARGV[4] .. '"'
local to = '{"queue_name":"' .. ARGV[5] .. '"'
local due = redis.call('zrangebyscore', KEYS[3], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
local moved = 0
for _, id in ipairs(due) do
  redis.call('zrem', KEYS[3], id)
  local body = redis.call('hget', KEYS[2], id)
  if body then
    redis.call('hdel', KEYS[2], id)
    if string.sub(body, 1, #from) == from then body = to .. string.sub(body, #from + 1) end
    redis.call('hset', KEYS[4], id, body)
    put(6, #KEYS - 5, id, body, now)
    keep_place(KEYS[5], message_id_of(body), KEYS[4] .. ' ' .. id)
    moved = moved + 1
  end
end
if #due == tonumber(ARGV[3]) then more = 1 end
local first = redis.call('zrange', KEYS[3], 0, 0, 'WITHSCORES')
local next_due = -1
if first[2] then next_due = math.floor(tonumber(first[2])) end
return {moved, more, next_due, now}
"""
)


#: Bounds of one :data:`MOVE_DUE` call: ids and body bytes taken off the delay list (each
#: body is decoded in Redis for its eta), ids moved to the queue.
STAGE_IDS: Final = 200
STAGE_BYTES: Final = 4 * 1024 * 1024
MOVE_IDS: Final = 200


@dataclass(frozen=True)
class DueStep:
    """What one :data:`MOVE_DUE` call did: ids moved to the queue, whether more wait for
    another call now, when the next delayed message is due (ms, Redis's clock; None: none)
    and Redis's now (ms)."""

    moved: int
    more: bool
    next_due_ms: int | None
    now_ms: int

    def wait_s(self, most_s: float) -> float:
        """How long to wait before the next step: until the next due message, ``most_s``
        at most (a bare Dramatiq producer wakes nobody), none when more wait now."""
        if self.more:
            return 0.0
        if self.next_due_ms is None:
            return most_s
        return max(0.0, min(most_s, (self.next_due_ms - self.now_ms) / 1000))


def due_keys(queue: str) -> tuple[str, ...]:
    """The KEYS of :data:`MOVE_DUE` for ``queue`` (or its delay queue)."""
    name = canonical(queue)
    delayed = delay_queue(name)
    return (
        queue_key(delayed),
        bodies_key(delayed),
        due_key(name),
        bodies_key(name),
        message_index_key(namespace_of(name)),
        *waiting_keys(name),
    )


def move_due(script: Any, queue: str) -> DueStep:
    """One :data:`MOVE_DUE` step for ``queue``; ``script`` is it, registered on the client
    (``client.register_script(MOVE_DUE)``)."""
    name = canonical(queue)
    moved, more, next_due, now = script(
        keys=due_keys(name),
        args=[STAGE_IDS, STAGE_BYTES, MOVE_IDS, delay_queue(name), name],
    )
    return DueStep(int(moved), bool(more), None if int(next_due) < 0 else int(next_due), int(now))
