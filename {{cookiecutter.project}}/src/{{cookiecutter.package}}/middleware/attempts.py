"""Attempts: a delivery over the attempt budget is dead-lettered without running."""

from __future__ import annotations

from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage

from ..recovery import dead_letter, deliveries


class Attempts(Middleware):
    """Refuses to run a message that has already used ``max_attempts`` deliveries.

    Deliveries are failed attempts (``options["retries"]``, kept by Retries) plus
    crashes of the worker process (``options["crashes"]``, kept by recovery), so a
    poison message that kills its process cannot loop forever.

    Parameters:
      max_attempts: ``WORKER_MAX_ATTEMPTS``.
    """

    def __init__(self, max_attempts: int) -> None:
        self.max_attempts = max_attempts

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        used = deliveries(message._message)
        if used < self.max_attempts:
            return
        reason = f"{used} deliveries used up WORKER_MAX_ATTEMPTS={self.max_attempts}"
        dead_letter(broker.client, broker.broker_id, message.queue_name, message._message, reason)  # type: ignore[attr-defined]
        raise SkipMessage(reason)
