"""Leases: a key held by one token for a while, renewed and released only by its holder.

The schedules' run locks and the idempotency leases use these scripts; idempotency's
done key is taken with its lease in one step (:func:`acquire_idempotency`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from .keys import idempotency_key, idempotency_lease_key

if TYPE_CHECKING:
    import redis


#: Extend a lock held by ARGV[1].  KEYS: the lock.  ARGV: holder, lease ms.  1 when held.
RENEW_LOCK: Final = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""

#: Delete a lock held by ARGV[1].  KEYS: the lock.  ARGV: holder.  1 when it was held.
RELEASE_LOCK: Final = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def renew_lock(client: redis.Redis, key: str, holder: str, lease_ms: int) -> bool:
    """Extend lock ``key`` by ``lease_ms`` if ``holder`` holds it; False when it does not."""
    return bool(client.eval(RENEW_LOCK, 1, key, holder, lease_ms))


def release_lock(client: redis.Redis, key: str, holder: str) -> bool:
    """Delete lock ``key`` if ``holder`` holds it."""
    return bool(client.eval(RELEASE_LOCK, 1, key, holder))


#: The value of an idempotency done key (:func:`idempotency_key`) once its side effect is done.
IDEMPOTENCY_DONE: Final = b"done"

#: Take the lease on an idempotent side effect unless it is done (:data:`IDEMPOTENCY_DONE`).
#: KEYS: its done key (:func:`idempotency_key`), its lease (:func:`idempotency_lease_key`).
#: ARGV: token, lease ms, keep s.  The done key then holds the token (a takeover rewrites
#: it); renew and release the lease with :func:`renew_lock` and :func:`release_lock`.
#: Returns 1 (taken), 0 (already done) or -1 (another delivery holds the lease).
ACQUIRE_IDEMPOTENCY: Final = """
if redis.call('get', KEYS[1]) == 'done' then return 0 end
if redis.call('set', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[3])
  return 1
end
return -1
"""


def acquire_idempotency(
    client: redis.Redis, key: str, token: str, lease_ms: int, keep_s: int
) -> int:
    """:data:`ACQUIRE_IDEMPOTENCY` for the side effect ``key``: 1 taken, 0 done, -1 held."""
    keys = (idempotency_key(key), idempotency_lease_key(key))
    return int(client.eval(ACQUIRE_IDEMPOTENCY, len(keys), *keys, token, lease_ms, keep_s))
