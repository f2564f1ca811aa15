"""GracefulShutdown: knows which handlers are in flight; requeues what a drain interrupts."""

from __future__ import annotations

import threading
from typing import Any

from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware.threading import raise_thread_exception

from ..consumer import Settlement, settle_with, settles
from ..layout import REDIS_MESSAGE_ID
from ..lifecycle import Requeue


class GracefulShutdown(Middleware):
    """Tracks the handlers in flight so the worker runtime can drain them.

    A handler that ends with :class:`~..lifecycle.Requeue` (it reached a
    ``checkpoint()`` after SIGTERM, or the drain window closed on it) has its
    message put back at the tail of its queue, uncounted: the ack that Dramatiq
    sends afterwards finds nothing to remove.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[int, MessageProxy] = {}
        self.finished = 0
        self.requeued = 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        with self._lock:
            self._in_flight[threading.get_ident()] = message

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        with self._lock:
            self._in_flight.pop(threading.get_ident(), None)
            if isinstance(exception, Requeue):
                if settles(broker):  # requeued with its ack, even if Redis is down now
                    settle_with(message, Settlement("requeue"))
                else:
                    broker.do_requeue(message.queue_name, message.options[REDIS_MESSAGE_ID])  # type: ignore[attr-defined]
                self.requeued += 1
            else:
                self.finished += 1

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        with self._lock:
            self._in_flight.pop(threading.get_ident(), None)

    def interrupt(self) -> int:
        """Raise :class:`Requeue` in every handler still in flight; return how many."""
        with self._lock:
            threads = list(self._in_flight)
        for thread_id in threads:
            raise_thread_exception(thread_id, Requeue)
        return len(threads)
