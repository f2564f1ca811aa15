"""Idempotency: a handler's side effect happens once, however often its message is delivered.

Messages are delivered at least once: a SIGKILL, an OOM kill or a lost ack
delivers a message again, sometimes after its side effect already happened. Key
each side effect by the business operation (``f"payment:{payment_id}"``, not the
message id, which a re-send does not keep) and hand the side effect to a helper,
which runs it only if it has not been done, and records it as done *after* it
happened (never before, which would lose it when the worker dies in between).

The strongest guarantee, when the side effect is a database write (the ``postgres`` extra):
:func:`once_in_transaction` records the key in the same transaction as the
write (``INSERT ... ON CONFLICT DO NOTHING`` on a unique key). Both commit or
neither does: exactly once, whatever kills the worker when::

    once_in_transaction(f"invoice:{order_id}", lambda conn: conn.execute(
        "insert into invoices (order_id, total) values (%s, %s)", (order_id, total)))

Without a database: :func:`once_with_lease` takes a short Redis lease on the key
(renewed while the side effect runs; a second delivery waits for it), runs the
side effect, then marks the key done. Writes the side effect queues on the
transaction ``tx`` it receives commit atomically with the done mark, so a Redis
write is exactly once too::

    once_with_lease(f"welcome:{user_id}", lambda tx: tx.sadd("welcomed", user_id))

It is weaker for anything else: when the worker dies after an external call
(an e-mail, a partner API) but before the done mark, the next delivery calls
again. Pass the key on to the partner as its idempotency key, so it
de-duplicates that call::

    once_with_lease(key, lambda tx: provider.capture(payment_id, idempotency_key=key))

:func:`at_most_once` marks the key *before* the side effect: a worker dying in
between loses the side effect for good. Use it only where a loss is better than
a duplicate, and say so where you call it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
import redis.client

from . import layout
from .timing import SEVEN_DAYS_MS

if TYPE_CHECKING:
    import psycopg

#: How long a lease outlives a silent holder (a worker that died while holding it).
LEASE_S = 10.0
#: How long a done key is kept, so a late redelivery still finds it (7 days).
KEEP_S = SEVEN_DAYS_MS // 1000
#: Pause between two looks at a lease another delivery holds.
POLL_S = 0.05
DONE = layout.IDEMPOTENCY_DONE
#: The table of done keys. The worker creates it when it opens its pool (DatabasePool); own
#: it in your migrations if your database role may not create tables.
TABLE_SQL = """
create table if not exists idempotency_keys (
    key text primary key,
    done_at timestamptz not null default now()
)
"""


class LeaseBusyError(RuntimeError):
    """Another delivery of the same key is running its side effect; retry later."""


class LeaseLostError(RuntimeError):
    """The lease expired while the side effect ran (the worker was frozen longer than the
    lease) and another delivery took it: nothing was marked done, and the Redis writes of
    the side effect were discarded."""


done_key = layout.idempotency_key
lease_key = layout.idempotency_lease_key


def _broker_client() -> redis.Redis:
    import dramatiq

    client: redis.Redis = dramatiq.get_broker().client  # type: ignore[attr-defined]
    return client


class _Renewer(threading.Thread):
    """Renews a lease every third of its length until stopped."""

    def __init__(self, client: redis.Redis, key: str, token: str, lease_ms: int) -> None:
        super().__init__(name=f"lease {key}", daemon=True)
        self.client, self.key, self.token, self.lease_ms = client, key, token, lease_ms
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.lease_ms / 3000):
            # A failed renewal is tried again next time; the done mark checks the lease.
            with contextlib.suppress(redis.RedisError):
                layout.renew_lock(self.client, self.key, self.token, self.lease_ms)

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def once_with_lease(
    key: str,
    effect: Callable[[redis.client.Pipeline], Any],
    *,
    lease_s: float = LEASE_S,
    keep_s: int = KEEP_S,
    client: redis.Redis | None = None,
) -> bool:
    """Run ``effect(tx)`` unless ``key`` is done; mark it done after it succeeded.

    Parameters:
      key: names the side effect (the business operation, e.g. ``f"payment:{id}"``).
      effect: the side effect. Redis writes it queues on ``tx`` (a MULTI transaction;
        no reads) commit together with the done mark. Raise to leave the key undone.
      lease_s: how long the lease outlives a holder that died (default 10 s); it is
        renewed while ``effect`` runs. A second delivery waits up to this long.
      keep_s: how long the done mark is kept (default 7 days).
      client: the Redis client (default: the broker's).

    Returns:
      True when ``effect`` ran now, False when ``key`` had already been done.

    Raises:
      LeaseBusyError: another delivery still runs ``effect`` after ``lease_s``.
      LeaseLostError: the lease was taken over while ``effect`` ran.
    """
    client = client or _broker_client()
    state, lease = done_key(key), lease_key(key)
    token, lease_ms = uuid.uuid4().hex, max(1, int(lease_s * 1000))
    deadline = time.monotonic() + lease_s + 1
    while (got := layout.acquire_idempotency(client, key, token, lease_ms, keep_s)) == -1:
        if time.monotonic() > deadline:
            raise LeaseBusyError(f"{key!r} is being done by another delivery")
        time.sleep(POLL_S)
    if got == 0:
        return False
    renewer = _Renewer(client, lease, token, lease_ms)
    renewer.start()
    try:
        with client.pipeline(transaction=True) as tx:
            tx.watch(state)  # type: ignore[no-untyped-call]  # a takeover rewrites it
            if tx.get(state) != token.encode():
                raise LeaseLostError(f"{key!r}: the lease was taken over")
            tx.multi()
            effect(tx)
            tx.set(state, DONE, ex=keep_s)
            tx.delete(lease)
            renewer.stop()
            tx.execute()
    except redis.WatchError:
        raise LeaseLostError(f"{key!r}: the lease was taken over during the side effect") from None
    except BaseException:
        renewer.stop()
        with contextlib.suppress(redis.RedisError):  # else the lease expires by itself
            layout.release_lock(client, lease, token)
        raise
    return True


def at_most_once(key: str, keep_s: int = KEEP_S, client: redis.Redis | None = None) -> bool:
    """Mark ``key`` done *now*, before the side effect; True for the one caller that got
    there first. A worker that dies after this call and before the side effect loses the
    side effect for good: use it only where a loss is better than a duplicate."""
    client = client or _broker_client()
    return bool(client.set(done_key(key), DONE, nx=True, ex=keep_s))


def is_done(key: str, client: redis.Redis | None = None) -> bool:
    """True when ``key`` was marked done by :func:`once_with_lease` or :func:`at_most_once`."""
    return (client or _broker_client()).get(done_key(key)) == DONE


def create_table(conn: psycopg.Connection[Any]) -> None:
    """Create ``idempotency_keys`` if it is missing (one process at a time)."""
    with conn.transaction():
        conn.execute("select pg_advisory_xact_lock(hashtext('idempotency_keys'))")
        conn.execute(TABLE_SQL)


def once_in_transaction(key: str, effect: Callable[[psycopg.Connection[Any]], Any]) -> bool:
    """Run ``effect(conn)`` in one transaction with the record of ``key``: exactly once.

    The key is inserted first (``INSERT ... ON CONFLICT DO NOTHING``); when it was
    already there, nothing runs. A second delivery running at the same moment waits
    on the key's row until the first commits (then skips) or rolls back (then runs).

    Parameters:
      key: names the side effect (the business operation, e.g. ``f"invoice:{id}"``).
      effect: the database writes, on ``conn`` (this worker's pool; do not commit).

    Returns:
      True when ``effect`` ran and committed now, False when ``key`` was already done.
    """
    from . import db  # the postgres extra's

    with db.connection() as conn, conn.transaction():
        inserted = conn.execute(
            "insert into idempotency_keys (key) values (%s) on conflict (key) do nothing "
            "returning key",
            (key,),
        ).fetchone()
        if inserted is None:
            return False
        effect(conn)
    return True
