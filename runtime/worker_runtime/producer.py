"""Enqueue jobs from any process (an API, a script): only ``REDIS_URL`` is needed.

Importing an actor works the same way; neither needs worker settings such as
``WORKER_POOL`` (:mod:`.broker` builds a producer's broker when it is unset)::

    from <package>.actors.notifications import send_notification

    send_notification.send(7, "welcome", "n-1")

or, by actor name, without importing the actor's module yourself::

    from <package>.producer import enqueue

    enqueue("send_notification", 7, "welcome", "n-1")
    enqueue("capture_payment", "pay-1", 1000, delay_ms=60_000)   # in a minute

Cancel a queued or running job with :func:`cancel`::

    from <package>.producer import cancel

    message = enqueue("build_report", "r-1", 10_000_000)
    cancel(message.message_id)    # True: it was queued or running; it will not finish

A bad ``REDIS_URL`` refuses with one line (exit 78); a full Redis (``maxmemory`` reached)
raises :class:`.brokerstate.BrokerFull` (a ``redis.ResponseError``, one line naming the
actor), for the caller to handle.

A Redis that does not answer (down, a lost connection, a timeout) raises
:class:`.brokerstate.EnqueueUncertain` from ``enqueue``/``send`` (a ``redis.ConnectionError``
and a ``redis.TimeoutError``): **the message may have been enqueued** (the command may have
reached Redis, or reach it when the network heals). Retry by resending the same message id
within :data:`.layout.SENT_TTL_MS` (10 minutes): at most one copy is enqueued, so a retry
never runs the job twice::

    from worker_runtime.brokerstate import EnqueueUncertain

    try:
        enqueue("send_notification", 7, "welcome", "n-1", message_id="welcome-7")
    except EnqueueUncertain:
        ...  # later, or at once: the same call again (the same message_id)

``message_id`` is any unique string of yours (an order id, a request id); without it each
call is a new message. With an actor's ``send``, resend the message the error carries:
``broker.enqueue(error.message)``.

Unique jobs (:mod:`.unique`): at most one job per actor and key queued, delayed or running;
an equal send raises :class:`.unique.DuplicateJob` and enqueues nothing::

    from worker_runtime.unique import DuplicateJob, Unique

    try:
        enqueue("build_report", "r-1", 10, unique=Unique(key="report_id", ttl_ms=3_600_000))
    except DuplicateJob:
        ...  # an equal job is queued or running: it covers this request
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dramatiq import Message

from . import layout
from .actors import load

__all__ = ["cancel", "enqueue"]

if TYPE_CHECKING:
    from .unique import Unique


def enqueue(
    actor_name: str,
    *args: Any,
    delay_ms: int | None = None,
    message_id: str | None = None,
    priority: str | None = None,
    unique: Unique | None = None,
    **kwargs: Any,
) -> Message[Any]:
    """Send a message to the actor ``actor_name`` (on its queue); return the message sent.

    Parameters:
      actor_name: an actor of this service, e.g. ``"send_notification"``.
      args, kwargs: the actor's arguments (JSON-serialisable).
      delay_ms: run it no earlier than this many milliseconds from now (default: at once).
      message_id: the message's id (default: a new uuid): a second send of the same id
        within :data:`.layout.SENT_TTL_MS` enqueues nothing, so a retry after
        :class:`.brokerstate.EnqueueUncertain` is safe.
      priority: its lane on the queue, ``"high"``, ``"normal"`` or ``"low"`` (default: the
        actor's ``priority_lane``, else normal): a worker takes the highest lane first, and
        a waiting job is passed over by at most the pool's ``priority_bound`` jobs of
        higher lanes (:mod:`.layout.queuelanes`).
      unique: a :class:`.unique.Unique`: skip (or debounce) while an equal job is queued,
        delayed or running (default: the actor's ``unique`` option, if any).

    Raises:
      dramatiq.errors.ActorNotFound: no actor has that name.
      .layout.PriorityError: ``priority`` is not one of them (nothing is sent).
      .brokerstate.EnqueueUncertain: Redis did not answer; the message may have been enqueued.
      .unique.DuplicateJob: ``unique``: an equal job holds the lock; nothing was enqueued.
      .unique.UniqueError: ``unique`` names a field the actor does not take, or debounces
        without ``delay_ms``.
    """
    broker = load()
    actor = broker.get_actor(actor_name)
    options: dict[str, Any] = {} if priority is None else {layout.PRIORITY_OPTION: priority}
    if unique is not None:
        options["unique"] = unique
    message: Message[Any] = actor.message_with_options(args=args, kwargs=kwargs, **options)
    if message_id is not None:
        message = message.copy(message_id=message_id)
    sent: Message[Any] = broker.enqueue(message, delay=delay_ms)
    return sent


def cancel(message_id: str) -> bool:
    """Cancel the job ``message_id`` (``message.message_id`` of what ``send`` returned):
    queued or delayed, it is skipped when a worker takes it; running, it is interrupted at
    once (a handler blocked in one C call, when the call returns). Either way its message
    is acked and counted ``jobs_processed_total{outcome="cancelled"}``, never as a failure,
    and it is not retried. The cancellation holds for :data:`.layout.CANCEL_TTL_MS` (7 days).

    Returns True when the message was found queued, delayed or running (False: it had
    ended, or never existed; it is cancelled all the same should it appear). One round
    trip, whatever is queued: the message is found by its id in the message index
    (:func:`.layout.message_index_key`), the sandbox's queue's too (a replayed dead letter
    is indexed by its replay). A message this service did not enqueue (raw Redis, bare
    Dramatiq) is not in the index: cancelled all the same, reported False.
    """
    client = load().client  # type: ignore[attr-defined]  # the service's SettlingRedisBroker
    return layout.record_cancel(client, message_id)
