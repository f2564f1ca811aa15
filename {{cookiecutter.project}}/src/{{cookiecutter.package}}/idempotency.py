"""Idempotency keys: make a handler's side effect happen once, however often it is delivered.

Messages are delivered at least once: a SIGKILL, an OOM kill or a lost ack
delivers a message again. Guard each side effect with a key derived from the
business operation (not the message id, which a retry keeps but a re-send does
not)::

    if already_done(f"payment:{payment_id}"):
        return
    capture(payment_id, idempotency_key=key)   # pass the key on to the partner too
    mark_done(f"payment:{payment_id}")

A crash between the side effect and ``mark_done`` repeats the side effect, so
pass the key to the partner or write it in the same database transaction.
"""

from __future__ import annotations

import dramatiq
import redis

PREFIX = "idempotency:"
DEFAULT_TTL_S = 7 * 86_400


def _client() -> redis.Redis:
    client: redis.Redis = dramatiq.get_broker().client  # type: ignore[attr-defined]
    return client


def already_done(key: str) -> bool:
    """True when ``key`` was marked done (within its TTL)."""
    return bool(_client().exists(PREFIX + key))


def mark_done(key: str, ttl_s: int = DEFAULT_TTL_S) -> None:
    """Record that the side effect of ``key`` happened (kept ``ttl_s``, default 7 days)."""
    _client().set(PREFIX + key, 1, ex=ttl_s)


def claim(key: str, ttl_s: int = DEFAULT_TTL_S) -> bool:
    """Atomically mark ``key`` done; True for the one caller that got there first."""
    return bool(_client().set(PREFIX + key, 1, nx=True, ex=ttl_s))
