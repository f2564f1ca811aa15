"""External pool: calls to a partner API that allows a limited number of calls at once."""

from __future__ import annotations

import time

import dramatiq
from dramatiq.rate_limits import ConcurrentRateLimiter
from dramatiq.rate_limits.backends import RedisBackend
from pydantic import Field
from worker_runtime.typed import JobArguments, actor

# The partner allows this many calls in flight across every replica (pools.toml partner_api).
PARTNER_CONCURRENT_CALLS = 20
_limiter: ConcurrentRateLimiter | None = None


def limiter() -> ConcurrentRateLimiter:
    """The shared limiter, on the broker's Redis (created on first use)."""
    global _limiter
    if _limiter is None:
        backend = RedisBackend(client=dramatiq.get_broker().client)  # type: ignore[attr-defined]
        _limiter = ConcurrentRateLimiter(backend, "partner-api", limit=PARTNER_CONCURRENT_CALLS)
    return _limiter


class CustomerSync(JobArguments):
    """The arguments of :func:`sync_customer` (schema version 1)."""

    customer_id: int = Field(gt=0)


@actor(queue_name="partner", max_retries=5, min_backoff=1_000)
def sync_customer(job: CustomerSync) -> None:
    """Push a customer to the partner; over the limit, raise so CrashAwareRetries backs off."""
    with limiter().acquire():
        time.sleep(0.01)  # stands in for the HTTP call; pass an idempotency key to the partner
