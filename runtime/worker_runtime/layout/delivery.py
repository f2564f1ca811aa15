"""Fetch and settle: the scripts of a delivery's round trip, each a Lua constant stating
its KEYS and ARGV, called through the typed functions below it (their argument order in one
place), so no caller assembles KEYS.

Both may run while Redis is full (``maxmemory`` reached, ``noeviction``), so they free
before they write: a fetch pops before it adds, a settlement removes its id from the acks
set first (Redis refuses a script's growing write only when the script has written nothing
yet). Times are Redis's (:data:`.clock.CLOCK`).

The rest of a delivery's life has a module each: :mod:`.held` (a held delivery requeued or
dead-lettered), :mod:`.fleet` (heartbeats, the workers), :mod:`.delayed` (the delay queue's
step), :mod:`.deadletters` (replay, purge), :mod:`.backlog` (the backlog's read).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Final

from .clock import CLOCK
from .flow import (
    ADMIT,
    ADMITTED,
    Admission,
    Gate,
    flow_args,
    flow_keys,
)
from .index import INDEX
from .keys import (
    acks_key,
    bodies_key,
    dead_letter_keys,
    heartbeats_key,
    message_index_key,
    namespace_of,
    queue_key,
    waiting_keys,
)
from .queuelanes import LANES, NO_KEY_RATE, KeyRate
from .schema import text
from .unique import UNLOCK

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
