"""The job API's scripts (ours; issue #26): a group's completion counted once per member,
cancellations recorded, announced and read, a message looked up in a queue's bodies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from .clock import redis_now_ms
from .delivery import CLOCK
from .keys import CANCEL_CHANNEL, CANCELLED, bodies_key, group_keys
from .schema import raw_bytes, text

if TYPE_CHECKING:
    import redis

#: Count a group member as completed, once per member, and claim the firing of the
#: group's callbacks when it is the last one: a member delivered twice (a crash before its
#: ack, a duplicate) is counted once, and the callbacks are claimed once.
#: KEYS: :func:`group_keys`.  ARGV: the member's message id, the keys' TTL ms.
#: Returns 1 when this call completed the group and claimed the callbacks, else 0.
GROUP_MEMBER_DONE: Final = """
local parties = tonumber(redis.call('get', KEYS[1]) or '0')
redis.call('sadd', KEYS[2], ARGV[1])
redis.call('pexpire', KEYS[2], ARGV[2])
if parties > 0 and redis.call('scard', KEYS[2]) >= parties then
  if redis.call('set', KEYS[3], '1', 'NX', 'PX', ARGV[2]) then return 1 end
end
return 0
"""


def group_member_done(client: redis.Redis, completion_uuid: str, member: str, ttl_ms: int) -> bool:
    """:data:`GROUP_MEMBER_DONE`: True when ``member`` completed the group and this caller
    must enqueue its callbacks."""
    return bool(client.eval(GROUP_MEMBER_DONE, 3, *group_keys(completion_uuid), member, ttl_ms))


def release_group_callbacks(client: redis.Redis, completion_uuid: str) -> None:
    """Give up the claim of :func:`group_member_done` (the callbacks could not be enqueued:
    the member's next delivery claims them again)."""
    client.delete(group_keys(completion_uuid)[2])


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
