"""The delivery scripts: fetch, settle, requeue, dead-letter, replay, purge, heartbeat,
the stale workers, the backlog; each a Lua constant stating its KEYS and ARGV, called
through the typed function below it, so no caller assembles KEYS.

A script that works on several queues states its record widths as :data:`BACKLOG_KEYS`
and :data:`BACKLOG_FIELDS`; the Lua reads the width from ARGV. Scripts that may run while
Redis is full (``maxmemory`` reached, ``noeviction``) free before they write: a heartbeat
removes its old entry first, a fetch pops before it adds, a settlement removes its id from
the acks set first (Redis refuses a script's growing write only when the script has
written nothing yet). Times are Redis's (:data:`CLOCK`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .flow import (
    ADMIT,
    ADMITTED,
    RELEASE,
    Admission,
    Gate,
    flow_args,
    flow_keys,
    gated_name,
)
from .keys import (
    DEFAULT_PRIORITY,
    DELAY_SUFFIX,
    PRIORITIES,
    QueueKeys,
    acks_key,
    bodies_key,
    canonical,
    dead_letter_keys,
    delay_queue,
    due_key,
    epoch_key,
    fair_keys,
    gates_key,
    heartbeats_key,
    lane_key,
    message_index_key,
    namespace_of,
    namespaces_of,
    process_key,
    queue_key,
    waiting_keys,
    with_delay_queues,
)
from .queuelanes import LANES, NO_KEY_RATE, KeyRate
from .schema import message_fields, text
from .unique import UNLOCK

if TYPE_CHECKING:
    import redis


#: Lua: Redis's clock in ms (``TIME``), and a heartbeat that frees its old entry before it
#: writes the new one (so a full Redis takes it: see the module docstring).
CLOCK: Final = """
local function now_ms()
  local t = redis.call('time')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function beat(heartbeats, id, now)
  redis.call('zrem', heartbeats, id)
  redis.call('zadd', heartbeats, now, id)
end
"""

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

#: Lua: the message index (:func:`message_index_key`, message id -> the place of its latest
#: copy, ``"<bodies key> <redis id>"``, :func:`.keys.message_place`). ``keep_place`` records
#: a copy as the latest; ``drop_place`` removes the entry only while it names ``place`` (a
#: later copy's entry stays). Both do nothing for the message id ''.
INDEX: Final = """
local function keep_place(index, message_id, place)
  if message_id ~= '' then redis.call('hset', index, message_id, place) end
end
local function drop_place(index, message_id, place)
  if message_id ~= '' and redis.call('hget', index, message_id) == place then
    redis.call('hdel', index, message_id)
  end
end
"""

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

#: Delete a dead letter, with the same guard.  KEYS: dead zset, dead bodies.  ARGV: redis id.
PURGE: Final = """
if redis.call('zrem', KEYS[1], ARGV[1]) == 1 then
  redis.call('hdel', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

#: Fetch up to ARGV[1] messages with their ids (Dramatiq's fetch returns bodies only, so a
#: body that does not decode could not be dead-lettered by id), as many as flow control
#: admits (:mod:`.flow`: none from a paused queue, within each gate's budget and rate),
#: taken off the queue's lanes by priority within the starvation bound (:mod:`.queuelanes`),
#: then heartbeat (after the pops, which free: a full Redis still lets a worker fetch and
#: beat).
#: KEYS: the queue's bodies, this worker's acks set, heartbeats, the queue's lanes block
#: (:func:`.keys.waiting_keys`), then :func:`.flow.flow_keys` (the paused hash, the gates
#: hash, each gate's two keys).
#: ARGV: how many, broker id, the lanes block's size, the starvation bound, the per-key
#: limit (0: none), the per-key rate a second (0: none) and burst, then
#: :func:`.flow.flow_args` (queue name, lease ms, each gate's limit, rate, burst).
#: Returns [reason, deferred, wait ms, id1, body1, id2, body2, ...] (false: no body;
#: :class:`.flow.Admission`; reason ``key``: keyed messages passed over for their key's
#: limit or rate, the wait until the first a rate holds may start, 0: unknown).
FETCH: Final = (
    LANES
    + CLOCK
    + ADMIT
    + """
local now = now_ms()
local n = tonumber(ARGV[3])
local f0 = 4 + n
local len, fair, total = waiting(4, n, tonumber(ARGV[1]))
local allowed, reason, left, wait, buckets =
  admission(now, total, KEYS[f0], ARGV[8], tonumber(ARGV[1]), f0 + 2, 10)
local out = {reason, left, wait}
local skipped, key_wait = take(4, n, len, fair, tonumber(ARGV[4]), tonumber(ARGV[5]), KEYS[1],
  KEYS[2], allowed, out, tonumber(ARGV[6]), tonumber(ARGV[7]), now)
if reason == '' and skipped > 0 and (#out - 3) / 2 < allowed then
  out[1], out[2], out[3] = 'key', skipped, key_wait
end
charge(now, out, 4, KEYS[f0 + 1], ARGV[8], tonumber(ARGV[9]), f0 + 2, buckets)
beat(KEYS[3], ARGV[2], now)
return out
"""
)

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

#: Workers whose heartbeat is older than ARGV[1] ms by Redis's clock.
#: KEYS: heartbeats.  ARGV: timeout ms.  Returns their ids.
STALE_WORKERS: Final = (
    CLOCK
    + """
return redis.call('zrangebyscore', KEYS[1], 0, now_ms() - tonumber(ARGV[1]))
"""
)

#: Settle a delivery: its ack and its outcome (a retry copy stored, a requeue, a dead
#: letter) in one step, or nothing (the removal from the acks set is the guard); then
#: heartbeat and refill the freed slot: take up to ARGV[7] messages as FETCH does, so a
#: handler's next job costs no round trip of its own.
#: The removal from the acks set comes first (it frees: a full Redis still takes the rest).
#: The message index (:func:`message_index_key`) follows the message when its id is given:
#: a retry copy is its new place, an ack or a dead letter of the place it names removes it
#: (a delayed message moved to its queue was indexed there by its enqueue, before the ack).
#: The settled delivery's downstream slots are freed (in its queue's gates, given in KEYS)
#: and the refill is admitted as FETCH's is (:mod:`.flow`), off the lanes as FETCH takes.
#: A requeue, and a retry copy onto the queue itself, go to the message's own lane (read
#: from its body); a retry copy onto the delay queue to its list. An ack or a dead letter
#: frees the unique job's lock the last ARGV names (:data:`.unique.UNLOCK`; a retry copy
#: and a requeue keep it).
#: KEYS: acks set, bodies of the queue, target list, target bodies, dead zset, dead bodies,
#: heartbeats, the message index, the queue's lanes block (:func:`.keys.waiting_keys`),
#: then :func:`.flow.flow_keys`.  ARGV: kind (ack, retry, requeue, dead_letter), redis id,
#: body (retry copy, dead letter; '' keeps the stored one), target id (retry copy), broker
#: id, how many to take, message id ('': not indexed), the lanes block's size, the
#: starvation bound, the per-key limit, rate and burst, then :func:`.flow.flow_args`, then
#: the lock ('': none).
#: Returns [settled (1 or 0), reason, deferred, wait ms, id1, body1, id2, body2, ...].
SETTLE: Final = (
    LANES
    + CLOCK
    + INDEX
    + ADMIT
    + UNLOCK
    + """
local function unindex()
  drop_place(KEYS[8], ARGV[7], KEYS[2] .. ' ' .. ARGV[2])
  unlock(ARGV[#ARGV], ARGV[7])
end
local n = tonumber(ARGV[8])
local f0 = 9 + n
local settled = redis.call('srem', KEYS[1], ARGV[2])
local now = now_ms()
if settled == 1 then
  unhold(f0 + 2, ARGV[2])
  unfair(9, n, ARGV[2])
  local kind = ARGV[1]
  if kind == 'ack' then
    redis.call('hdel', KEYS[2], ARGV[2])
    unindex()
  elseif kind == 'retry' then
    redis.call('hdel', KEYS[2], ARGV[2])
    redis.call('hset', KEYS[4], ARGV[4], ARGV[3])
    if n > 1 and KEYS[3] == KEYS[10] then
      put(9, n, ARGV[4], ARGV[3], now)
    else
      redis.call('rpush', KEYS[3], ARGV[4])
    end
    keep_place(KEYS[8], ARGV[7], KEYS[4] .. ' ' .. ARGV[4])
  elseif kind == 'requeue' then
    local body = redis.call('hget', KEYS[2], ARGV[2])
    if body then put(9, n, ARGV[2], body, now) end
  elseif kind == 'dead_letter' then
    local body = ARGV[3]
    if body == '' then body = redis.call('hget', KEYS[2], ARGV[2]) end
    if body then
      redis.call('zadd', KEYS[5], now, ARGV[2])
      redis.call('hset', KEYS[6], ARGV[2], body)
    end
    redis.call('hdel', KEYS[2], ARGV[2])
    unindex()
  end
end
beat(KEYS[7], ARGV[5], now)
local len, fair, total = waiting(9, n, tonumber(ARGV[6]))
local allowed, reason, left, wait, buckets =
  admission(now, total, KEYS[f0], ARGV[13], tonumber(ARGV[6]), f0 + 2, 15)
local out = {settled, reason, left, wait}
local skipped, key_wait = take(9, n, len, fair, tonumber(ARGV[9]), tonumber(ARGV[10]), KEYS[2],
  KEYS[1], allowed, out, tonumber(ARGV[11]), tonumber(ARGV[12]), now)
if reason == '' and skipped > 0 and (#out - 4) / 2 < allowed then
  out[2], out[3], out[4] = 'key', skipped, key_wait
end
charge(now, out, 5, '', ARGV[13], tonumber(ARGV[14]), f0 + 2, buckets)
return out
"""
)


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


#: The starvation bound of a queue whose worker names none: a job waits for at most this
#: many jobs of higher lanes (:mod:`.queuelanes`; the pool's ``priority_bound``).
DEFAULT_PRIORITY_BOUND: Final = 10


def fetch_keys(broker_id: str, queue: str, gates: Sequence[Gate] = ()) -> list[str]:
    """The KEYS of :data:`FETCH` for ``broker_id`` fetching from ``queue`` gated by ``gates``."""
    heartbeats = heartbeats_key(namespace_of(queue))
    own = [bodies_key(queue), acks_key(broker_id, queue), heartbeats]
    return [*own, *waiting_keys(queue), *flow_keys(queue, gates)]


def fetch_args(
    count: int,
    broker_id: str,
    queue: str,
    gates: tuple[Gate, ...] = (),
    lease_ms: int = 0,
    bound: int = DEFAULT_PRIORITY_BOUND,
    key_limit: int = 0,
    key_rate: KeyRate = NO_KEY_RATE,
) -> list[Any]:
    """The ARGV of :data:`FETCH`: take up to ``count`` for ``broker_id`` from ``queue``
    gated by ``gates``, each slot leased ``lease_ms`` (:func:`.flow.admission_lease_ms`),
    a job passed over by at most ``bound`` of higher lanes, at most ``key_limit`` (0: no
    limit) deliveries of a key in flight and their starts within ``key_rate``
    (:mod:`.queuelanes`)."""
    return [count, broker_id, *_taking(queue, gates, lease_ms, bound, key_limit, key_rate)]


@functools.lru_cache(maxsize=1024)
def _taking(
    queue: str,
    gates: tuple[Gate, ...],
    lease_ms: int,
    bound: int,
    key_limit: int,
    key_rate: KeyRate,
) -> tuple[Any, ...]:
    """The ARGV that FETCH and SETTLE's refill end with: the lanes block's size, the
    starvation bound, the per-key limit, rate and burst, then :func:`.flow.flow_args`.
    Kept once made."""
    return (
        len(waiting_keys(queue)),
        bound,
        key_limit,
        *key_rate.redis_args(),
        *flow_args(queue, gates, lease_ms),
    )


def taken(raw: list[Any], head: int = 0) -> tuple[Admission, list[tuple[str, bytes | None]]]:
    """A FETCH reply (or SETTLE's after its first ``head`` fields): its
    :class:`.flow.Admission` and the (redis id, body or None) pairs it took."""
    admission = ADMITTED if not raw[head] else Admission.of(raw[head : head + 3])
    rest = raw[head + 3 :]
    return admission, [(text(rest[i]), rest[i + 1]) for i in range(0, len(rest), 2)]


@functools.lru_cache(maxsize=1024)
def settle_keys(
    broker_id: str, queue: str, target: str, gates: tuple[Gate, ...] = ()
) -> tuple[str, ...]:
    """The KEYS of :data:`SETTLE` for a delivery held on ``queue`` gated by ``gates``;
    ``target`` is the queue of a retry copy or requeue (``queue`` itself for a requeue: the
    copy then waits on its own lane). Kept once made: every delivery is settled with them,
    and a worker holds a few queues."""
    return (
        acks_key(broker_id, queue),
        bodies_key(queue),
        queue_key(target),
        bodies_key(target),
        *dead_letter_keys(queue),
        heartbeats_key(namespace_of(queue)),
        message_index_key(namespace_of(queue)),
        *waiting_keys(queue),
        *flow_keys(queue, gates),
    )


def settle_args(
    settlement: tuple[str, str, bytes | str, str],
    broker_id: str,
    take: int,
    message_id: str,
    queue: str,
    gates: tuple[Gate, ...] = (),
    lease_ms: int = 0,
    bound: int = DEFAULT_PRIORITY_BOUND,
    key_limit: int = 0,
    lock: str = "",
    key_rate: KeyRate = NO_KEY_RATE,
) -> list[Any]:
    """The ARGV of :data:`SETTLE`: ``settlement`` (kind, redis id, body, target id), then
    take up to ``take`` for ``broker_id`` from ``queue`` gated by ``gates``, within the
    starvation ``bound``, the ``key_limit`` and the ``key_rate`` (:func:`fetch_args`);
    ``lock``: the unique job's lock an ack or a dead letter frees ('': none)."""
    taking = _taking(queue, gates, lease_ms, bound, key_limit, key_rate)
    return [*settlement, broker_id, take, message_id, *taking, lock]


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


def heartbeat(
    client: redis.Redis, broker_id: str, namespace: str, record: bytes = b"", ttl_ms: int = 0
) -> tuple[int, Any]:
    """:data:`HEARTBEAT` for ``broker_id`` in ``namespace``: (Redis's ms, epoch or None).
    ``record`` (JSON, :func:`process_key`) is stored too, for ``ttl_ms``, unless empty."""
    keys = (heartbeats_key(namespace), epoch_key(namespace), process_key(broker_id, namespace))
    now, epoch = client.eval(HEARTBEAT, len(keys), *keys, broker_id, record, ttl_ms)
    return int(now), epoch


def still_held(client: redis.Redis, broker_id: str, queue: str, redis_id: str) -> bool:
    """:data:`STILL_HELD`: whether ``broker_id`` still holds ``redis_id`` on ``queue``."""
    keys = (acks_key(broker_id, queue), heartbeats_key(namespace_of(queue)))
    return bool(client.eval(STILL_HELD, len(keys), *keys, redis_id, broker_id))


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


def stale_workers(client: redis.Redis, namespace: str, timeout_ms: int) -> list[str]:
    """:data:`STALE_WORKERS`: ids of ``namespace``'s workers silent for ``timeout_ms``."""
    raw: list[Any] = client.eval(STALE_WORKERS, 1, heartbeats_key(namespace), timeout_ms)
    return [text(worker) for worker in raw]


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


def purge_dead_letters(client: redis.Redis, queue: str, redis_ids: Sequence[str]) -> int:
    """Delete each dead letter of ``redis_ids`` of ``queue`` (:data:`PURGE`), in one round
    trip; returns how many were deleted (the others were already gone)."""
    keys = dead_letter_keys(queue)
    pipe = client.pipeline(transaction=False)
    for redis_id in redis_ids:
        pipe.eval(PURGE, len(keys), *keys, redis_id)
    return sum(bool(gone) for gone in pipe.execute()) if redis_ids else 0


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
