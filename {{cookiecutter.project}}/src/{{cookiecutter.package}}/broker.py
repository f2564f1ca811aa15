"""The broker: a RedisBroker built from settings, with the whole middleware stack in one place.

Importing this module validates the configuration (exit 78 when it is bad) and
makes ``broker`` Dramatiq's global broker, so ``@dramatiq.actor`` declares on it.
"""

from __future__ import annotations

from typing import TypeVar

import dramatiq
import redis
from dramatiq import Middleware
from dramatiq.middleware import AgeLimit, Callbacks, CurrentMessage, Pipelines, TimeLimit

from . import layout
from .consumer import SettlingRedisBroker
from .middleware import (
    Attempts,
    CrashAwareRetries,
    GracefulShutdown,
    Metrics,
    Progress,
    Recovery,
)
{%- if cookiecutter.database == "postgres" %}
from .middleware.database import DatabasePool
{%- endif %}
from .middleware.schedule_lock import ScheduleLock
from .settings import Settings, load_settings


def middleware_stack(settings: Settings) -> list[Middleware]:
    """Every middleware, in order. ``before_*`` hooks run top-down, ``after_*`` bottom-up,
    so Attempts refuses an exhausted message before anything starts (ScheduleLock, next, skips
    a scheduled run whose previous run still runs), and Metrics sees the
    final outcome that CrashAwareRetries and GracefulShutdown decided."""
    stack: list[Middleware] = [
        Attempts(settings.worker_max_attempts),
        ScheduleLock(),
        Metrics(settings.worker_concurrency),
        Progress(),
        GracefulShutdown(),
        AgeLimit(),
        TimeLimit(time_limit=settings.worker_job_timeout_ms, interval=100),
        Callbacks(),
        Pipelines(),
        CrashAwareRetries(max_retries=settings.worker_max_attempts - 1),
        CurrentMessage(),
        Recovery(
            settings.worker_queues,
            settings.worker_heartbeat_timeout_ms,
            settings.worker_max_attempts,
            dead_message_ttl_ms=settings.dlq_retention_days * 86_400_000,
        ),
    ]
{%- if cookiecutter.database == "postgres" %}
    if settings.uses_database:
        stack.append(DatabasePool(settings))
{%- endif %}
    return stack


def build_broker(settings: Settings) -> SettlingRedisBroker:
    """A RedisBroker for ``REDIS_URL`` (``redis://``, ``rediss://`` for TLS, ``unix://``).

    Its consumers dead-letter malformed messages and store each delivery's outcome with
    its ack (:mod:`.consumer`). Dramatiq's random maintenance is off
    (``maintenance_chance=0``): the Recovery middleware recovers lost messages
    deterministically and counts them.
    """
    client = redis.Redis.from_url(
        settings.redis_url.get_secret_value(),
        socket_timeout=10,
        socket_connect_timeout=5,
        health_check_interval=30,
    )
    return SettlingRedisBroker(
        client=client,
        namespace=layout.NAMESPACE,
        middleware=middleware_stack(settings),
        heartbeat_timeout=settings.worker_heartbeat_timeout_ms,
        maintenance_chance=0,
    )


settings = load_settings()
broker = build_broker(settings)
dramatiq.set_broker(broker)


M = TypeVar("M", bound=Middleware)


def middleware_of(kind: type[M]) -> M:
    """The instance of middleware ``kind`` in the broker's stack."""
    return next(m for m in broker.middleware if isinstance(m, kind))
