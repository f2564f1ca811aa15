"""ScheduleLock: a scheduled run never starts while the previous run of its schedule runs.

Messages of the scheduler carry ``options["schedule"]`` (and the tick, and the lease).
Before such a run starts, this middleware takes the schedule's run lock in Redis
(``SET NX PX`` with the schedule's ``max_runtime_s`` as lease, holder = the message id).
Taken: the run starts, a renewer thread extends the lease every third of it while the run
lasts, and the lock is released when the run ends (success, failure, requeue). Held by
another run: the message is skipped (acknowledged, not run, not retried), logged and
counted as ``skipped_overlap`` (``jobs_processed_total`` counts it as ``skipped``).

A redelivery of the same message (its worker died mid-run) finds the lock held by its own
id and takes it over. If a worker dies without releasing, the lock lapses at most
``max_runtime_s`` after its last renewal. A success records ``success_at`` for the
schedule (``schedule_last_success_timestamp_seconds``). Messages without the option
cost one dictionary lookup.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage

from ..schedules import OPTION_LEASE_MS, OPTION_SCHEDULE, OPTION_TICK, lock_key, state_key

logger = logging.getLogger(__name__)
#: Marks a message this middleware skipped (read by Metrics for its outcome).
SKIPPED_OPTION = "skipped_overlap"

# KEYS: lock. ARGV: holder, lease ms. 1 when taken (or already held by the same holder).
_ACQUIRE = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if holder then return 0 end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
# KEYS: lock, state. ARGV: holder, success time or '' (failure).
_RELEASE = """
if ARGV[2] ~= '' then redis.call('hset', KEYS[2], 'success_at', ARGV[2]) end
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
_SKIPPED = "return redis.call('hincrby', KEYS[1], 'runs:skipped_overlap', 1)"


class ScheduleLock(Middleware):
    """Keeps the runs of one schedule apart with a renewed Redis lock.

    Parameters:
      renew_floor_s: shortest pause between two renewals (default 0.1 s).
    """

    def __init__(self, renew_floor_s: float = 0.1) -> None:
        self.renew_floor_s = renew_floor_s
        self._held: dict[str, tuple[str, int]] = {}  # message id -> (lock key, lease ms)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _client(broker: Broker) -> redis.Redis:
        client: redis.Redis = broker.client  # type: ignore[attr-defined]
        return client

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        name = message.options.get(OPTION_SCHEDULE)
        if name is None:
            return
        lease_ms = int(message.options.get(OPTION_LEASE_MS, 3_600_000))
        client = self._client(broker)
        key = lock_key(str(name))
        if not client.eval(_ACQUIRE, 1, key, message.message_id, lease_ms):
            client.eval(_SKIPPED, 1, state_key(str(name)))
            message.options[SKIPPED_OPTION] = True
            logger.warning(
                "schedule %s: previous run still holds the lock; run skipped",
                name,
                extra={
                    "event": "schedule_skipped_overlap",
                    "schedule": name,
                    "tick": message.options.get(OPTION_TICK),
                    "job_id": message.message_id,
                    "holder": _text(client.get(key)),
                },
            )
            raise SkipMessage(f"schedule {name}: previous run still running")
        with self._lock:
            self._held[message.message_id] = (key, lease_ms)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._renew_forever, args=(client,), name="schedule-lock", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        with self._lock:
            held = self._held.pop(message.message_id, None)
        if held is None:
            return
        succeeded = exception is None and not message.failed
        try:
            self._client(broker).eval(
                _RELEASE,
                2,
                held[0],
                state_key(str(message.options[OPTION_SCHEDULE])),
                message.message_id,
                repr(time.time()) if succeeded else "",
            )
        except redis.RedisError as error:
            logger.warning("could not release %s (it lapses with its lease): %s", held[0], error)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self.after_process_message(broker, message, exception=SkipMessage())

    def _renew_forever(self, client: redis.Redis) -> None:
        """Extend every held lock's lease every third of it; never dies on an error."""
        lapsed: set[str] = set()
        while True:
            try:
                pause = self._renew_round(client, lapsed)
            except Exception:
                logger.exception("schedule lock renewal failed; retrying")
                pause = 1.0
            if pause is None:
                self._wake.wait(1.0)
                self._wake.clear()
            else:
                time.sleep(pause)

    def _renew_round(self, client: redis.Redis, lapsed: set[str]) -> float | None:
        with self._lock:
            held = dict(self._held)
        lapsed &= set(held)
        if not held:
            return None
        for message_id, (key, lease_ms) in held.items():
            try:
                if not client.eval(_RENEW, 1, key, message_id, lease_ms) and (
                    message_id not in lapsed
                ):
                    lapsed.add(message_id)
                    logger.error(
                        "run lock %s lapsed while its run goes on: another run may start",
                        key,
                        extra={"event": "schedule_lock_lost", "job_id": message_id},
                    )
            except redis.RedisError as error:
                logger.warning("could not renew %s: %s", key, error)
        return max(self.renew_floor_s, min(lease for _, lease in held.values()) / 3000)


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
