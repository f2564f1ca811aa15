"""Recovery: a heartbeat and a periodic pass that recovers the messages of dead workers
and the orphans of this one."""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
import time
from typing import Any, cast

import redis
from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware.threading import raise_thread_exception
from dramatiq.worker import Worker

from .. import accounting as recovery
from .. import layout
from ..backlog import read_backlog
from ..brokerstate import is_oom
from ..holds import HoldWatch
from ..layout import REDIS_MESSAGE_ID
from ..lifecycle import LIFECYCLE, Cancelled, Lifecycle, Lost, Requeue
from ..outage import Outage, unreachable
from ..settlement import SettlingBroker
from ..timing import HEARTBEAT_INTERVAL_MAX_S

logger = logging.getLogger(__name__)
#: How long the drain waits for a recovery pass in progress before forgetting the process.
FORGET_WAIT_S = 2.0
#: Shortest time between two records published for jobs that started (between passes).
RECORD_EVERY_S = 0.5
#: How often an idle process adds its queues' oldest due age to their activity (seconds).
ACTIVITY_IDLE_EVERY_S = 60.0


class Recovery(Middleware):
    """Runs :func:`~..recovery.recover_dead_workers` every ``interval_s`` in each worker.

    The same thread keeps this worker's heartbeat fresh, so its messages are not
    taken from it while a long job runs or while it drains with fetching stopped, and
    requeues what this worker holds in Redis but lost in memory (a call whose reply was
    lost: :meth:`.SettlingConsumer.reclaim_orphans`).

    Parameters:
      queues: the queues this worker serves (it recovers only those).
      heartbeat_timeout_ms: ``WORKER_HEARTBEAT_TIMEOUT_MS``; a worker silent that long is dead.
      max_attempts: ``WORKER_MAX_ATTEMPTS``.
      dead_message_ttl_ms: how long dead letters are kept (default 14 days; the worker
        passes ``DLQ_RETENTION_DAYS``).
      interval_s: seconds between passes (default: a fifth of the heartbeat timeout, at most 5).
      pool: ``WORKER_POOL``, ``concurrency``: ``WORKER_CONCURRENCY`` and ``prefetch``, for
        the process record (default: none given).
      lifecycle: where the handlers' ``checkpoint(progress, note)`` land (default: this
        process's).

    Each pass also adds the jobs that ended since the last one (done, failed) and the oldest
    due age of each queue to that minute's activity (:func:`.layout.record_activity`, kept
    an hour): the console charts it.

    With each heartbeat the process publishes its record (:func:`.layout.process_key`):
    its pool, host, pid, queues, concurrency, prefetch, how often it beats, and each job it
    runs now (queue, ids, actor, its start by Redis's clock, and the progress and note its
    handler last gave ``checkpoint()``), kept one heartbeat timeout; ``status`` and the
    console read it, from Redis alone, and drop a job whose delivery was settled since (it
    is no longer in the process's acks set). The running jobs are tracked here, in memory,
    per handler thread. A process that drained forgets itself on its way out
    (:func:`.layout.forget_idle`): ``status`` no longer lists it, at once.

    Dead letters are kept for days: a pass drops the expired ones at most every
    :data:`EXPIRE_EVERY_S` (an idle worker's Redis calls grow with its queues otherwise).

    Each heartbeat is timed for the broker's :class:`..holds.HoldWatch`. After a gap (the
    process was stopped or frozen for half the heartbeat timeout), a pass asks Redis
    whether the jobs running here are still held, and stops each one that is not with
    :class:`..lifecycle.Lost` (another worker recovered it; it runs there).
    """

    #: Seconds between two passes that drop expired dead letters (the first pass does).
    EXPIRE_EVERY_S = 60.0

    def __init__(
        self,
        queues: list[str],
        heartbeat_timeout_ms: int,
        max_attempts: int,
        dead_message_ttl_ms: int = 14 * 86_400_000,
        interval_s: float | None = None,
        pool: str = "",
        concurrency: int = 0,
        prefetch: int = 0,
        lifecycle: Lifecycle = LIFECYCLE,
    ) -> None:
        self.queues = queues
        self.pool = pool
        self.concurrency = concurrency
        self.prefetch = prefetch
        self.lifecycle = lifecycle
        #: The jobs running now: handler thread id -> what the record says of the job.
        self.running: dict[int, dict[str, Any]] = {}
        self._started_ms = 0
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.max_attempts = max_attempts
        self.dead_message_ttl_ms = dead_message_ttl_ms
        self.interval_s = interval_s or min(HEARTBEAT_INTERVAL_MAX_S, heartbeat_timeout_ms / 5000)
        self._stopped = threading.Event()
        #: Jobs ended since the last pass, per (queue, "done" or "failed"): the pass adds
        #: them to the queue's activity of the minute (:func:`.layout.record_activity`).
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._counted = threading.Lock()
        self._activity_at = -ACTIVITY_IDLE_EVERY_S
        #: Set when a job starts: its record is published before the next pass is due.
        self._changed = threading.Event()
        self._expired_at: float | None = None
        #: The :attr:`..holds.HoldWatch.epoch` the last pass saw.
        self._epoch = 0
        #: The thread of the passes, once the worker has booted.
        self.thread: threading.Thread | None = None

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self.running[threading.get_ident()] = {
            "queue": message.queue_name,
            "redis_id": message.options.get(REDIS_MESSAGE_ID, ""),
            "message_id": message.message_id,
            "actor": message.actor_name,
            "started_ms": self._redis_ms(broker),
            "slot": self.lifecycle.current_slot(),
        }
        if not self._changed.is_set():  # set: its clear comes before the record is read
            self._changed.set()

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self.running.pop(threading.get_ident(), None)
        if isinstance(exception, Requeue | Cancelled | Lost):
            return  # not a job's end: stopped by a shutdown, a cancel, another's recovery
        outcome = "done" if exception is None else "failed"
        with self._counted:
            self._counts[(layout.canonical(message.queue_name), outcome)] += 1

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self.running.pop(threading.get_ident(), None)

    @staticmethod
    def _redis_ms(broker: Broker) -> int:
        """Now by Redis's clock, as of the last heartbeat (this host's clock corrected)."""
        return int(time.time() * 1000) + int(getattr(broker, "clock_offset_ms", 0))

    def record(self, broker: Broker) -> bytes:
        """The process record the heartbeat publishes (JSON)."""
        return json.dumps(
            {
                "pool": self.pool,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "queues": self.queues,
                "concurrency": self.concurrency,
                "prefetch": self.prefetch,
                "beat_every_ms": round(self.interval_s * 1000),
                "started_ms": self._started_ms,
                "jobs": [self._job(job) for job in list(self.running.values())],
            }
        ).encode()

    def _job(self, job: dict[str, Any]) -> dict[str, Any]:
        """A running job as the record shows it: its slot's last ``checkpoint()`` report."""
        shown = {key: value for key, value in job.items() if key != "slot"}
        report = self.lifecycle.report_of(job.get("slot"))
        if report is not None:
            shown["progress"], shown["note"] = report
        return shown

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        self._started_ms = self._redis_ms(broker)
        self.thread = threading.Thread(
            target=self._loop, args=(broker,), name="recovery", daemon=True
        )
        self.thread.start()

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        """Stop the passes; once the last one ended, forget this process in Redis if it
        holds nothing (the drain handed everything back): ``status`` drops it at once
        instead of listing it until its record expires."""
        self._stopped.set()
        self._changed.set()
        if self.thread is not None:
            self.thread.join(timeout=FORGET_WAIT_S)
            if self.thread.is_alive():  # a pass is stuck on Redis: the record expires
                return
        client: redis.Redis = broker.client  # type: ignore[attr-defined]
        try:
            layout.forget_idle(client, broker.broker_id, self.queues)  # type: ignore[attr-defined]
        except redis.RedisError as error:
            logger.warning("could not remove this process's record: %s", error)

    def run_once(self, broker: Broker) -> None:
        client: redis.Redis = broker.client  # type: ignore[attr-defined]
        sent = time.monotonic()
        beats = recovery.heartbeat(
            client,
            broker.broker_id,  # type: ignore[attr-defined]
            self.queues,
            self.record(broker),
            self.heartbeat_timeout_ms,
        )
        holds: HoldWatch | None = getattr(broker, "holds", None)
        if holds is not None:
            holds.beat(sent, time.monotonic())
        settling = cast(SettlingBroker, broker)
        settling.keep_time(min(now for now, _ in beats.values()))
        if holds is not None and holds.epoch != self._epoch:
            self._epoch = holds.epoch
            self.stop_lost(settling)
        settling.observe_epochs({namespace: epoch for namespace, (_, epoch) in beats.items()})
        recovery.recover_dead_workers(
            client, self.queues, self.heartbeat_timeout_ms, self.max_attempts
        )
        now = time.monotonic()
        if self._expired_at is None or now - self._expired_at >= self.EXPIRE_EVERY_S:
            recovery.expire_dead_letters(client, self.queues, self.dead_message_ttl_ms)
            self._expired_at = now
        settling.reclaim_orphans(now)
        self.record_activity(client, min(now for now, _ in beats.values()))

    def record_activity(self, client: redis.Redis, now_ms: int) -> None:
        """Add the jobs ended since the last pass, and the oldest due age of each queue, to
        this minute's activity (the console's charts of the last hour): at each pass that
        saw jobs end, else once a minute (an idle process costs two calls a minute); counts
        a call that fails keeps for the next pass. A full Redis refuses the write: the counts
        wait for room (readiness and ``broker_full`` already say full), and the pass, whose
        recovery ran before, is not failed by a chart."""
        idle_since = time.monotonic() - self._activity_at
        with self._counted:
            if not self._counts and idle_since < ACTIVITY_IDLE_EVERY_S:
                return
            counts, self._counts = self._counts, collections.Counter()
        self._activity_at = time.monotonic()
        try:
            backlog = read_backlog(client, self.queues, now=now_ms / 1000)
            activity = {
                each.queue: (
                    counts[(each.queue, "done")],
                    counts[(each.queue, "failed")],
                    round(max(each.oldest_s, each.delayed_overdue_s) * 1000),
                )
                for each in backlog
            }
            layout.record_activity(client, now_ms, activity)
        except redis.RedisError as error:
            with self._counted:
                self._counts.update(counts)
            if not is_oom(error):
                raise

    def stop_lost(self, broker: SettlingBroker) -> int:
        """Stop each job running here whose message this worker no longer holds (raise
        :class:`..lifecycle.Lost` in its thread); return how many."""
        running = list(self.running.items())
        held = broker.still_holds([(job["queue"], job["redis_id"]) for _, job in running])
        lost = [
            (thread_id, job)
            for (thread_id, job), kept in zip(running, held, strict=True)
            if not kept and self.running.get(thread_id) is job  # still that job
        ]
        for thread_id, _ in lost:
            raise_thread_exception(thread_id, Lost)
        if lost:
            logger.warning(
                "stopped jobs this worker no longer holds: it was stopped or frozen past "
                "WORKER_HEARTBEAT_TIMEOUT_MS and another worker recovered them",
                extra={"job_ids": [job["message_id"] for _, job in lost]},
            )
        return len(lost)

    def _loop(self, broker: Broker) -> None:
        outage: Outage | None = getattr(broker, "outage", None)  # says Redis unreachable
        while not self._stopped.is_set():
            try:
                self.run_once(broker)
            except redis.RedisError as error:
                if outage is not None and unreachable(error):
                    outage.failed(error)  # once, then a line a minute
                else:
                    logger.warning("recovery pass failed: %s", error)
            except Exception:  # a background thread never dies: one JSON line, then go on
                logger.exception("recovery pass failed unexpectedly")
            else:
                if outage is not None:
                    outage.answered()
            self._until_next_pass(broker)

    def _until_next_pass(self, broker: Broker) -> None:
        """Wait for the next pass; a job that starts meanwhile is published with the
        process record (one heartbeat call) within :data:`RECORD_EVERY_S`, so ``status``
        shows it without waiting for the pass."""
        due = time.monotonic() + self.interval_s
        while not self._stopped.is_set():
            left = due - time.monotonic()
            if left <= 0 or not self._changed.wait(left) or self._stopped.is_set():
                return
            self._changed.clear()
            try:
                recovery.heartbeat(
                    broker.client,  # type: ignore[attr-defined]
                    broker.broker_id,  # type: ignore[attr-defined]
                    self.queues,
                    self.record(broker),
                    self.heartbeat_timeout_ms,
                )
            except redis.RedisError:
                return  # the pass says it
            self._stopped.wait(min(RECORD_EVERY_S, max(0.0, due - time.monotonic())))
