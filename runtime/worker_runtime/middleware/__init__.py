"""The runtime's Dramatiq middleware, one per module, and :func:`default_stack`: the whole
stack in order, which a service's ``broker.py`` hands to :func:`worker_runtime.broker.broker_for`
(appending its own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis
from dramatiq import Middleware
from dramatiq.middleware import AsyncIO, Callbacks, CurrentMessage

from ..resultstore import CappedResults
from .age_limit import ClockedAgeLimit
from .arguments import ArgumentModels
from .attempts import Attempts
from .cancellation import Cancellation
from .groups import GroupCompletion
from .holds import HeldCheck
from .message_size import MessageSize, MessageTooLargeError
from .metrics import Metrics
from .pipelines import Pipelines
from .progress import ProgressRecorder
from .recovery import Recovery
from .results import StoredResults
from .retries import CrashAwareRetries
from .schedule_lock import ScheduleLock
from .shutdown import GracefulShutdown
from .time_limit import CappedTimeLimit
from .tracing import Tracing
from .unique import UniqueJobs

if TYPE_CHECKING:
    from ..settings import WorkerSettings

__all__ = [
    "ArgumentModels",
    "Attempts",
    "Cancellation",
    "CappedTimeLimit",
    "ClockedAgeLimit",
    "CrashAwareRetries",
    "GracefulShutdown",
    "HeldCheck",
    "MessageSize",
    "MessageTooLargeError",
    "Metrics",
    "Pipelines",
    "ProgressRecorder",
    "Recovery",
    "StoredResults",
    "Tracing",
    "UniqueJobs",
    "default_stack",
]


def default_stack(settings: WorkerSettings, client: redis.Redis) -> list[Middleware]:
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
        UniqueJobs(),
        ScheduleLock(),
        Metrics(settings.worker_concurrency, queues=settings.worker_queues),
        ProgressRecorder(),
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
            prefetch=settings.prefetch,
        ),
    ]
    if settings.uses_database:  # the postgres extra's
        from .database import DatabasePool

        stack.append(DatabasePool(settings))
    stack.append(MessageSize(settings.max_message_bytes))
    return stack
