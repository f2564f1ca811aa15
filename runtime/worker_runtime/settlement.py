"""How a delivery ends: the settlement, its outcome, its reason. The one owner of these rules.

Every delivery the worker runs ends with one :class:`Settlement`, stored by the consumer
(:mod:`.consumer`) in one Lua call with the ack: done, a retry copy on the delay queue,
back to its queue, or to the dead letters. The middleware decide it and never store
anything themselves: they ask with :func:`settle_with` (or :func:`dead_letter_delivery`),
and the consumer ends the delivery with :func:`ending`. While Redis does not answer, the
settlement is retried and the message stays held, so an outcome is never lost between a
hook and the ack.

The outcome of a delivery (``jobs_processed_total{outcome}``, the span's
``dramatiq.outcome``) is decided here too, once for every middleware that reports it
(:func:`job_outcome`, :func:`skip_outcome`), with the reasons a dead letter or a skip
carries (:data:`TIME_LIMIT_REASON`, :data:`SKIPPED_OPTION`).

A message that is refused before any handler sees it (a malformed body) is signalled by
the broker as the ``reject_message`` hook (:data:`REJECT_SIGNAL`): a middleware that
counts it defines ``after_reject_message(broker, queue, actor, *, reason)``.

This module imports no middleware and no broker: the middleware, the consumer and the
tests' stub brokers import it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Final, Literal

from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy
from dramatiq.middleware.time_limit import TimeLimitExceeded

from . import contract
from .layout import DEAD_LETTER_REASON
from .lifecycle import Cancelled, Requeue

#: What a delivery that ended is counted as (``jobs_processed_total{outcome}``):
#:
#: ``success``      the handler returned.
#: ``retry``        the handler raised; a delayed copy will run again.
#: ``failure``      the handler raised an exception listed in the actor's ``throws``, or
#:                  returned a result that cannot be stored (not JSON); dead-lettered.
#: ``dead_letter``  its retries are used up, or it was refused before running.
#: ``requeued``     stopped by a shutdown (``lifecycle.Requeue``); back in its queue.
#: ``skipped``      a scheduled run not started (the previous run holds the run lock).
#: ``cancelled``    cancelled by ``producer.cancel``: skipped, or interrupted while running.
OUTCOMES: Final = contract.OUTCOMES

#: Marks a message ScheduleLock skipped (its outcome is ``skipped``, not ``dead_letter``).
SKIPPED_OPTION: Final = "skipped_overlap"

#: Marks a message skipped because it was cancelled (its outcome is ``cancelled``).
CANCELLED_OPTION: Final = "cancelled"

#: The dead-letter reason of a job that used up its attempts running past its time limit.
TIME_LIMIT_REASON: Final = (
    "time limit: the job ran past WORKER_JOB_TIMEOUT_MS (or its actor's lower time_limit) "
    "and was interrupted on each attempt"
)

#: The ``actor`` label of a malformed message whose actor is not declared here (bounded).
UNKNOWN_ACTOR: Final = "unknown"

#: The broker's signal for a reset it saw (Redis lost its data, :mod:`.brokerstate`): it calls
#: ``after_broker_reset(broker, cause)`` of the middleware that define it.
RESET_SIGNAL: Final = "broker_reset"

#: The broker's signal for a message refused before any handler saw it: it calls
#: ``after_reject_message(broker, queue, actor, reason=...)`` of the middleware that
#: define it (``queue`` canonical, ``actor`` a declared actor or :data:`UNKNOWN_ACTOR`).
REJECT_SIGNAL: Final = "reject_message"
#: The broker's signal for a fetch that left messages queued for want of a downstream slot
#: or token (``after_throttle(broker, queue, reason, count)``; :mod:`.layout.flow`).
THROTTLE_SIGNAL: Final = "throttle"
#: The broker's signal for a message a fetch admitted from a queue under flow control (gated
#: by a downstream, or with a per-key limit or rate): ``after_admission(broker, queue,
#: waited_s)``, the seconds since it was due (sent, or its eta).
ADMISSION_SIGNAL: Final = "admission"


@dataclasses.dataclass(frozen=True)
class Settlement:
    """How a delivery ends, stored atomically with its ack.

    Parameters:
      kind: ``ack`` (done), ``retry`` (store ``body`` as ``target_id`` on
        ``target_queue``, the delay queue), ``requeue`` (back to the tail of its
        queue) or ``dead_letter`` (``body``, or the stored body when empty).
      body: the body to store (retry, dead letter).
      target_queue: the queue of the retry copy.
      target_id: the Redis id of the retry copy.
      sent: the retry copy, for the ``after_enqueue`` hooks once it is stored.
      delay: the retry's delay in ms, for the same hooks.
    """

    kind: Literal["ack", "retry", "requeue", "dead_letter"]
    body: bytes = b""
    target_queue: str = ""
    target_id: str = ""
    sent: Message[Any] | None = None
    delay: int | None = None


ACK = Settlement("ack")
REQUEUE = Settlement("requeue")
#: The attributes :func:`settle_with` and :func:`mark_lost` set on a delivery (unset: None).
SETTLEMENT_MARK: Final = "_settlement"
LOST_MARK: Final = "_lost"


def mark_lost(message: MessageProxy, reason: str) -> None:
    """The settlement of ``message`` found it no longer held: nothing was stored; ``reason``
    says why (a broker reset, another worker recovered it). Counted in
    ``jobs_lost_total{queue}``, never as its outcome."""
    setattr(message, LOST_MARK, reason)


def lost_reason(message: MessageProxy) -> str | None:
    """Why ``message``'s settlement found it no longer held; None when it was stored."""
    found: str | None = getattr(message, LOST_MARK, None)
    return found


def settle_with(message: MessageProxy, settlement: Settlement) -> None:
    """Make ``settlement`` the end of ``message``'s delivery (stored when it is acked)."""
    setattr(message, SETTLEMENT_MARK, settlement)


def settlement_of(message: MessageProxy) -> Settlement | None:
    """The settlement middleware asked for, if any."""
    found: Settlement | None = getattr(message, SETTLEMENT_MARK, None)
    return found


def ending(message: MessageProxy, *, failed: bool) -> Settlement:
    """The settlement that ends ``message``'s delivery: the one middleware asked for, else an
    ack (a dead letter when ``failed``: Dramatiq nacks it)."""
    return settlement_of(message) or (Settlement("dead_letter") if failed else ACK)


def dead_letter_delivery(broker: Broker, message: MessageProxy, reason: str) -> bool:
    """End the delivery of ``message`` (held by this worker) in the dead letters, its body
    carrying ``options["dead_letter_reason"]``: the settlement stored with its nack (so it
    is not lost while Redis is down). Always True (the consumer stores it)."""
    message.options[DEAD_LETTER_REASON] = reason  # for the middleware that report it
    message.fail()
    body = message._message.copy(options={DEAD_LETTER_REASON: reason}).encode()
    settle_with(message, Settlement("dead_letter", body))
    return True


class SettlingBroker:
    """A broker whose consumers end each delivery with one :class:`Settlement`, stored with
    its ack (:meth:`settle`, called from the consumer's ``ack`` and ``nack``). The worker's
    :class:`.redisbroker.SettlingRedisBroker` is one; the middleware's unit tests settle on a
    StubBroker that records the settlements."""

    def settle(self, queue: str, redis_id: str, settlement: Settlement) -> bool:
        """Store ``settlement`` of the delivery ``redis_id`` held on ``queue``; False when
        this worker no longer held it (someone else recovered it)."""
        raise NotImplementedError

    def reclaim_orphans(self, now: float) -> int:
        """Requeue what this worker holds in Redis but lost in memory; return how many
        (``now``: ``time.monotonic()``). None here: this broker holds nothing in Redis."""
        held: tuple[str, ...] = ()
        return len(held)

    def still_holds(self, deliveries: list[tuple[str, str]]) -> list[bool]:
        """For each (queue, redis id) of ``deliveries``: does this worker still hold it in
        Redis? Always here: this broker holds nothing in Redis."""
        return [True for _ in deliveries]

    def keep_time(self, redis_ms: int) -> None:
        """Redis's clock (``TIME``, ms) as a heartbeat just read it; ignored here."""

    def redis_millis(self) -> int:
        """Redis's clock now, ms since the epoch (the one clock of every worker: a retry's
        ``eta`` is judged by it); this host's clock here."""
        return int(time.time() * 1000)

    def observe_epochs(self, epochs: dict[str, Any]) -> None:
        """Each namespace's epoch token as a heartbeat just read it (:mod:`.brokerstate`);
        ignored here."""


def job_outcome(broker: Broker, message: MessageProxy, exception: BaseException | None) -> str:
    """The outcome of a delivery that ran, as CrashAwareRetries and GracefulShutdown decided
    (and StoredResults, which fails a job whose result is not JSON)."""
    if exception is None:
        return contract.FAILURE if message.failed else contract.SUCCESS
    if isinstance(exception, Requeue):
        return contract.REQUEUED
    if isinstance(exception, Cancelled):
        return contract.CANCELLED
    if not message.failed:
        return contract.RETRY
    actor = broker.get_actor(message.actor_name)
    throws = message.options.get("throws") or actor.options.get("throws")
    if throws and isinstance(exception, throws):
        return contract.FAILURE
    return contract.DEAD_LETTER


def skip_outcome(message: MessageProxy) -> str:
    """The outcome of a delivery refused before its handler ran."""
    if message.options.get(CANCELLED_OPTION):
        return contract.CANCELLED
    return contract.SKIPPED if message.options.get(SKIPPED_OPTION) else contract.DEAD_LETTER


def failure_reason(exception: BaseException) -> str:
    """The dead-letter reason of a delivery whose last attempt raised ``exception``:
    :data:`TIME_LIMIT_REASON` when the time limit interrupted it, else the exception (500
    characters at most)."""
    if isinstance(exception, TimeLimitExceeded):
        return TIME_LIMIT_REASON
    return f"{type(exception).__name__}: {exception}"[:500]
