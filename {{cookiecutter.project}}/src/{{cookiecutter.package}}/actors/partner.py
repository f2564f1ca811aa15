"""External pool: calls to a partner API that allows a limited number of calls at once and
a rate of calls.

Both limits live in pools.toml (``[downstream.partner_api]``: ``capacity - reserved`` calls
in flight, ``rate`` calls a second; ``DOWNSTREAM_PARTNER_API_*`` override them per
environment) and are enforced before the fetch, across every process, replica and pool
that ``uses`` it: a job over the limit stays queued, never fetched, rejected and retried,
and spends no attempt on waiting. The handler holds no limiter of its own.
"""

from __future__ import annotations

import time

from pydantic import Field
from worker_runtime.typed import JobArguments, actor


class CustomerSync(JobArguments):
    """The arguments of :func:`sync_customer` (schema version 1)."""

    customer_id: int = Field(gt=0)


@actor(queue_name="partner", max_retries=5, min_backoff=1_000)
def sync_customer(job: CustomerSync) -> None:
    """Push a customer to the partner (admitted within its budget and rate)."""
    time.sleep(0.01)  # stands in for the HTTP call; pass an idempotency key to the partner
