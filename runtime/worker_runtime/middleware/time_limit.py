"""CappedTimeLimit: Dramatiq's TimeLimit with ``WORKER_JOB_TIMEOUT_MS`` as a ceiling, raised
again until the handler stops (:mod:`..overrun`)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import TimeLimit
from dramatiq.middleware.threading import raise_thread_exception
from dramatiq.middleware.time_limit import TimeLimitExceeded, _CtypesTimeoutManager
from dramatiq.worker import Worker, WorkerThread

from ..layout import REDIS_MESSAGE_ID, canonical
from ..lifecycle import LIFECYCLE, Lifecycle
from ..overrun import ABANDON_AFTER_S, REPEAT_S

__all__ = ["CappedTimeLimit", "TimeLimitExceeded"]

logger = logging.getLogger(__name__)


class _Watchdog(_CtypesTimeoutManager):
    """Dramatiq's watchdog thread (a table of deadlines, one per handler thread, looked at
    every ``interval``), which raises ``TimeLimitExceeded`` once: this one raises it again
    every :data:`..overrun.REPEAT_S` while the job runs, and gives the thread up
    :data:`..overrun.ABANDON_AFTER_S` past the limit (``owner.abandon``)."""

    def __init__(self, interval: int, owner: CappedTimeLimit) -> None:
        super().__init__(interval)  # type: ignore[no-untyped-call]
        self.owner = owner
        #: Handler thread id -> its job's deadline, once the job ran past it.
        self.overdue: dict[int, float] = {}

    def _handle_deadlines(self) -> None:
        now = time.monotonic()
        for thread_id, deadline in list(self.deadlines.items()):
            if not deadline or now < deadline:
                continue
            passed = self.overdue.setdefault(thread_id, deadline)
            if passed == deadline:
                self.owner.overran(thread_id)
            if self.deadlines.get(thread_id) != deadline:
                continue  # the job ended meanwhile: its thread is left alone
            if now - passed >= ABANDON_AFTER_S:
                self.deadlines[thread_id] = None
                self.owner.abandon(thread_id)
                continue
            self.deadlines[thread_id] = now + REPEAT_S
            raise_thread_exception(thread_id, TimeLimitExceeded)


class CappedTimeLimit(TimeLimit):
    """Interrupts a handler that runs past its time limit; no actor can raise the limit.

    Dramatiq's :class:`~dramatiq.middleware.TimeLimit` lets an actor's (or a
    message's) ``time_limit`` replace the default, longer or shorter. Here the
    setting is a ceiling: the limit of a job is the smallest of the setting, the
    actor's ``time_limit`` and the message's. So the timing rule job < drain <
    grace period holds for every job.

    The interrupted handler ends with :class:`TimeLimitExceeded`, a failed attempt:
    :class:`.CrashAwareRetries` retries it within ``WORKER_MAX_ATTEMPTS`` and then
    dead-letters it with :data:`..settlement.TIME_LIMIT_REASON`. The first raise is logged
    with the job's id; the job's deadline is on the progress board, where ``checkpoint()``
    and the supervisor read it.

    A handler that swallows the exception gets it again every :data:`..overrun.REPEAT_S`
    and at each ``checkpoint()``; one that still runs :data:`..overrun.ABANDON_AFTER_S`
    past its limit is abandoned (:meth:`abandon`): its job is listed in :attr:`abandoned`
    and the process is asked to drain (SIGTERM to itself); the drain leaves that thread,
    charges its job as a time limit and exits ``EX_REPLACE`` (:mod:`..runtime`).

    The watchdog thread starts at ``after_process_boot`` (which the worker runtime
    emits, as Dramatiq's CLI does) or, at the latest, at ``before_worker_boot``.
    It interrupts Python code only: a handler blocked in one C call (``time.sleep``,
    a socket read without timeout) gets the exception when the call returns; one that
    holds the interpreter lock past its limit is killed by the supervisor (:mod:`..overrun`).

    Parameters:
      time_limit: ``WORKER_JOB_TIMEOUT_MS``, the ceiling in milliseconds.
      interval: milliseconds between two looks at the deadlines (default 100).
      lifecycle: holds the progress board the deadlines go on (default: this process's).
    """

    def __init__(
        self, *, time_limit: int, interval: int = 100, lifecycle: Lifecycle = LIFECYCLE
    ) -> None:
        super().__init__(time_limit=time_limit, interval=interval)
        if hasattr(self.manager, "deadlines"):  # not gevent's, which has no watchdog thread
            self.manager = _Watchdog(interval, self)
        self.lifecycle = lifecycle
        #: Handler thread id -> the job it runs (set as the job starts; read when it overruns).
        self._jobs: dict[int, tuple[MessageProxy, float]] = {}
        #: Handler thread id -> (queue, redis message id) of a job given up past its limit.
        self.abandoned: dict[int, tuple[str, str]] = {}
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
        limit_ms = self.limit_ms(broker, message)
        self._jobs[threading.get_ident()] = (message, limit_ms)
        self._arm(limit_ms)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        me, watchdog = threading.get_ident(), self.manager
        unsaid = isinstance(exception, TimeLimitExceeded) and (
            isinstance(watchdog, _Watchdog) and me not in watchdog.overdue
        )  # a checkpoint raised it before the watchdog saw the job overrun
        self._arm(None)
        if unsaid:
            self.overran(me)

    def _arm(self, limit_ms: float | None) -> None:
        """Set the current thread's deadline ``limit_ms`` from now (None: disarm it): its
        entry in the watchdog's table, without the table's lock, once the thread has one
        (otherwise through the manager, as Dramatiq does), and on the progress board."""
        me, deadlines = threading.get_ident(), getattr(self.manager, "deadlines", None)
        deadline = None if limit_ms is None else time.monotonic() + limit_ms / 1000
        board, slot = self.lifecycle.board, self.lifecycle.current_slot()
        if board is not None and slot is not None:
            board.set_deadline(slot, deadline or 0.0)
        if isinstance(self.manager, _Watchdog):
            self.manager.overdue.pop(me, None)
        if deadlines is not None and me in deadlines:
            deadlines[me] = deadline
        elif limit_ms is None:
            self.manager.remove_timeout(me)  # type: ignore[no-untyped-call]
        else:
            self.manager.add_timeout(me, limit_ms)  # type: ignore[no-untyped-call]

    after_skip_message = after_process_message

    # -- past the limit (the watchdog thread) ---------------------------------------------

    def _job(self, thread_id: int) -> dict[str, Any]:
        """The log fields of the job ``thread_id`` runs."""
        message, limit_ms = self._jobs.get(thread_id, (None, 0.0))
        if message is None:
            return {"thread": thread_id}
        return {
            "job_id": message.message_id,
            "queue": canonical(message.queue_name),
            "actor": message.actor_name,
            "time_limit_ms": int(limit_ms),
        }

    def overran(self, thread_id: int) -> None:
        """The job of handler thread ``thread_id`` ran past its limit: said once."""
        logger.warning("job ran past its time limit; interrupting it", extra=self._job(thread_id))

    def abandon(self, thread_id: int) -> None:
        """Give up the handler thread ``thread_id``, still running
        :data:`..overrun.ABANDON_AFTER_S` past its limit: list its job in :attr:`abandoned`
        and ask this process to drain the rest and be replaced."""
        message, _ = self._jobs.get(thread_id, (None, 0.0))
        if message is None:
            return
        self.abandoned[thread_id] = (message.queue_name, message.options[REDIS_MESSAGE_ID])
        logger.error(
            "job would not stop after its time limit: its thread is abandoned and this worker "
            "process replaced (the others drain first)",
            extra={**self._job(thread_id), "event": "time_limit_abandoned"},
        )
        if not self.lifecycle.shutdown_requested():  # a second SIGTERM would hurry the drain
            os.kill(os.getpid(), signal.SIGTERM)
