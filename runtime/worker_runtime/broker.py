"""The broker: a RedisBroker built from settings, with the whole middleware stack in one place.

Importing this module makes ``broker`` Dramatiq's global broker, so
``@dramatiq.actor`` declares on it. In a process that runs a pool (``WORKER_POOL``
set) it is the worker's broker, built from the validated settings (exit 78 when
they are bad). Anywhere else, e.g. an API process that enqueues jobs, it is a
producer's broker that needs only ``REDIS_URL`` (see :mod:`.producer`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import dramatiq
import redis
from dramatiq import Middleware
from dramatiq.middleware import (
    AgeLimit,
    AsyncIO,
    Callbacks,
    CurrentMessage,
    Retries,
    TimeLimit,
)

from . import layout, redisclient
from .consumer import SettlingRedisBroker
from .middleware import (
    ArgumentModels,
    Attempts,
    Cancellation,
    CappedTimeLimit,
    ClockedAgeLimit,
    CrashAwareRetries,
    GracefulShutdown,
    HeldCheck,
    MessageSize,
    Metrics,
    Pipelines,
    Progress,
    Recovery,
    StoredResults,
    Tracing,
)
{%- if cookiecutter.database == "postgres" %}
from .middleware.database import DatabasePool
{%- endif %}
from .middleware.groups import GroupCompletion
from .middleware.schedule_lock import ScheduleLock
from .outage import Outage
from .pools import redis_connections
from .resultstore import CappedResults
from .settings import RedisSettings, Settings, load_redis_settings, load_settings

#: The variable that tells a worker process (it runs a pool) from a producer.
POOL_ENV = "WORKER_POOL"


def middleware_stack(settings: Settings, client: redis.Redis) -> list[Middleware]:
    """Every middleware, in order. ``before_*`` hooks run top-down, ``after_*`` bottom-up,
    so Attempts refuses an exhausted message before anything starts (ArgumentModels, next,
    dead-letters a typed actor's message whose arguments do not fit; ScheduleLock skips
    a scheduled run whose previous run still runs), Metrics sees the final outcome that
    CrashAwareRetries and GracefulShutdown decided, and CappedTimeLimit times the handler
    alone (its watchdog is disarmed first, before any ``after_*`` hook of the others runs);
    Tracing, first, holds the delivery's span around all of them (off unless ``OTEL_*``
    names a destination); HeldCheck, next, skips a message this process no longer holds
    (it froze past its heartbeat and another worker recovered it) before any other starts;
    MessageSize, last, measures a message a handler sends as the others left it.
    StoredResults, GroupCompletion and AsyncIO (Dramatiq's job API: stored results, group
    completion callbacks, ``async def`` actors) act only for the actors and messages that
    use them; StoredResults and GroupCompletion sit above CrashAwareRetries,
    so they see a delivery's end as it decided (``client``: the broker's Redis, where results
    and group barriers live). Cancellation, last of the per-job middleware, checks a message
    right before its handler and forgets it first when the handler ends, so a cancel
    interrupts the handler, not another middleware's hook."""
    stack: list[Middleware] = [
        Tracing(),
        HeldCheck(),
        Attempts(settings.worker_max_attempts),
        ArgumentModels(),
        ScheduleLock(),
        Metrics(settings.worker_concurrency, queues=settings.worker_queues),
        Progress(),
        GracefulShutdown(),
        ClockedAgeLimit(),
        Callbacks(),
        Pipelines(),
        StoredResults(
            backend=CappedResults(client, settings.result_max_bytes),
            result_ttl=settings.result_ttl_ms,
        ),
        GroupCompletion(client),
        AsyncIO(),
        CrashAwareRetries(max_retries=settings.worker_max_attempts - 1),
        CurrentMessage(),
        CappedTimeLimit(time_limit=settings.worker_job_timeout_ms),
        Cancellation(client, settings.worker_queues),
        Recovery(
            settings.worker_queues,
            settings.worker_heartbeat_timeout_ms,
            settings.worker_max_attempts,
            dead_message_ttl_ms=settings.dlq_retention_days * 86_400_000,
            pool=settings.worker_pool,
            concurrency=settings.worker_concurrency,
        ),
    ]
{%- if cookiecutter.database == "postgres" %}
    if settings.uses_database:
        stack.append(DatabasePool(settings))
{%- endif %}
    stack.append(MessageSize(settings.max_message_bytes))
    return stack


def _redis_broker(
    redis_url: str,
    middleware: Callable[[redis.Redis], list[Middleware]],
    max_connections: int | None = None,
    state_dir: Path | None = None,
    **options: int,
) -> SettlingRedisBroker:
    """A broker on ``redis_url`` with our key namespace and Dramatiq's maintenance off, and the
    ``middleware`` made for its client; the client's pool makes up to ``max_connections``
    (None: redis-py's default); a worker's notices an unresolved broker reset in
    ``state_dir`` (None: a producer's, which does not)."""
    client = redisclient.connect(
        redis_url,
        socket_timeout=10,
        socket_connect_timeout=5,
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


def build_broker(settings: Settings) -> SettlingRedisBroker:
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
        lambda client: middleware_stack(settings, client),
        max_connections=redis_connections(len(settings.worker_queues), settings.worker_concurrency),
        state_dir=settings.worker_state_dir,
        heartbeat_timeout=settings.worker_heartbeat_timeout_ms,
        max_message_bytes=settings.max_message_bytes,
    )


def producer_middleware(max_message_bytes: int, client: redis.Redis) -> list[Middleware]:
    """The middleware of a producer's broker: the Dramatiq classes of the worker's stack,
    so every actor option the worker accepts (``max_retries``, ``time_limit``, ...) is
    declared; none of the worker's middleware acts when a message is enqueued, except
    Tracing, which puts the trace context in the message (when ``OTEL_*`` turns it on), and
    MessageSize, last, which refuses a message over ``max_message_bytes``. StoredResults (on
    ``client``) lets ``message.get_result()`` read a stored result; GroupCompletion lets
    ``group(...).run()`` create a group's barrier."""
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
        MessageSize(max_message_bytes),
    ]


def build_producer_broker(settings: RedisSettings) -> SettlingRedisBroker:
    """A broker that only enqueues, for ``REDIS_URL``: no worker setting is read."""
    return _redis_broker(
        settings.redis_url.get_secret_value(),
        lambda client: producer_middleware(settings.max_message_bytes, client),
    )


def _build() -> SettlingRedisBroker:
    if os.environ.get(POOL_ENV):
        return build_broker(load_settings())
    return build_producer_broker(load_redis_settings())


broker = _build()
dramatiq.set_broker(broker)


M = TypeVar("M", bound=Middleware)


def middleware_of(kind: type[M]) -> M:
    """The instance of middleware ``kind`` in the broker's stack."""
    return next(m for m in broker.middleware if isinstance(m, kind))
