"""CrashAwareRetries: Dramatiq's retries with backoff, made shutdown- and crash-aware."""

from __future__ import annotations

from typing import Any

import dramatiq.middleware
from dramatiq import Broker
from dramatiq.broker import MessageProxy

from ..lifecycle import Requeue
from ..recovery import dead_letter_delivery


class CrashAwareRetries(dramatiq.middleware.Retries):
    """Dramatiq's :class:`~dramatiq.middleware.Retries`, with three changes.

    * A :class:`~..lifecycle.Requeue` (shutdown) is not a failure: no retry is
      counted and no delayed copy is enqueued; the shutdown middleware requeues it.
    * Deliveries lost to crashes (``options["crashes"]``) use up the same budget,
      so ``max_retries + 1`` is the total number of deliveries.
    * An exhausted message is dead-lettered with the exception as its reason.

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
        if exception is None or isinstance(exception, Requeue):
            return
        actor = broker.get_actor(message.actor_name)
        budget = min(actor.options.get("max_retries", self.max_retries), self.max_retries)
        message.options["max_retries"] = max(0, budget - int(message.options.get("crashes", 0)))
        super().after_process_message(broker, message, result=result, exception=exception)  # type: ignore[no-untyped-call]
        if message.failed:
            reason = f"{type(exception).__name__}: {exception}"[:500]
            dead_letter_delivery(broker, message, reason)
