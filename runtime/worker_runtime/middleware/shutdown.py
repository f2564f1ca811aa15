"""GracefulShutdown: knows which handlers are in flight; requeues what a drain interrupts."""

from __future__ import annotations

import threading
from typing import Any

from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware.threading import raise_thread_exception

from ..lifecycle import Requeue
from ..settlement import REQUEUE, settle_with


class GracefulShutdown(Middleware):
    """Tracks the handlers in flight so the worker runtime can drain them.

    A handler that ends with :class:`~..lifecycle.Requeue` (it reached a
    ``checkpoint()`` after SIGTERM, or the drain window closed on it) has its
    message put back at the tail of its queue, uncounted: the ack that Dramatiq
    sends afterwards finds nothing to remove.
    """

    def __init__(self) -> None:
        #: Handler thread id -> its message. Each thread sets and pops its own key (atomic
        #: dict operations): the per-job hooks take no lock.
        self._in_flight: dict[int, MessageProxy] = {}
        #: Handler thread id -> [finished, requeued] by that thread (each thread counts its own).
        self._ended: dict[int, list[int]] = {}

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def finished(self) -> int:
        """Handlers that ended other than by a requeue."""
        return sum(counts[0] for counts in list(self._ended.values()))

    @property
    def requeued(self) -> int:
        """Handlers whose message was requeued by a shutdown."""
        return sum(counts[1] for counts in list(self._ended.values()))

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self._in_flight[threading.get_ident()] = message

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        me = threading.get_ident()
        self._in_flight.pop(me, None)
        counts = self._ended.setdefault(me, [0, 0])
        if isinstance(exception, Requeue):
            settle_with(message, REQUEUE)  # requeued with its ack, even if Redis is down now
            counts[1] += 1
        else:
            counts[0] += 1

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._in_flight.pop(threading.get_ident(), None)

    def interrupt(self) -> int:
        """Raise :class:`Requeue` in every handler still in flight; return how many."""
        threads = list(self._in_flight)
        for thread_id in threads:
            raise_thread_exception(thread_id, Requeue)
        return len(threads)
