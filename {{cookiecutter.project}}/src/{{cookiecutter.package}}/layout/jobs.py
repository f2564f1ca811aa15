"""The job API's scripts (ours; issue #26): a group's completion counted once per member and
its callbacks enqueued with it, cancellations recorded, announced and read, a message found
by its id."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .clock import redis_now_ms
from .delivery import CLOCK
from .keys import (
    CANCEL_CHANNEL,
    CANCELLED,
    NAMESPACE,
    WAKE_CHANNEL,
    bodies_key,
    group_keys,
    namespace_of,
    queue_key,
)
from .schema import raw_bytes, text

if TYPE_CHECKING:
    import redis

#: Count a group member as completed, once per member, and when it is the last one enqueue
#: the group's callbacks, in the same script: a member delivered twice (a crash before its
#: ack, a duplicate) is counted once, and the callbacks are enqueued exactly once, even when
#: the worker dies right after (there is no moment where they are claimed and not enqueued).
#: KEYS: :func:`group_keys`, then each callback's ready list and bodies hash.
#: ARGV: the member's message id, the keys' TTL ms, the wake-up channel, then each
#: callback's redis id, body and the queue to wake ('' for none).
#: Returns 1 when this call completed the group and enqueued the callbacks, else 0.
GROUP_MEMBER_DONE: Final = """
local parties = tonumber(redis.call('get', KEYS[1]) or '0')
redis.call('sadd', KEYS[2], ARGV[1])
redis.call('pexpire', KEYS[2], ARGV[2])
if parties > 0 and redis.call('scard', KEYS[2]) >= parties then
  if redis.call('set', KEYS[3], '1', 'NX', 'PX', ARGV[2]) then
    for i = 1, (#KEYS - 3) / 2 do
      local at = 3 + 3 * (i - 1)
      redis.call('hset', KEYS[3 + 2 * i], ARGV[at + 1], ARGV[at + 2])
      redis.call('rpush', KEYS[2 + 2 * i], ARGV[at + 1])
      if ARGV[at + 3] ~= '' then redis.call('publish', ARGV[3], ARGV[at + 3]) end
    end
    return 1
  end
end
return 0
"""


@dataclass(frozen=True)
class Callback:
    """A group's completion callback as :data:`GROUP_MEMBER_DONE` enqueues it: its queue (or
    delay queue), its redis id and its encoded body."""

    queue: str
    redis_id: str
    body: bytes


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
        keys += [queue_key(callback.queue), bodies_key(callback.queue)]
        wakes = namespace_of(callback.queue) == NAMESPACE  # the sandbox's consumers poll
        argv += [callback.redis_id, callback.body, callback.queue if wakes else ""]
    return bool(client.eval(GROUP_MEMBER_DONE, len(keys), *keys, *argv))


#: How long a cancellation holds (7 days): a message delayed longer runs after all.
CANCEL_TTL_MS: Final = 7 * 86_400_000

#: Record a cancellation and announce it; drop the lapsed ones.
#: KEYS: :data:`CANCELLED`.  ARGV: message id, TTL ms, channel.
CANCEL: Final = (
    CLOCK
    + """
local now = now_ms()
redis.call('zremrangebyscore', KEYS[1], '-inf', now)
redis.call('zadd', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('publish', ARGV[3], ARGV[1])
return 1
"""
)


def record_cancel(client: redis.Redis, message_id: str) -> None:
    """:data:`CANCEL` ``message_id`` for :data:`CANCEL_TTL_MS`."""
    client.eval(CANCEL, 1, CANCELLED, message_id, CANCEL_TTL_MS, CANCEL_CHANNEL)


def cancelled_ids(client: redis.Redis) -> dict[str, int]:
    """Every cancellation in force: message id -> when it lapses (Redis time, ms)."""
    now = redis_now_ms(client)
    found: Any = client.zrangebyscore(CANCELLED, now, "+inf", withscores=True)
    return {text(member): int(score) for member, score in found}


def holds_message(client: redis.Redis, queue: str, message_id: str) -> bool:
    """Whether ``queue``'s bodies (waiting or held by a worker; a delay queue's too) include
    the message ``message_id``: an HSCAN of the bodies in pages, so Redis is never blocked
    (one round trip per 1,000 bodies), matching the id as Dramatiq encodes it."""
    needle = f'"message_id":"{message_id}"'.encode()
    bodies = client.hscan_iter(bodies_key(queue), count=1000)
    return any(needle in (raw_bytes(body) or b"") for _, body in bodies)
