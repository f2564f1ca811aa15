"""Tracing: one trace per job, from the process that enqueued it through every delivery.

Producer side (any process that enqueues, an API included): ``before_enqueue`` starts a
``send <queue>`` span (kind PRODUCER, a child of whatever span is current) and injects
its W3C trace context into the message's options (``options["trace_context"]``, with
the propagators of ``OTEL_PROPAGATORS``). A message that already carries a context
keeps it: a retry's delayed copy, its move from the delay queue, a recovered or
requeued message and a dead-letter replay all stay in the trace of the first enqueue.

Worker side: each delivery is a ``process <queue>`` span (kind CONSUMER), a child of
the message's context (and linked to it, as the messaging conventions ask), current
in the worker thread from the first middleware hook until the delivery is settled
(acked, retried or dead-lettered), so Redis commands and SQL queries are its children
and the job's log lines carry its ``trace_id`` and ``span_id``. The settlement's own
Lua call is not one of them: it goes on the handler thread's own connection
(:class:`..lanes.SettleLanes`), past the Redis instrumentation, and the span's
``dramatiq.outcome`` records what it stored. Attributes:

``messaging.system``              ``dramatiq``
``messaging.destination.name``    the queue (a delay queue ``q.DQ`` counts as ``q``)
``messaging.message.id``          Dramatiq's message id (the same on every delivery)
``messaging.operation.type``      ``process`` (``send`` on the producer span); also
                                  ``messaging.operation``, its former name
``dramatiq.actor``                the actor
``dramatiq.attempt``              this delivery's number: 1, then 2 after a retry or a crash
``dramatiq.outcome``              ``success``, ``retry``, ``failure``, ``dead_letter``,
                                  ``requeued`` or ``skipped``, as in ``jobs_processed_total``
``dramatiq.dead_letter_reason``   why it went to the dead letters, when it did

A delivery lost with its worker process gets its span from recovery instead
(:func:`..telemetry.record_lost_delivery`, outcome ``crash``). The attributes and the
context option are :mod:`..telemetry`'s (:func:`..telemetry.delivery_attributes`).

With tracing off (no ``OTEL_*`` destination, see :mod:`..telemetry`) every hook returns
at once. Place it first in the stack: its ``before_*`` hooks then run first and its
``after_*`` hooks last, once CrashAwareRetries and the shutdown middleware decided the outcome.

Parameters:
  tracer_provider: the provider to use (default: :func:`..telemetry.tracer_provider`,
    the process's, configured from the environment; None there means off).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from opentelemetry import context, propagate, trace

from ..layout import DEAD_LETTER_REASON, canonical, deliveries
from ..service import runtime_version
from ..settlement import job_outcome, skip_outcome
from ..telemetry import CONTEXT_OPTION, delivery_attributes, message_context
from ..telemetry import tracer_provider as configured_provider

if TYPE_CHECKING:
    from dramatiq import Message


class Tracing(Middleware):
    __doc__ = __doc__

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        provider = configured_provider() if tracer_provider is None else tracer_provider
        self.tracer = (
            None
            if provider is None
            else provider.get_tracer(__name__.rpartition(".")[0], runtime_version())
        )
        self._local = threading.local()

    # -- producer ------------------------------------------------------------------------------

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        if self.tracer is None or CONTEXT_OPTION in message.options:
            return
        self._end_pending("the enqueue did not complete")
        span = self.tracer.start_span(
            f"send {canonical(message.queue_name)}",
            kind=trace.SpanKind.PRODUCER,
            attributes=delivery_attributes(message, message.queue_name, "send"),
        )
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        message.options[CONTEXT_OPTION] = carrier
        self._local.pending = span

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        span: trace.Span | None = getattr(self._local, "pending", None)
        if span is not None:
            self._local.pending = None
            span.end()

    def _end_pending(self, problem: str) -> None:
        """End the span of an earlier enqueue of this thread that raised before its end."""
        span: trace.Span | None = getattr(self._local, "pending", None)
        if span is not None:
            self._local.pending = None
            span.set_status(trace.StatusCode.ERROR, problem)
            span.end()

    # -- consumer ------------------------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        if self.tracer is None:
            return
        self._end_delivery()  # one whose settlement never completed (it raised)
        parent = message_context(message._message)
        producer = trace.get_current_span(parent).get_span_context()
        attributes = delivery_attributes(message._message, message.queue_name)
        attributes["dramatiq.attempt"] = deliveries(message.options) + 1
        span = self.tracer.start_span(
            f"process {attributes['messaging.destination.name']}",
            context=parent,
            kind=trace.SpanKind.CONSUMER,
            attributes=attributes,
            links=[trace.Link(producer)] if producer.is_valid else None,
        )
        token = context.attach(trace.set_span_in_context(span))
        self._local.delivery = (span, token)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        if self.tracer is not None:
            self._decide(message, job_outcome(broker, message, exception), exception)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        if self.tracer is not None:
            self._decide(message, skip_outcome(message), None)

    def _decide(self, message: MessageProxy, outcome: str, exception: BaseException | None) -> None:
        """Record the outcome; the span stays current until the delivery is settled."""
        delivery: tuple[trace.Span, object] | None = getattr(self._local, "delivery", None)
        if delivery is None:
            return
        span = delivery[0]
        span.set_attribute("dramatiq.outcome", outcome)
        reason = message.options.get(DEAD_LETTER_REASON)
        if reason:
            span.set_attribute("dramatiq.dead_letter_reason", str(reason))
        if exception is not None and outcome != "requeued":
            span.record_exception(exception)
        if outcome in {"retry", "failure", "dead_letter"}:
            problem = reason or (
                f"{type(exception).__name__}: {exception}" if exception else outcome
            )
            span.set_status(trace.StatusCode.ERROR, str(problem)[:500])

    # The worker thread settles the delivery (ack or nack: the retry copy, the dead letter)
    # right after the handler; the span ends then, so the settlement's Redis call and the
    # job's ``job_end`` log line (logged once the outcome is stored) belong to it.

    def after_ack(self, broker: Broker, message: MessageProxy) -> None:
        if self.tracer is not None:
            self._end_delivery()

    after_nack = after_ack

    def _end_delivery(self) -> None:
        delivery: tuple[trace.Span, object] | None = getattr(self._local, "delivery", None)
        if delivery is None:
            return
        self._local.delivery = None
        span, token = delivery
        context.detach(token)  # type: ignore[arg-type]
        span.end()
