"""Unique jobs' locks in Redis (issue #42 item 3; the API is :mod:`...unique`).

A lock (:func:`.keys.unique_key`) holds the message id of the job it admitted, with a TTL
(its last-resort expiry). It is taken in the Lua call that stores the job
(:data:`.jobs.ENQUEUE`), and freed in the Lua call that ends it: SETTLE's ``ack`` and
``dead_letter``, and recovery's DEAD_LETTER (:data:`UNLOCK`), only while it still names
that message id (a lock that expired and was taken by a newer job stays the newer job's).
A retry copy, a requeue (a shutdown, recovery of a killed worker) keep the message id and
the lock: the job is still the one admitted.

The stored body names its lock (:data:`UNIQUE_LOCK`, the Redis key), so the settlement
frees it without a look-up; a message without one costs the settlement one comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .keys import namespace_of, unique_counts_key

if TYPE_CHECKING:
    import redis

#: The message option that names a unique job's lock (its Redis key).
UNIQUE_LOCK: Final = "unique_lock"
#: What a send turned away by a lock did (``jobs_deduplicated_total{action}``).
DEDUPE_SKIPPED: Final = "skipped"
DEDUPE_REPLACED: Final = "replaced"
DEDUPE_ACTIONS: Final = (DEDUPE_SKIPPED, DEDUPE_REPLACED)

#: Lua: free the lock ``lock`` ('' none) while it names ``message_id``. Call it only after
#: removing the delivery from an acks set returned 1 (the holding ended here, once).
UNLOCK: Final = """
local function unlock(lock, message_id)
  if lock ~= '' and message_id ~= '' and redis.call('get', lock) == message_id then
    redis.call('del', lock)
  end
end
"""


@dataclass(frozen=True)
class UniqueLock:
    """The lock a send takes: ``key`` (:func:`.keys.unique_key`), held ``ttl_ms`` at most;
    ``debounce``: a pending delayed equal job is replaced (else the send is skipped)."""

    key: str
    ttl_ms: int
    debounce: bool = False


@dataclass(frozen=True)
class Stored:
    """What :data:`.jobs.ENQUEUE` did: ``stored`` (the message is in Redis now, or was by
    an earlier send of its message id), ``action`` ('' or one of :data:`DEDUPE_ACTIONS`) and
    ``holder``: the message id that held the lock ('' when none did)."""

    stored: bool
    action: str = ""
    holder: str = ""


def dedupe_counts(client: redis.Redis, queues: Sequence[str]) -> dict[tuple[str, str], int]:
    """(queue, action) -> sends turned away so far by unique jobs' locks, for each of
    ``queues`` and :data:`DEDUPE_ACTIONS` (one round trip per namespace)."""
    found: dict[tuple[str, str], int] = {}
    by_namespace: dict[str, list[tuple[str, str]]] = {}
    for queue in queues:
        for action in DEDUPE_ACTIONS:
            by_namespace.setdefault(namespace_of(queue), []).append((queue, action))
    for namespace, pairs in by_namespace.items():
        fields = [f"{queue} {action}" for queue, action in pairs]
        values = client.hmget(unique_counts_key(namespace), fields)
        found.update({pair: int(v or 0) for pair, v in zip(pairs, values, strict=True)})
    return found
