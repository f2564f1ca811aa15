"""CrashAwareRetries: Dramatiq's retries with backoff, made shutdown- and crash-aware, and safe
while Redis is down: the retry copy is stored together with the ack, never before or without it."""

from __future__ import annotations

import uuid
from typing import Any, cast

import dramatiq.middleware
from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy
from dramatiq.common import dq_name

from ..layout import REDIS_MESSAGE_ID, crashes
from ..lifecycle import Cancelled, Requeue
from ..settlement import (
    Settlement,
    SettlingBroker,
    dead_letter_delivery,
    failure_reason,
    settle_with,
)


class _Capture:
    """Stands in for the broker in Dramatiq's Retries hook: keeps the retry copy it sends."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.sent: tuple[Message[Any], int | None] | None = None

    def get_actor(self, actor_name: str) -> Any:
        return self.broker.get_actor(actor_name)

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        self.sent = (message, delay)
        return message


class CrashAwareRetries(dramatiq.middleware.Retries):
    """Dramatiq's :class:`~dramatiq.middleware.Retries`, with four changes.

    * A :class:`~..lifecycle.Requeue` (shutdown) is not a failure: no retry is
      counted and no delayed copy is enqueued; the shutdown middleware requeues it. Nor is
      a :class:`~..lifecycle.Cancelled` (``producer.cancel``): its message is acked.
    * Deliveries lost to crashes (``options["crashes"]``) use up the same budget,
      so ``max_retries + 1`` is the total number of deliveries.
    * An exhausted message is dead-lettered with the exception as its reason
      (:data:`~..settlement.TIME_LIMIT_REASON` when the time limit interrupted it).
    * The retry copy is not enqueued from this hook (where Dramatiq swallows a Redis
      error and then acks the original: the retry was lost). It becomes the
      delivery's settlement (:mod:`..settlement`), stored in one Lua call with the ack;
      while Redis is down the message stays held and the settlement is retried. Its
      ``eta`` is on Redis's clock (the broker's ``redis_millis``), as the consumer of the
      delay queue judges it: a worker whose clock is off neither delays nor hastens it.

    Parameters:
      max_retries: ``WORKER_MAX_ATTEMPTS - 1``; an actor's own ``max_retries`` may lower it.
      min_backoff, max_backoff: as in Dramatiq (default 15 s and 7 days).
    """

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        if exception is None or isinstance(exception, (Requeue, Cancelled)):
            return
        actor = broker.get_actor(message.actor_name)
        budget = min(actor.options.get("max_retries", self.max_retries), self.max_retries)
        message.options["max_retries"] = max(0, budget - crashes(message.options))
        capture = _Capture(broker)
        super().after_process_message(capture, message, result=result, exception=exception)  # type: ignore[no-untyped-call]
        if capture.sent is not None:
            settle_with(message, self._retry(broker, *capture.sent))
        if message.failed:
            dead_letter_delivery(broker, message, failure_reason(exception))

    @staticmethod
    def _retry(broker: Broker, message: Message[Any], delay: int | None) -> Settlement:
        """The retry copy as Dramatiq's ``RedisBroker.enqueue`` would build it."""
        queue = message.queue_name
        options: dict[str, Any] = {REDIS_MESSAGE_ID: str(uuid.uuid4())}
        if delay is not None:
            queue = dq_name(queue)
            # Redis's clock, not this host's: the worker that runs it judges it by the same.
            options["eta"] = cast(SettlingBroker, broker).redis_millis() + delay
        copy = message.copy(queue_name=queue, options=options)
        broker.emit_before("enqueue", copy, delay)
        return Settlement(
            "retry",
            copy.encode(),
            target_queue=queue,
            target_id=options[REDIS_MESSAGE_ID],
            sent=copy,
            delay=delay,
        )
