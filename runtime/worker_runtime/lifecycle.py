"""The handler API for long jobs: report progress, stop at a safe point on shutdown.

    from worker_runtime import checkpoint, shutdown_requested

    for number, chunk in enumerate(chunks, 1):
        process(chunk)
        # progress for liveness; on shutdown, stops here and requeues
        checkpoint(progress=number / len(chunks), note=f"chunk {number} of {len(chunks)}")

``checkpoint()`` raises :class:`Requeue` once the worker is shutting down, so the
handler stops between chunks and its message goes back to the queue (it is not
counted as a failed attempt). Handlers that must clean up first can poll
``shutdown_requested()`` and raise :class:`Requeue` themselves. Past the job's time limit
``checkpoint()`` raises ``TimeLimitExceeded``, at every call, even after a handler
swallowed the first one.

``progress`` (0 to 1) and ``note`` (a short text, cut at :data:`NOTE_CHARS`) are optional:
given, ``status`` and the console show them with the running job (published with the
process's next heartbeat). A progress that is not a number from 0 to 1 raises
``ValueError`` naming it: a handler's mistake, found by its first test.
"""

from __future__ import annotations

import contextvars
import math
import threading

from dramatiq.middleware.threading import Interrupt
from dramatiq.middleware.time_limit import TimeLimitExceeded

from .boards import ProgressBoard

#: Characters of a ``checkpoint()`` note kept (the rest is cut).
NOTE_CHARS = 200


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
        #: The last ``checkpoint(progress, note)`` of each handler slot's current job.
        self._reports: dict[int, tuple[float | None, str | None]] = {}

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

    def checkpoint(self, progress: float | None = None, note: str | None = None) -> None:
        """Record progress of the current handler (and its ``progress`` from 0 to 1 and
        ``note``, when given); raise :class:`Requeue` if shutting down,
        ``TimeLimitExceeded`` once its job ran past its time limit."""
        slot = self.current_slot()
        if (progress is not None or note is not None) and slot is not None:
            kept = None if note is None else str(note)[:NOTE_CHARS]
            self._reports[slot] = (_fraction(progress), kept)
        if self.board is not None and slot is not None:
            self.board.progress(slot)
            if self.board.past_deadline(slot):
                raise TimeLimitExceeded("the job ran past its time limit: stopping at a checkpoint")
        if self._shutdown.is_set():
            raise Requeue("shutdown requested: stopping at a checkpoint")

    def clear_report(self) -> None:
        """The current handler starts or ends a job: it has reported nothing of it yet."""
        slot = self.current_slot()
        if slot is not None:
            self._reports.pop(slot, None)

    def report_of(self, slot: int | None) -> tuple[float | None, str | None] | None:
        """The last ``(progress, note)`` the job of handler ``slot`` gave, None: none."""
        return None if slot is None else self._reports.get(slot)


def _fraction(progress: float | None) -> float | None:
    """``progress`` checked: None, or a number from 0 to 1."""
    if progress is None:
        return None
    if isinstance(progress, bool) or not isinstance(progress, int | float):
        raise ValueError(f"checkpoint(progress=...) takes a number from 0 to 1, not {progress!r}")
    if math.isnan(progress) or not 0 <= progress <= 1:
        raise ValueError(f"checkpoint(progress=...) takes a number from 0 to 1, not {progress!r}")
    return round(float(progress), 4)


#: This process's lifecycle.
LIFECYCLE = Lifecycle()


def shutdown_requested() -> bool:
    """True once the worker has been asked to stop (SIGTERM or SIGINT)."""
    return LIFECYCLE.shutdown_requested()


def checkpoint(progress: float | None = None, note: str | None = None) -> None:
    """Record progress of the current handler (``progress`` from 0 to 1 and a ``note``,
    shown with the running job by ``status`` and the console); raise :class:`Requeue` if
    shutting down, ``TimeLimitExceeded`` once its job ran past its time limit."""
    LIFECYCLE.checkpoint(progress, note)
