"""Whether this worker process may still hold what it fetched, judged from its heartbeats.

Another worker recovers this one's messages once its heartbeat is older than
``WORKER_HEARTBEAT_TIMEOUT_MS`` by Redis's clock: a process stopped (SIGSTOP, a paused
container) or frozen (a C call that holds the interpreter lock stops every thread, the
heartbeat's too) may wake up holding in memory messages that run elsewhere already. A
message must not start then, and a job still running must stop.

:class:`HoldWatch` tells, with no Redis call, when nothing of the kind can have happened:
the heartbeats (:class:`.middleware.Recovery`'s, every fifth of the timeout at most) never
left a gap of half the timeout since the message was fetched. Beat ``k`` ran in Redis
between its sending and its reply, so the time between two that ran is at most the reply
of the later minus the sending of the earlier: a gap is counted (:attr:`epoch`) when that
reaches :attr:`safe_s`. Otherwise (a gap since its fetch, or the last beat older than
:attr:`safe_s` now) the start asks Redis (:func:`.layout.still_held`). Time is
``time.monotonic()``, which runs on while a process is stopped.
"""

from __future__ import annotations

import time

#: Attribute of a fetched MessageProxy: the :attr:`HoldWatch.epoch` under which it was fetched
#: (set by the consumer before the fetch is sent, read by the HeldCheck middleware).
HOLD_EPOCH = "_hold_epoch"


class HoldWatch:
    """This process's record of its heartbeats' gaps.

    Parameters:
      heartbeat_timeout_ms: ``WORKER_HEARTBEAT_TIMEOUT_MS``; half of it is the longest
        silence that cannot have let another worker recover this one's messages.
    """

    def __init__(self, heartbeat_timeout_ms: int) -> None:
        self.safe_s = heartbeat_timeout_ms / 2000
        #: Gaps seen so far: a message fetched under an older epoch may have been recovered.
        self.epoch = 0
        #: ``time.monotonic()`` when the last heartbeat that returned was sent.
        self._sent = time.monotonic()

    def beat(self, sent: float, returned: float) -> None:
        """A heartbeat sent at ``sent`` returned at ``returned`` (monotonic seconds). The
        epoch moves first, then the time: a reader that sees the new time sees the gap."""
        if returned - self._sent >= self.safe_s:
            self.epoch += 1
        self._sent = sent

    def sure(self, epoch: int) -> bool:
        """True when a message fetched under ``epoch`` is surely still held: no gap since,
        and the last heartbeat is recent (read before the epoch: see :meth:`beat`)."""
        sent = self._sent
        return time.monotonic() - sent < self.safe_s and self.epoch == epoch
