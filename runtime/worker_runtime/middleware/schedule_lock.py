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

from ..layout import acquire_run, end_run, renew_lock, schedule_lock_key, text
from ..scheduling.schedules import OPTION_LEASE_MS, OPTION_SCHEDULE, OPTION_TICK
from ..settlement import SKIPPED_OPTION

logger = logging.getLogger(__name__)


class ScheduleLock(Middleware):
    """Keeps the runs of one schedule apart with a renewed Redis lock.

    Parameters:
      renew_floor_s: shortest pause between two renewals (default 0.1 s).
    """

    def __init__(self, renew_floor_s: float = 0.1) -> None:
        self.renew_floor_s = renew_floor_s
        self._held: dict[str, tuple[str, int]] = {}  # message id -> (schedule, lease ms)
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
        key = schedule_lock_key(str(name))
        if not acquire_run(client, str(name), message.message_id, lease_ms):
            message.options[SKIPPED_OPTION] = True
            logger.warning(
                "schedule %s: previous run still holds the lock; run skipped",
                name,
                extra={
                    "event": "schedule_skipped_overlap",
                    "schedule": name,
                    "tick": message.options.get(OPTION_TICK),
                    "job_id": message.message_id,
                    "holder": text(client.get(key)),
                },
            )
            raise SkipMessage(f"schedule {name}: previous run still running")
        with self._lock:
            self._held[message.message_id] = (str(name), lease_ms)
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
        if message.options.get(OPTION_SCHEDULE) is None:
            return  # not a scheduled run: no lock taken (this hook runs for every job)
        with self._lock:
            held = self._held.pop(message.message_id, None)
        if held is None:
            return
        succeeded = exception is None and not message.failed
        try:
            end_run(self._client(broker), held[0], message.message_id, succeeded)
        except redis.RedisError as error:
            logger.warning("could not end the run of %s (its lock lapses): %s", held[0], error)

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
        for message_id, (schedule, lease_ms) in held.items():
            key = schedule_lock_key(schedule)
            try:
                if not renew_lock(client, key, message_id, lease_ms) and message_id not in lapsed:
                    lapsed.add(message_id)
                    logger.error(
                        "run lock %s lapsed while its run goes on: another run may start",
                        key,
                        extra={"event": "schedule_lock_lost", "job_id": message_id},
                    )
            except redis.RedisError as error:
                logger.warning("could not renew %s: %s", key, error)
        return max(self.renew_floor_s, min(lease for _, lease in held.values()) / 3000)
