"""StopSignals: SIGTERM and SIGINT as a stop request, recorded without taking a lock.

A Python signal handler runs in the main thread between two bytecodes, possibly while
that thread holds the lock of the very :class:`threading.Event` the handler would set
(inside ``Event.wait``, before it lets the lock go or after it takes it back). Setting
the event there deadlocks the process: it never drains, and no later signal can reach
it. So the handler only assigns attributes, and the main thread waits on a pipe that
``signal.set_wakeup_fd`` writes to at the C level when a signal arrives.
"""

from __future__ import annotations

import os
import select
import signal
import time
from types import FrameType

#: A second signal closer than this to the first is the same event (e.g. TERM to the group).
SIGNAL_DEBOUNCE_S = 1.0


class StopSignals:
    """The stop requests of one process: the first SIGTERM or SIGINT, and a later one.

    Parameters:
      debounce_s: a signal closer than this to the first is the same request (the
        process group's signal and the one the supervisor forwards); one at least this
        long after the first makes :attr:`hurried` true (default :data:`SIGNAL_DEBOUNCE_S`).
    """

    def __init__(self, debounce_s: float = SIGNAL_DEBOUNCE_S) -> None:
        self.debounce_s = debounce_s
        self._first_at: float | None = None  # time.monotonic() of the first signal
        self._hurried = False
        self._wake_read, self._wake_write = os.pipe()
        for fd in (self._wake_read, self._wake_write):
            os.set_blocking(fd, False)

    def install(self) -> None:
        """Handle SIGTERM and SIGINT from now on (call it from the main thread)."""
        signal.set_wakeup_fd(self._wake_write, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
        elif now - self._first_at >= self.debounce_s:
            self._hurried = True

    @property
    def requested(self) -> bool:
        """True once the first signal came."""
        return self._first_at is not None

    @property
    def hurried(self) -> bool:
        """True once a signal came at least ``debounce_s`` after the first."""
        return self._hurried

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the first signal; True once it came."""
        if not self.requested:
            select.select([self._wake_read], [], [], timeout_s)
            self._empty_pipe()  # a call: the handler of the signal that woke us runs first
        return self.requested

    def _empty_pipe(self) -> None:
        try:
            while os.read(self._wake_read, 512):
                pass
        except BlockingIOError:
            pass
