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
from ..layout import crashes
from ..recovery import dead_letter_delivery, deliveries


class SuspectGate:
    """Lets ordinary handlers run side by side and a suspect run alone in its process.

    A readers-writer lock that prefers the suspect: once one waits, no new handler
    starts until it has run. Waiting gives up when ``abort()`` turns true.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._alone = False
        self._suspects_waiting = 0

    def enter(self, suspect: bool, abort: Callable[[], bool]) -> bool:
        """Wait for a turn (alone when ``suspect``); False when ``abort()`` stopped the wait."""
        with self._cond:
            self._suspects_waiting += suspect
            try:
                while self._alone or (self._running if suspect else self._suspects_waiting):
                    if abort():
                        return False
                    self._cond.wait(0.1)
                self._alone = suspect
                self._running += 1
                return True
            finally:
                self._suspects_waiting -= suspect

    def leave(self) -> None:
        with self._cond:
            self._running -= 1
            self._alone = False
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
        used = deliveries(message._message)
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
