"""Jobs that run past their time limit and will not stop: the rules, and their count.

Dramatiq's time limit raises ``TimeLimitExceeded`` once into the handler's thread: a handler
that swallows it (a bare ``except:``) runs on, and one inside a C call that holds the
interpreter lock (a catastrophic regular expression) cannot receive it at all. Here:

* in the worker process the time-limit watchdog (:mod:`.middleware.time_limit`) raises it
  again every :data:`REPEAT_S` while the job runs, and ``checkpoint()`` raises it at each
  call; :data:`ABANDON_AFTER_S` past the limit the thread is abandoned: the process drains
  the rest, charges the job as a time limit (:func:`.recovery.charge_time_limit`) and exits
  ``EX_REPLACE``; the supervisor starts another at once;
* the supervisor kills a worker process whose main loop has not ticked its progress board
  for :data:`STALLED_TICK_S` while one of its jobs is past its deadline (:func:`overdue`):
  the interpreter lock is held. That job is charged as a time limit, not as a crash, and
  its dead-letter reason says so; the others it held are requeued uncharged.

Each delivery ended by its time limit (interrupted, abandoned or killed) is counted once in
``jobs_time_limit_exceeded_total{queue,actor}`` (:func:`count_time_limit`): by the worker process's
Metrics middleware, or where it is charged. The counter is made on first use, once
``PROMETHEUS_MULTIPROC_DIR`` is set (the supervisor sets it before it starts anything).

This module imports neither Dramatiq nor the actors.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Final

from . import contract
from .boards import Slot, Snapshot

#: Seconds between two raises of ``TimeLimitExceeded`` into a job past its limit.
REPEAT_S: Final = 1.0
#: Seconds past its limit after which a job's thread is abandoned and its process replaced.
ABANDON_AFTER_S: Final = 5.0
#: Seconds without a tick of a process's main loop (it ticks every second, and every 50 ms
#: while it drains) after which a job past its deadline is taken to hold the interpreter.
STALLED_TICK_S: Final = 3.0

_made: Any = None
_lock = threading.Lock()


def _counter() -> Any:
    """``jobs_time_limit_exceeded_total``, made on first use."""
    global _made
    with _lock:
        if _made is None:
            from prometheus_client import Counter

            _made = Counter(
                contract.JOBS_TIME_LIMIT_EXCEEDED,
                "Deliveries ended by their time limit: interrupted, abandoned or killed.",
                ["queue", "actor"],
            )
        return _made


def count_time_limit(queue: str, actor: str) -> None:
    """Add one to ``jobs_time_limit_exceeded_total{queue,actor}``."""
    _counter().labels(queue, actor).inc()


def show_time_limits(queue: str, actor: str) -> None:
    """Make the series of ``actor`` on ``queue`` exist from 0 (a worker process does it at
    boot for each of its actors), so an alert sees its first increase."""
    _counter().labels(queue, actor)


def overdue(board: Snapshot, now: float) -> list[Slot]:
    """The jobs of ``board`` past their deadline while its main loop has not ticked for
    :data:`STALLED_TICK_S` (``now``: ``time.monotonic()``) and its process is not stopped
    (SIGSTOP, a debugger: that is no handler holding the interpreter; the drain window
    deals with it): its process will not stop them."""
    if now - board.tick < STALLED_TICK_S or _stopped(board.pid):
        return []
    return [slot for slot in board.slots if slot.job_started and 0 < slot.deadline <= now]


def _stopped(pid: int) -> bool:
    """True when process ``pid`` is stopped or traced (its state in ``/proc/<pid>/stat``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])
