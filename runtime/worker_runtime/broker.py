"""The broker of a service: a RedisBroker built from settings (:func:`broker_for`).

A service's ``broker.py`` calls :func:`broker_for` with its middleware stack
(:func:`.middleware.default_stack`, where a team appends its own): in a process that runs a
pool it is the worker's broker; anywhere else a producer's, which needs only ``REDIS_URL``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import dramatiq
import redis
from dramatiq import Middleware
from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    CurrentMessage,
    Retries,
    TimeLimit,
)

from . import layout, redisclient, timing
from .middleware import MessageSize, Pipelines, StoredResults, Tracing, UniqueJobs
from .middleware.groups import GroupCompletion
from .outage import Outage
from .pools import redis_connections
from .redisbroker import SettlingRedisBroker
from .resultstore import CappedResults
from .service import Service, use
from .settings import RedisSettings, WorkerSettings, load_redis_settings, load_settings

#: A service's middleware stack: the settings and the broker's Redis client in, the
#: middleware out, in order (:func:`.middleware.default_stack`).
Stack = Callable[[WorkerSettings, redis.Redis], list[Middleware]]

#: The variable that tells a worker process (it runs a pool) from a producer.
POOL_ENV = "WORKER_POOL"


def _redis_broker(
    redis_url: str,
    middleware: Callable[[redis.Redis], list[Middleware]],
    max_connections: int | None = None,
    state_dir: Path | None = None,
    **options: Any,
) -> SettlingRedisBroker:
    """A broker on ``redis_url`` with our key namespace and Dramatiq's maintenance off, and the
    ``middleware`` made for its client; the client's pool makes up to ``max_connections``
    (None: redis-py's default); a worker's notices an unresolved broker reset in
    ``state_dir`` (None: a producer's, which does not)."""
    client = redisclient.connect(
        redis_url,
        socket_timeout=timing.REDIS_SOCKET_TIMEOUT_S,
        socket_connect_timeout=timing.REDIS_SOCKET_TIMEOUT_S / 2,
        health_check_interval=30,
        max_connections=max_connections,
    )
    return SettlingRedisBroker(
        client=client,
        namespace=layout.NAMESPACE,
        middleware=middleware(client),
        maintenance_chance=0,
        state_dir=state_dir,
        outage=Outage(redis_url),
        **options,
    )


def build_broker(settings: WorkerSettings, stack: Stack) -> SettlingRedisBroker:
    """A RedisBroker for ``REDIS_URL`` (``redis://``, ``rediss://`` for TLS, ``unix://``,
    ``redis+sentinel://``: :mod:`.redisclient`), its client's pool sized for the process's
    queues and threads (:func:`.pools.redis_connections`).

    Its consumers dead-letter malformed messages and store each delivery's outcome with
    its ack (:mod:`.consumer`). Dramatiq's random maintenance is off
    (``maintenance_chance=0``): the Recovery middleware recovers lost messages
    deterministically and counts them.
    """
    return _redis_broker(
        settings.redis_url.get_secret_value(),
        lambda client: stack(settings, client),
        max_connections=redis_connections(len(settings.worker_queues), settings.worker_concurrency),
        state_dir=settings.worker_state_dir,
        heartbeat_timeout=settings.worker_heartbeat_timeout_ms,
        max_message_bytes=settings.max_message_bytes,
        gates=settings.gates,
        lease_ms=settings.admission_lease_ms,
        priority_bound=settings.worker_priority_bound,
    )


def producer_middleware(max_message_bytes: int, client: redis.Redis) -> list[Middleware]:
    """The middleware of a producer's broker: the Dramatiq classes of the worker's stack,
    so every actor option the worker accepts (``max_retries``, ``time_limit``, ...) is
    declared; none of the worker's middleware acts when a message is enqueued, except
    Tracing, which puts the trace context in the message (when ``OTEL_*`` turns it on), and
    MessageSize, last, which refuses a message over ``max_message_bytes``. StoredResults (on
    ``client``) lets ``message.get_result()`` read a stored result; GroupCompletion lets
    ``group(...).run()`` create a group's barrier; UniqueJobs declares the ``unique`` actor
    option (the broker takes a unique job's lock with its enqueue)."""
    return [
        Tracing(),
        AgeLimit(),
        TimeLimit(),
        Callbacks(),
        Pipelines(),
        StoredResults(backend=CappedResults(client)),
        GroupCompletion(client),
        Retries(),
        CurrentMessage(),
        UniqueJobs(),
        MessageSize(max_message_bytes),
    ]


def build_producer_broker(settings: RedisSettings) -> SettlingRedisBroker:
    """A broker that only enqueues, for ``REDIS_URL``: no worker setting is read."""
    return _redis_broker(
        settings.redis_url.get_secret_value(),
        lambda client: producer_middleware(settings.max_message_bytes, client),
    )


def broker_for(service: Service, stack: Stack) -> SettlingRedisBroker:
    """The service's broker, made Dramatiq's global broker (``@dramatiq.actor`` declares on
    it). In a process that runs a pool (``WORKER_POOL`` set) it is the worker's, built from the
    service's validated settings (exit 78 when they are bad) with the middleware
    ``stack(settings, client)`` (:func:`.middleware.default_stack` and the service's own).
    Anywhere else, e.g. an API process that enqueues jobs, it is a producer's broker that needs
    only ``REDIS_URL`` (see :mod:`.producer`)."""
    use(service)
    if os.environ.get(POOL_ENV):
        broker = build_broker(load_settings(), stack)
    else:
        broker = build_producer_broker(load_redis_settings())
    dramatiq.set_broker(broker)
    return broker


M = TypeVar("M", bound=Middleware)


def middleware_of(broker: dramatiq.Broker, kind: type[M]) -> M:
    """The instance of middleware ``kind`` in ``broker``'s stack."""
    return next(m for m in broker.middleware if isinstance(m, kind))
