"""Attempts: a delivery over the attempt budget is dead-lettered without running; a message
suspected of crashing its process runs alone, so the next crash is charged to it only."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage

from .. import lifecycle
from ..layout import crashes, deliveries
from ..settlement import dead_letter_delivery


class SuspectGate:
    """Lets ordinary handlers run side by side and a suspect run alone in its process.

    A readers-writer lock that prefers the suspect: once one waits, no new handler
    starts until it has run. Waiting gives up when ``abort()`` turns true.

    An ordinary handler enters and leaves without taking a lock while no suspect
    runs or waits (every job passes here; a lock that handler threads queue on
    costs more than the jobs' own work). It puts itself on the running list first
    and then looks for a suspect, and a suspect announces itself first and then
    looks at the running list, so one of the two always sees the other: the
    ordinary handler steps back, or the suspect waits for it to leave. Suspects and
    handlers that wait take the condition's lock.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        #: Thread ids of the handlers that entered (the suspect included); list operations
        #: are atomic, so handler threads change it without the lock.
        self._running: list[int] = []
        self._suspect: int | None = None
        self._suspects_waiting = 0
        self._waiting = 0

    def enter(self, suspect: bool, abort: Callable[[], bool]) -> bool:
        """Wait for a turn (alone when ``suspect``); False when ``abort()`` stopped the wait."""
        me = threading.get_ident()
        if not suspect:
            self._running.append(me)
            if self._suspect is None and not self._suspects_waiting:
                return True
            self._running.remove(me)  # a suspect runs or waits: step back, wait below
            self._wake()
        with self._cond:
            self._suspects_waiting += suspect
            try:
                while self._suspect is not None or (
                    self._running if suspect else self._suspects_waiting
                ):
                    if abort():
                        return False
                    self._waiting += 1
                    try:
                        self._cond.wait(0.1)
                    finally:
                        self._waiting -= 1
                if suspect:
                    self._suspect = me
                self._running.append(me)
                return True
            finally:
                self._suspects_waiting -= suspect

    def leave(self) -> None:
        me = threading.get_ident()
        self._running.remove(me)
        if self._suspect == me:
            with self._cond:
                self._suspect = None
                self._cond.notify_all()
        else:
            self._wake()

    def _wake(self) -> None:
        """Wake the waiters, if any, to look again."""
        if self._waiting:
            with self._cond:
                self._cond.notify_all()


class Attempts(Middleware):
    """Refuses to run a message that has already used ``max_attempts`` deliveries.

    Deliveries are failed attempts (``options["retries"]``, kept by CrashAwareRetries) plus
    crashes of the worker process (``options["crashes"]``, kept by recovery), so a
    poison message that kills its process cannot loop forever.

    A crash is charged to every message that was running in the process, since
    any of them may have caused it. A message with a crash on its record (a
    suspect) therefore runs alone in its process: if it crashes the process again,
    no innocent message beside it is charged, so healthy messages that once ran
    next to a poison one are never dead-lettered because of it.

    Parameters:
      max_attempts: ``WORKER_MAX_ATTEMPTS``.
    """

    def __init__(self, max_attempts: int) -> None:
        self.max_attempts = max_attempts
        self.gate = SuspectGate()
        self._entered = threading.local()

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        used = deliveries(message.options)
        if used >= self.max_attempts:
            reason = f"{used} deliveries used up WORKER_MAX_ATTEMPTS={self.max_attempts}"
            dead_letter_delivery(broker, message, reason)
            raise SkipMessage(reason)
        suspect = crashes(message.options) > 0
        if not self.gate.enter(suspect, lifecycle.shutdown_requested):
            raise lifecycle.Requeue("shutdown requested before the job could start")
        self._entered.value = True

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        if getattr(self._entered, "value", False):
            self._entered.value = False
            self.gate.leave()

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self.after_process_message(broker, message)
