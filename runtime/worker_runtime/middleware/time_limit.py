"""CappedTimeLimit: Dramatiq's TimeLimit with ``WORKER_JOB_TIMEOUT_MS`` as a ceiling."""

from __future__ import annotations

import threading
import time
from typing import Any

from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import TimeLimit
from dramatiq.middleware.time_limit import TimeLimitExceeded
from dramatiq.worker import Worker, WorkerThread

__all__ = ["CappedTimeLimit", "TimeLimitExceeded"]


class CappedTimeLimit(TimeLimit):
    """Interrupts a handler that runs past its time limit; no actor can raise the limit.

    Dramatiq's :class:`~dramatiq.middleware.TimeLimit` lets an actor's (or a
    message's) ``time_limit`` replace the default, longer or shorter. Here the
    setting is a ceiling: the limit of a job is the smallest of the setting, the
    actor's ``time_limit`` and the message's. So the timing rule job < drain <
    grace period holds for every job.

    The interrupted handler ends with :class:`TimeLimitExceeded`, a failed attempt:
    :class:`.CrashAwareRetries` retries it within ``WORKER_MAX_ATTEMPTS`` and then
    dead-letters it with :data:`..settlement.TIME_LIMIT_REASON`.

    The watchdog thread starts at ``after_process_boot`` (which the worker runtime
    emits, as Dramatiq's CLI does) or, at the latest, at ``before_worker_boot``.
    It interrupts Python code only: a handler blocked in one C call (``time.sleep``,
    a socket read without timeout) gets the exception when the call returns; the
    drain and the liveness probe handle that case.

    Parameters:
      time_limit: ``WORKER_JOB_TIMEOUT_MS``, the ceiling in milliseconds.
      interval: milliseconds between two looks at the deadlines (default 100).
    """

    def __init__(self, *, time_limit: int, interval: int = 100) -> None:
        super().__init__(time_limit=time_limit, interval=interval)
        self._started = False
        self._start_lock = threading.Lock()
        #: Actor name -> the setting lowered by the actor's ``time_limit`` (actors do not
        #: change once declared).
        self._actor_limits: dict[str, float] = {}

    @property
    def running(self) -> bool:
        """True once the watchdog runs."""
        return self._started

    def limit_ms(self, broker: Broker, message: MessageProxy) -> float:
        """The time limit of ``message``: the setting, lowered by the actor or the message."""
        limit = self._actor_limits.get(message.actor_name)
        if limit is None:
            asked = broker.get_actor(message.actor_name).options.get("time_limit")
            limit = min(float(self.time_limit), float(asked) if asked else float("inf"))
            self._actor_limits[message.actor_name] = limit
        asked = message.options.get("time_limit")
        return min(limit, float(asked)) if asked else limit

    def _start(self) -> None:
        with self._start_lock:
            if not self._started:
                super().after_process_boot(None)  # type: ignore[no-untyped-call]
                self._started = True

    def after_process_boot(self, broker: Broker) -> None:
        self._start()

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        self._start()

    # -- per message: the handler thread sets its own deadline, without the watchdog's lock --

    def after_worker_thread_boot(self, broker: Broker, thread: WorkerThread) -> None:
        """Give the handler thread its entry in the watchdog's table now, under the table's
        lock; each job then only sets the entry's value, which takes no lock (the table
        never grows while the watchdog walks it, and handler threads do not queue on its
        lock). The table is Dramatiq's ``_CtypesTimeoutManager.deadlines`` (Dramatiq is
        pinned); a manager without one (gevent's) is called as Dramatiq does."""
        self.manager.remove_timeout(threading.get_ident())  # type: ignore[no-untyped-call]

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self._arm(self.limit_ms(broker, message))

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self._arm(None)

    def _arm(self, limit_ms: float | None) -> None:
        """Set the current thread's deadline ``limit_ms`` from now (None: disarm it): its
        entry in the watchdog's table, without the table's lock, once the thread has one;
        otherwise through the manager, as Dramatiq does."""
        me, deadlines = threading.get_ident(), getattr(self.manager, "deadlines", None)
        if deadlines is not None and me in deadlines:
            deadlines[me] = None if limit_ms is None else time.monotonic() + limit_ms / 1000
        elif limit_ms is None:
            self.manager.remove_timeout(me)  # type: ignore[no-untyped-call]
        else:
            self.manager.add_timeout(me, limit_ms)  # type: ignore[no-untyped-call]

    after_skip_message = after_process_message
