"""The service's broker: the runtime's, with the whole middleware stack in one place.

Importing this module makes ``broker`` Dramatiq's global broker, so ``@dramatiq.actor``
declares on it. In a process that runs a pool (``WORKER_POOL`` set) it is the worker's,
built from the validated settings (exit 78 when they are bad); anywhere else, e.g. an API
process that enqueues jobs, a producer's that needs only ``REDIS_URL``.
"""

from __future__ import annotations

import redis
from dramatiq import Middleware
from worker_runtime.broker import broker_for
from worker_runtime.middleware import default_stack
from worker_runtime.settings import WorkerSettings

from . import SERVICE


def middleware(settings: WorkerSettings, client: redis.Redis) -> list[Middleware]:
    """Every middleware of a worker process, in order: the runtime's stack (tracing,
    attempts, argument models, metrics, progress, graceful shutdown, retries, time limit,
    recovery, ...: :func:`worker_runtime.middleware.default_stack` says why this order).
    Append the service's own middleware here."""
    return default_stack(settings, client)


broker = broker_for(SERVICE, middleware)
