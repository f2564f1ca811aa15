"""The handler API for long jobs: report progress, stop at a safe point on shutdown.

    from worker_runtime import checkpoint, shutdown_requested

    for chunk in chunks:
        process(chunk)
        checkpoint()      # progress for liveness; on shutdown, stops here and requeues

``checkpoint()`` raises :class:`Requeue` once the worker is shutting down, so the
handler stops between chunks and its message goes back to the queue (it is not
counted as a failed attempt). Handlers that must clean up first can poll
``shutdown_requested()`` and raise :class:`Requeue` themselves. Past the job's time limit
``checkpoint()`` raises ``TimeLimitExceeded``, at every call, even after a handler
swallowed the first one.
"""

from __future__ import annotations

import contextvars
import threading

from dramatiq.middleware.threading import Interrupt
from dramatiq.middleware.time_limit import TimeLimitExceeded

from .boards import ProgressBoard


class Requeue(Interrupt):
    """Stops a handler at a safe point; its message returns to its queue, not counted as a
    failure. Raised by ``checkpoint()`` after SIGTERM, and into handlers still running when
    the drain window closes."""


class Lost(Requeue):
    """Stops a handler whose message this process no longer holds: the process was stopped
    or frozen past ``WORKER_HEARTBEAT_TIMEOUT_MS`` and another worker recovered the message,
    which runs there. Its settlement stores nothing; it is counted in ``jobs_lost_total``."""


class Cancelled(Interrupt):
    """Stops a handler whose message was cancelled (``producer.cancel``); its message is
    acked, counted as ``cancelled``, never as a failure, and not retried."""


class Lifecycle:
    """One worker process's shutdown flag and progress board, shared by the runtime (which
    requests the shutdown and attaches the board), the ProgressRecorder middleware (which gives each
    handler thread a slot) and the handlers (``checkpoint()``).

    The process has one: :data:`LIFECYCLE`. Tests build their own.
    """

    def __init__(self) -> None:
        self._shutdown = threading.Event()
        #: The handler thread's slot: a context variable, so an ``async def`` handler, which
        #: runs on the event loop's thread in a copy of its handler thread's context
        #: (Dramatiq's AsyncIO), records progress on that slot too.
        self._slot: contextvars.ContextVar[int | None] = contextvars.ContextVar(
            f"handler_slot_{id(self)}", default=None
        )
        self.board: ProgressBoard | None = None

    def shutdown_requested(self) -> bool:
        """True once the worker has been asked to stop (SIGTERM or SIGINT)."""
        return self._shutdown.is_set()

    def request_shutdown(self) -> None:
        """Ask every handler to stop at its next checkpoint (called by the worker runtime)."""
        self._shutdown.set()

    def attach(self, board: ProgressBoard | None) -> None:
        """Record progress on ``board`` (the worker runtime attaches its process's board)."""
        self.board = board

    def bind_slot(self, slot: int) -> None:
        """The current thread is handler thread ``slot`` (set once at thread boot)."""
        self._slot.set(slot)

    def current_slot(self) -> int | None:
        return self._slot.get()

    def checkpoint(self) -> None:
        """Record progress of the current handler; raise :class:`Requeue` if shutting down,
        ``TimeLimitExceeded`` once its job ran past its time limit."""
        slot = self.current_slot()
        if self.board is not None and slot is not None:
            self.board.progress(slot)
            if self.board.past_deadline(slot):
                raise TimeLimitExceeded("the job ran past its time limit: stopping at a checkpoint")
        if self._shutdown.is_set():
            raise Requeue("shutdown requested: stopping at a checkpoint")


#: This process's lifecycle.
LIFECYCLE = Lifecycle()


def shutdown_requested() -> bool:
    """True once the worker has been asked to stop (SIGTERM or SIGINT)."""
    return LIFECYCLE.shutdown_requested()


def checkpoint() -> None:
    """Record progress of the current handler; raise :class:`Requeue` if shutting down,
    ``TimeLimitExceeded`` once its job ran past its time limit."""
    LIFECYCLE.checkpoint()
