"""Redis not answering: said once, in one line naming ``REDIS_URL`` and how to start Redis,
then a line a minute while it lasts, and once when Redis answers again.

* **At boot** the supervisor waits for Redis before it checks Redis's credentials and
  configuration and starts the worker processes (:func:`wait_until_answering`): it retries
  quietly with a backoff (0.5 s doubling to 10 s); SIGTERM ends the wait at once (exit 0).
  Liveness holds meanwhile (no dependency is a liveness problem), readiness does not.
* **While running**, a worker process whose Redis goes away says it through the same
  :class:`Outage`: the recovery pass reports each failure and each success, and Dramatiq's
  consumer threads, which log a CRITICAL line and a "Restarting consumer" line per queue
  every 3 s, are folded into it (:class:`ConsumerNoise`).

This module imports neither Dramatiq nor the actors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from .settings import mask_url

logger = logging.getLogger(__name__)

#: Seconds between two lines while Redis stays unreachable.
SAY_EVERY_S = 60.0
#: First and longest pause between two tries of the boot's wait.
RETRY_BACKOFF_S = (0.5, 10.0)
#: How long a pause of the boot's wait sleeps before it looks at the stop flag again.
STOP_POLL_S = 0.1
#: How to start the Redis a fresh bake expects (its README's quick start).
START_HINT = (
    "is it running? start one with `docker compose up -d redis` (this project's "
    "compose.yaml), `make dev` or `redis-server`, or point REDIS_URL at yours"
)


class Outage:
    """One process's account of Redis not answering (thread-safe).

    Parameters:
      url: ``REDIS_URL`` (masked in every line).
      clock: seconds, monotonic (tests may pass their own).
    """

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.url = mask_url(url)
        self.clock = clock
        #: When the current outage began (None: Redis answers).
        self.since: float | None = None
        #: Failed tries in the current outage.
        self.failures = 0
        self._said_at = 0.0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        """True from a failed try until the next one that succeeds."""
        return self.since is not None

    def failed(self, error: BaseException | str) -> None:
        """A try to reach Redis failed: said at the first, then at most once a minute."""
        with self._lock:
            now = self.clock()
            self.failures += 1
            if self.since is None:
                self.since = self._said_at = now
                logger.error(
                    "Redis unreachable at REDIS_URL=%s (%s): %s; retrying quietly, a line a "
                    "minute until it answers",
                    self.url,
                    error,
                    START_HINT,
                    extra={"event": "redis_unreachable", "error": str(error)},
                )
            elif now - self._said_at >= SAY_EVERY_S:
                self._said_at = now
                logger.warning(
                    "Redis still unreachable at REDIS_URL=%s for %.0f s (%d failed tries; %s)",
                    self.url,
                    now - self.since,
                    self.failures,
                    error,
                    extra={"event": "redis_still_unreachable", "error": str(error)},
                )

    def answered(self) -> None:
        """A try to reach Redis succeeded: said once when it ends an outage."""
        if self.since is None:
            return
        with self._lock:
            if self.since is None:
                return
            lasted = self.clock() - self.since
            logger.info(
                "Redis answers at REDIS_URL=%s after %.1f s unreachable (%d failed tries)",
                self.url,
                lasted,
                self.failures,
                extra={"event": "redis_reachable", "unreachable_s": round(lasted, 3)},
            )
            self.since, self.failures = None, 0


def unreachable(error: BaseException) -> bool:
    """True when ``error`` says Redis does not answer (refused, timed out, loading), not that
    it refused what was asked (a refused password answers)."""
    return isinstance(error, redis.ConnectionError | redis.TimeoutError) and not isinstance(
        error, redis.AuthenticationError
    )


def wait_until_answering(client: redis.Redis, outage: Outage, stopping: Callable[[], bool]) -> bool:
    """PING until Redis answers (True) or ``stopping()`` is true (False), pausing with a
    backoff (:data:`RETRY_BACKOFF_S`); the first failure and one a minute are said by
    ``outage``. Any answer counts, a refused password's too (the caller's checks judge it)."""
    pause, cap = RETRY_BACKOFF_S
    while not stopping():
        try:
            client.ping()
        except redis.RedisError as error:
            if not unreachable(error):
                break
            outage.failed(error)
        else:
            break
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline and not stopping():
            time.sleep(STOP_POLL_S)
        pause = min(pause * 2, cap)
    else:
        return False
    outage.answered()
    return True


class ConsumerNoise(logging.Filter):
    """Folds Dramatiq's consumer-thread lines about a lost connection into ``outage``: its
    CRITICAL "Consumer encountered a connection error" becomes a failed try, and its
    "Restarting consumer" lines are dropped while Redis is unreachable. Added to each
    consumer thread's logger (``dramatiq.worker.ConsumerThread(<queue>)``)."""

    CONNECTION_ERROR = "Consumer encountered a connection error"
    RESTARTING = "Restarting consumer"

    def __init__(self, outage: Outage) -> None:
        super().__init__()
        self.outage = outage

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if text.startswith(self.CONNECTION_ERROR):
            args = record.args if isinstance(record.args, tuple) else ()
            self.outage.failed(str(args[0]) if args else text)
            return False
        return not (text.startswith(self.RESTARTING) and self.outage.down)

    @staticmethod
    def logger_name(queue: str) -> str:
        """The logger of the consumer thread of ``queue`` (Dramatiq's ``get_logger``)."""
        return f"dramatiq.worker.ConsumerThread({queue})"
