"""The job API's scripts (ours; issue #26): a message enqueued (once per message id, for a
producer's resend), a group's completion counted once per member and its callbacks enqueued
with it, cancellations recorded, announced and read, a message found by its id."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .clock import CLOCK, redis_now_ms
from .index import INDEX
from .keys import (
    CANCEL_CHANNEL,
    DEFAULT_PRIORITY,
    NAMESPACE,
    SANDBOX_NAMESPACE,
    WAKE_CHANNEL,
    bodies_key,
    cancelled_key,
    canonical,
    due_key,
    fair_keys,
    group_keys,
    lane_key,
    message_index_key,
    message_place,
    namespace_of,
    queue_key,
    sent_key,
    unique_counts_key,
)
from .queuelanes import LANES
from .schema import text
from .unique import DEDUPE_REPLACED, DEDUPE_SKIPPED, Stored, UniqueLock

if TYPE_CHECKING:
    import redis

#: How long a producer's send of a message id is remembered (10 minutes): a resend of the
#: same message id meanwhile (after a send that raised, the message may have been stored)
#: stores nothing. Costs one small key per message sent, for that long.
SENT_TTL_MS: Final = 600_000

#: Store a new message: its body, its redis id on the queue, its place in the message index
#: (:func:`message_index_key`) and a wake-up of its queue's consumers, in one step; when
#: ``once`` (a producer's send), only when no message of the same message id was sent in the
#: last :data:`SENT_TTL_MS` (:func:`sent_key`, written first: a resend whose first send was
#: stored, or is stored later, stores nothing).
#: A keyed message (ARGV[8], its fairness key) waits on the queue's fair lane instead, at
#: its key's next turn (:mod:`.queuelanes`).
#: A unique job (:mod:`.unique`, ARGV[10] not '') is stored only while its lock is free, and
#: takes it (the message id, for the TTL ARGV[10]); a lock held by another message id skips
#: the send (counted in the counts hash), unless ARGV[11] is ``debounce`` and the holder is
#: still delayed on this send's delay queue (its body in KEYS[1]): then the holder is
#: dropped (its body, its due entry, its index entry: the delay list's stale id is dropped
#: by MOVE_DUE) and this send stored in its place, with the lock (``replaced``, counted). A
#: skipped send writes no sent marker (a resend is judged again).
#: KEYS: the bodies hash, the list it waits on (its lane, :func:`waiting_list`), the
#: message index, the sent marker, then for a keyed message :func:`.keys.fair_keys`, then
#: for a unique job its lock, the due set of its queue and the counts hash (the last three).
#: ARGV: redis id, body, message id, place, the marker's TTL ms ('': not once), wake channel,
#: queue to wake ('': none), fairness key ('': none), when it is due (ms), the lock's TTL ms
#: ('': not unique), mode (skip, debounce), the queue's name.
#: Returns {1 stored, 0 the message id was sent already, 2 skipped, 3 replaced; holder}.
ENQUEUE: Final = (
    INDEX
    + LANES
    + """
if ARGV[5] ~= '' and redis.call('exists', KEYS[4]) == 1 then return {0, ''} end
local outcome, holder = 1, ''
if ARGV[10] ~= '' then
  local lock, due, counts = KEYS[#KEYS - 2], KEYS[#KEYS - 1], KEYS[#KEYS]
  holder = redis.call('get', lock) or ''
  if holder ~= '' then
    outcome = 2
    if ARGV[11] == 'debounce' then
      local place = redis.call('hget', KEYS[3], holder)
      local bodies, id = false, false
      if place then bodies, id = string.match(place, '^(.+) ([^ ]+)$') end
      if bodies == KEYS[1] and redis.call('hdel', KEYS[1], id) == 1 then
        redis.call('zrem', due, id)
        redis.call('hdel', KEYS[3], holder)
        outcome = 3
      end
    end
    local action = 'skipped'
    if outcome == 3 then action = 'replaced' end
    redis.call('hincrby', counts, ARGV[12] .. ' ' .. action, 1)
    if outcome == 2 then return {2, holder} end
  end
  redis.call('set', lock, ARGV[3], 'PX', ARGV[10])
end
if ARGV[5] ~= '' then redis.call('set', KEYS[4], ARGV[1], 'PX', ARGV[5]) end
redis.call('hset', KEYS[1], ARGV[1], ARGV[2])
if ARGV[8] ~= '' then
  fair_put(5, ARGV[1], ARGV[8], tonumber(ARGV[9]))
else
  redis.call('rpush', KEYS[2], ARGV[1])
end
keep_place(KEYS[3], ARGV[3], ARGV[4])
if ARGV[7] ~= '' then redis.call('publish', ARGV[6], ARGV[7]) end
return {outcome, holder}
"""
)

_OUTCOMES: Final = {
    1: ("", True),
    0: ("", False),
    2: (DEDUPE_SKIPPED, False),
    3: (DEDUPE_REPLACED, True),
}


def waiting_list(queue: str, priority: str = DEFAULT_PRIORITY) -> str:
    """The list a new message of ``queue`` waits on: its lane of ``priority``
    (:func:`.keys.lane_key`), or, on a delay queue, the delay list (the move of a due
    message puts it on its lane)."""
    return queue_key(queue) if queue != canonical(queue) else lane_key(queue, priority)


def enqueue_message(
    script: Any,
    queue: str,
    redis_id: str,
    body: bytes,
    message_id: str,
    once: bool,
    priority: str = DEFAULT_PRIORITY,
    key: str = "",
    due_ms: int = 0,
    lock: UniqueLock | None = None,
) -> Stored:
    """:data:`ENQUEUE` (``script``: it registered on a client, :meth:`redis.Redis.
    register_script`) the message ``redis_id`` with ``body`` on ``queue``, on the lane of
    ``priority``, or with a fairness ``key`` (due at ``due_ms``) on its fair lane; ``once``:
    a producer's send, stored only when ``message_id`` was not sent in the last
    :data:`SENT_TTL_MS`; ``lock``: a unique job's (:mod:`.unique`)."""
    namespace = namespace_of(queue)
    keys = [bodies_key(queue), waiting_list(queue, priority), message_index_key(namespace)]
    keys += [sent_key(message_id, namespace)]
    keyed = key if priority == DEFAULT_PRIORITY and queue == canonical(queue) else ""
    if keyed:
        keys += fair_keys(queue)
    wake = queue if namespace == NAMESPACE else ""  # the sandbox's consumers poll
    ttl = SENT_TTL_MS if once else ""
    place = message_place(queue, redis_id)
    args: list[Any] = [redis_id, body, message_id, place, ttl, WAKE_CHANNEL, wake, keyed, due_ms]
    if lock is None:
        args += ["", "", ""]
    else:
        keys += [lock.key, due_key(queue), unique_counts_key(namespace)]
        args += [lock.ttl_ms, "debounce" if lock.debounce else "skip", canonical(queue)]
    outcome, holder = script(keys=keys, args=args)
    action, stored = _OUTCOMES[int(outcome)]
    return Stored(stored, action, text(holder))


#: Count a group member as completed, once per member, and when it is the last one enqueue
#: the group's callbacks, in the same script: a member delivered twice (a crash before its
#: ack, a duplicate) is counted once, and the callbacks are enqueued exactly once, even when
#: the worker dies right after (there is no moment where they are claimed and not enqueued).
#: KEYS: :func:`group_keys`, then each callback's ready list, bodies hash and message
#: index (:func:`message_index_key`).
#: ARGV: the member's message id, the keys' TTL ms, the wake-up channel, then each
#: callback's redis id, body, message id and the queue to wake ('' for none).
#: Returns 1 when this call completed the group and enqueued the callbacks, else 0.
GROUP_MEMBER_DONE: Final = (
    INDEX
    + """
local parties = tonumber(redis.call('get', KEYS[1]) or '0')
redis.call('sadd', KEYS[2], ARGV[1])
redis.call('pexpire', KEYS[2], ARGV[2])
if parties == 0 or redis.call('scard', KEYS[2]) < parties then return 0 end
if not redis.call('set', KEYS[3], '1', 'NX', 'PX', ARGV[2]) then return 0 end
for i = 1, (#KEYS - 3) / 3 do
  local queue, bodies, index = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local at = 3 + 4 * (i - 1)
  redis.call('hset', bodies, ARGV[at + 1], ARGV[at + 2])
  redis.call('rpush', queue, ARGV[at + 1])
  keep_place(index, ARGV[at + 3], bodies .. ' ' .. ARGV[at + 1])
  if ARGV[at + 4] ~= '' then redis.call('publish', ARGV[3], ARGV[at + 4]) end
end
return 1
"""
)


@dataclass(frozen=True)
class Callback:
    """A group's completion callback as :data:`GROUP_MEMBER_DONE` enqueues it: its queue (or
    delay queue), its redis id, its encoded body, its message id and its priority."""

    queue: str
    redis_id: str
    body: bytes
    message_id: str
    priority: str = DEFAULT_PRIORITY


def group_member_done(
    client: redis.Redis,
    completion_uuid: str,
    member: str,
    ttl_ms: int,
    callbacks: Sequence[Callback] = (),
) -> bool:
    """:data:`GROUP_MEMBER_DONE`: True when ``member`` completed the group and ``callbacks``
    were enqueued by this call."""
    keys = [*group_keys(completion_uuid)]
    argv: list[Any] = [member, ttl_ms, WAKE_CHANNEL]
    for callback in callbacks:
        namespace = namespace_of(callback.queue)
        keys += [waiting_list(callback.queue, callback.priority), bodies_key(callback.queue)]
        keys += [message_index_key(namespace)]
        wakes = namespace == NAMESPACE  # the sandbox's consumers poll
        argv += [callback.redis_id, callback.body, callback.message_id]
        argv += [callback.queue if wakes else ""]
    return bool(client.eval(GROUP_MEMBER_DONE, len(keys), *keys, *argv))


#: How long a cancellation holds (7 days): a message delayed longer runs after all.
CANCEL_TTL_MS: Final = 7 * 86_400_000

#: Record a cancellation in one namespace (announced on a channel, unless ''), and say
#: whether the message is stored there (queued, delayed, or held by a worker): its place
#: read from :func:`message_index_key`, its body looked up; no body is read. Drops the
#: lapsed cancellations first.
#: KEYS: :func:`cancelled_key`, :func:`message_index_key`.  ARGV: message id, TTL ms, channel.
#: Returns 1 when the message's latest copy is stored in the namespace, else 0.
CANCEL: Final = (
    CLOCK
    + """
local now = now_ms()
redis.call('zremrangebyscore', KEYS[1], '-inf', now)
redis.call('zadd', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if ARGV[3] ~= '' then redis.call('publish', ARGV[3], ARGV[1]) end
local place = redis.call('hget', KEYS[2], ARGV[1])
if not place then return 0 end
local bodies, id = string.match(place, '^(.+) ([^ ]+)$')
if bodies and redis.call('hexists', bodies, id) == 1 then return 1 end
return 0
"""
)

#: Whether a message is cancelled: 1 when ``ARGV[1]`` is in ``KEYS[1]`` (:func:`cancelled_key`)
#: and its cancellation has not lapsed, else 0.
IS_CANCELLED: Final = (
    CLOCK
    + """
local lapses = redis.call('zscore', KEYS[1], ARGV[1])
if lapses and tonumber(lapses) > now_ms() then return 1 end
return 0
"""
)


def record_cancel(client: redis.Redis, message_id: str) -> bool:
    """:data:`CANCEL` ``message_id`` for :data:`CANCEL_TTL_MS` in every namespace (the
    sandbox's queue has its own; its workers poll, the others hear it on
    :data:`CANCEL_CHANNEL`), in one round trip. True when the message is stored in one."""
    pipe = client.pipeline(transaction=False)
    for namespace in (NAMESPACE, SANDBOX_NAMESPACE):
        channel = CANCEL_CHANNEL if namespace == NAMESPACE else ""
        keys = (cancelled_key(namespace), message_index_key(namespace))
        pipe.eval(CANCEL, 2, *keys, message_id, CANCEL_TTL_MS, channel)
    return any(pipe.execute())


def is_cancelled(client: redis.Redis, message_id: str, namespace: str) -> bool:
    """:data:`IS_CANCELLED`: whether ``message_id`` is cancelled in ``namespace``."""
    return bool(client.eval(IS_CANCELLED, 1, cancelled_key(namespace), message_id))


def cancelled_ids(
    client: redis.Redis, namespace: str = NAMESPACE, after: float | None = None
) -> dict[str, int]:
    """The cancellations in force in ``namespace``: message id -> when it lapses (Redis
    time, ms); only those that lapse at ``after`` or later, when given (those recorded since:
    the TTL is the same for all)."""
    low = max(after or 0, redis_now_ms(client))
    found: Any = client.zrangebyscore(cancelled_key(namespace), low, "+inf", withscores=True)
    return {text(member): int(score) for member, score in found}
