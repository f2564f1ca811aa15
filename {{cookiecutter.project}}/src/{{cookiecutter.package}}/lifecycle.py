"""The handler API for long jobs: report progress, stop at a safe point on shutdown.

    from {{ cookiecutter.package }}.lifecycle import checkpoint, shutdown_requested

    for chunk in chunks:
        process(chunk)
        checkpoint()      # progress for liveness; on shutdown, stops here and requeues

``checkpoint()`` raises :class:`Requeue` once the worker is shutting down, so the
handler stops between chunks and its message goes back to the queue (it is not
counted as a failed attempt). Handlers that must clean up first can poll
``shutdown_requested()`` and raise :class:`Requeue` themselves.
"""

from __future__ import annotations

import threading

from dramatiq.middleware.threading import Interrupt

from .boards import ProgressBoard

_shutdown = threading.Event()
_thread = threading.local()
_board: ProgressBoard | None = None


class Requeue(Interrupt):
    """Stops a handler at a safe point; its message returns to its queue, not counted as a
    failure. Raised by ``checkpoint()`` after SIGTERM, and into handlers still running when
    the drain window closes."""


def shutdown_requested() -> bool:
    """True once the worker has been asked to stop (SIGTERM or SIGINT)."""
    return _shutdown.is_set()


def checkpoint() -> None:
    """Record progress of the current handler; raise :class:`Requeue` if shutting down."""
    slot = getattr(_thread, "slot", None)
    if _board is not None and slot is not None:
        _board.progress(slot)
    if _shutdown.is_set():
        raise Requeue("shutdown requested: stopping at a checkpoint")


def request_shutdown() -> None:
    """Ask every handler to stop at its next checkpoint (called by the worker runtime)."""
    _shutdown.set()


def attach(board: ProgressBoard | None) -> None:
    """Record progress on ``board`` (the worker runtime attaches its process's board)."""
    global _board
    _board = board


def bind_slot(slot: int) -> None:
    """The current thread is handler thread ``slot`` (set once at thread boot)."""
    _thread.slot = slot


def current_slot() -> int | None:
    return getattr(_thread, "slot", None)


def board() -> ProgressBoard | None:
    return _board
