"""Metrics: counts every job's outcome, times it, and logs one JSON line when it ends.

Runs in the worker processes; the supervisor's exporter (:mod:`..exporter`) merges
what they write to ``PROMETHEUS_MULTIPROC_DIR``. The metric objects are created
when the worker boots, in the worker process, never at import, so the folder is
set by then and the supervisor, which imports no actor, creates none.

Outcomes of ``jobs_processed_total{queue,actor,outcome}`` (:data:`..settlement.OUTCOMES`,
decided by :func:`..settlement.job_outcome` after Retries and GracefulShutdown, whose
``after_*`` hooks run before this one):

``success``      the handler returned.
``retry``        the handler raised; a delayed copy will run again.
``failure``      the handler raised an exception listed in the actor's ``throws``, or
                 returned a result that cannot be stored (not JSON): not retried
                 (Dramatiq then keeps the message with the dead letters; it is not
                 counted as ``dead_letter``).
``dead_letter``  the handler raised and its retries are used up, or the message was
                 refused before running (over ``WORKER_MAX_ATTEMPTS``, or past its
                 age limit): it went to the dead letters.
``requeued``     stopped by a shutdown (``lifecycle.Requeue``); back in its queue.
``skipped``      a scheduled run not started: the previous run of its schedule still
                 holds the run lock (:mod:`.schedule_lock`).
``cancelled``    cancelled by ``producer.cancel``: skipped before it ran, or interrupted
                 while running (:mod:`.cancellation`); acked, never retried.

An outcome is counted (and the job's line logged) once Redis holds it, after
Dramatiq's ack or nack succeeded (``after_ack``/``after_nack``): while Redis is
down a failed job's retry is not stored, so it is not counted either.

The job's line is written before the ack's hook returns. The counts, durations and
the in-flight gauge reach the metric files every ``PUBLISH_INTERVAL_S`` (0.5 s), from
one publisher thread: a handler thread only appends to a queue, so the hot path
takes none of prometheus-client's locks (its multiprocess values share one lock per
process, and handler threads waiting on it cost more than the jobs' own work).
Prometheus scrapes every 15 s or more, so the delay does not show; the final
values are published when the worker shuts down, and a process killed outright
(SIGKILL, OOM) loses at most the last interval's counts, not the job lines.

A malformed message (not a Dramatiq message, an unknown actor, no Redis id) is
dead-lettered by the consumer before any handler sees it (the broker signals it to
``after_reject_message``) and counted here as
``dead_letter`` (``actor`` is ``unknown`` when it names no declared actor). A
message whose worker process crashed and that recovery dead-letters never
reaches a handler and is not counted here (``queue_dead_letters`` shows it).
``job_duration_seconds`` observes every run of a handler (not refused messages).

A handler interrupted by its time limit is also counted in
``jobs_time_limit_exceeded_total{queue,actor}`` (:mod:`..overrun`, its owner: a job whose
thread is abandoned, or whose process the supervisor kills, is counted where it is charged).

The metric files are prometheus-client's, mapped into memory; their space is reserved
before a page is used (:class:`ReservedMmapedDict`), so a ``WORKER_STATE_DIR`` filled
while the worker runs drops the samples it has no room for (one log line per file)
instead of killing the process with SIGBUS.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import importlib
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware.time_limit import TimeLimitExceeded
from dramatiq.worker import Worker
from prometheus_client import Counter, Gauge, Histogram, values
from prometheus_client.mmap_dict import MmapedDict

from .. import contract, logs, overrun
from ..layout import DEAD_LETTER_REASON, RETRIES, canonical
from ..settings import database_enabled
from ..settlement import job_outcome, lost_reason, skip_outcome

logger = logging.getLogger(__name__)

#: Seconds-to-minutes jobs: fine below a second, then up to the longest job timeouts.
DURATION_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
#: Outcomes logged at INFO; the others at WARNING.
_ROUTINE = frozenset({"success", "requeued", "skipped", "cancelled"})
#: How often a worker process publishes its recorded jobs, the in-flight gauge and
#: db_pool_in_use / db_pool_size to the metric files.
PUBLISH_INTERVAL_S = 0.5


@dataclass(frozen=True)
class Instruments:
    """The worker process's metric objects (one set per process)."""

    processed: Counter
    duration: Histogram
    inflight: Gauge
    concurrency: Gauge
    lost: Counter
    resets: Counter
    throttled: Counter
    admission_wait: Histogram


@dataclass(frozen=True)
class DbPoolInstruments:
    """The database option's gauges (absent from /metrics without it)."""

    in_use: Gauge
    size: Gauge


class _NoRoomError(Exception):
    """The metric file has no room for a new sample (its space could not be reserved)."""


class ReservedMmapedDict(MmapedDict):
    """prometheus-client's metric file with its space reserved (``posix_fallocate``) before
    it is mapped and each time it grows. Without it the file is sparse: on a full disk the
    first write to a new page kills the process with SIGBUS. A sample that finds no room
    is dropped (reads 0), logged once per file; the samples already mapped go on, and a
    new one is tried again once the file system has room.
    """

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        self._told = False
        self._mapped = False
        if not read_mode:
            try:
                with open(filename, "ab") as file:  # as prometheus-client opens it
                    size = os.fstat(file.fileno()).st_size
                    os.posix_fallocate(file.fileno(), 0, max(size, FIRST_MAP_BYTES))
            except OSError as error:  # no file mapped: every sample of it is dropped
                self._no_room(filename, error)
                self._f, self._fname, self._positions = None, filename, {}  # type: ignore[assignment]
                return
        super().__init__(filename, read_mode)  # type: ignore[no-untyped-call]
        self._mapped = True

    def _init_value(self, key: str) -> None:
        if not self._mapped:
            raise _NoRoomError
        needed = self._used + len(key.encode()) + 32  # length, padding, value, timestamp
        capacity = self._capacity
        while needed > capacity:
            capacity *= 2  # as prometheus-client grows it
        if capacity > self._capacity:
            try:
                os.posix_fallocate(self._f.fileno(), 0, capacity)
            except OSError as error:
                self._no_room(self._fname, error)
                raise _NoRoomError from None
        super()._init_value(key)  # type: ignore[no-untyped-call]

    def read_value(self, key: str) -> tuple[float, float]:
        try:
            value: tuple[float, float] = super().read_value(key)  # type: ignore[no-untyped-call]
        except _NoRoomError:
            return 0.0, 0.0
        return value

    def write_value(self, key: str, value: float, timestamp: float) -> None:
        with contextlib.suppress(_NoRoomError):
            super().write_value(key, value, timestamp)  # type: ignore[no-untyped-call]

    def _no_room(self, filename: str, error: OSError) -> None:
        if not self._told:
            self._told = True
            logger.error(
                "no room for a metric file; its new samples are dropped",
                extra={"event": "state_dir_unwritable", "path": filename, "error": str(error)},
            )


#: Bytes prometheus-client maps when it creates a metric file.
FIRST_MAP_BYTES = 1 << 16
#: The class prometheus-client's multiprocess values open their files with.
values.MmapedDict = ReservedMmapedDict  # type: ignore[attr-defined]
_instruments: Instruments | None = None
_instruments_lock = threading.Lock()


def instruments() -> Instruments:
    """Create the metric objects once per process (after PROMETHEUS_MULTIPROC_DIR is set)."""
    global _instruments
    with _instruments_lock:
        if _instruments is None:
            _instruments = Instruments(
                processed=Counter(
                    contract.JOBS_PROCESSED,
                    "Jobs that ended, by outcome.",
                    ["queue", "actor", "outcome"],
                ),
                duration=Histogram(
                    contract.JOB_DURATION,
                    "Run time of handlers.",
                    ["queue", "actor"],
                    buckets=DURATION_BUCKETS,
                ),
                inflight=Gauge(
                    contract.INFLIGHT_JOBS, "Handlers running now.", multiprocess_mode="livesum"
                ),
                concurrency=Gauge(
                    contract.CONCURRENCY,
                    "Handler threads (processes x WORKER_CONCURRENCY).",
                    multiprocess_mode="livesum",
                ),
                lost=Counter(
                    contract.JOBS_LOST,
                    "Settlements that found their message no longer held (never counted done).",
                    ["queue"],
                ),
                resets=Counter(
                    contract.BROKER_RESETS, "Times this process saw Redis lose its data."
                ),
                throttled=Counter(
                    contract.JOBS_THROTTLED,
                    "Messages a fetch left queued for want of a downstream slot (reason "
                    "budget) or token (rate), or passed over for their key's limit in "
                    "flight (key); a message waiting through several fetches counts at each.",
                    ["queue", "reason"],
                ),
                admission_wait=Histogram(
                    contract.ADMISSION_WAIT,
                    "Seconds from when a job was due (sent, or its eta) to its fetch, on a "
                    "queue under flow control (a downstream's budget or rate, a per-key limit "
                    "or rate): the time a due job waited for admission, its backlog included.",
                    ["queue"],
                    buckets=DURATION_BUCKETS,
                ),
            )
        return _instruments


_db_instruments: DbPoolInstruments | None = None


def db_instruments() -> DbPoolInstruments:
    """Create the database pool gauges once per process."""
    global _db_instruments
    with _instruments_lock:
        if _db_instruments is None:
            _db_instruments = DbPoolInstruments(
                in_use=Gauge(
                    contract.DB_POOL_IN_USE,
                    "Database connections lent to handlers.",
                    multiprocess_mode="livesum",
                ),
                size=Gauge(
                    contract.DB_POOL_SIZE,
                    "Database connections the pools may hold (DB_POOL_SIZE per process).",
                    multiprocess_mode="livesum",
                ),
            )
        return _db_instruments


def observe_all(histogram: Histogram, amounts: list[float]) -> None:
    """``histogram.observe(a)`` for each of ``amounts``, with one write per bucket.

    ``observe`` writes the sum and one bucket per amount, each under the process's
    metric lock; a publication of a few thousand jobs writes each once instead. It
    relies on prometheus-client's Histogram layout (``_upper_bounds``, ``_buckets``,
    ``_sum``, one bucket per bound, an amount counted in the first bound it does not
    exceed); ``test_middleware_metrics`` compares it with ``observe`` on the installed
    release, and any other layout falls back to ``observe``.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for amount in amounts:
            histogram.observe(amount)
        return
    counts = [0] * len(bounds)
    for amount in amounts:
        counts[bisect.bisect_left(bounds, amount)] += 1
    total.inc(math.fsum(amounts))
    for bucket, count in zip(buckets, counts, strict=True):
        if count:
            bucket.inc(count)


#: Attribute of a MessageProxy holding (outcome, duration, queue) between the handler's end and
#: its ack.
_ENDED = "_metrics_ended"


class Metrics(Middleware):
    """Records job outcomes, durations and the in-flight count; logs each job's end.

    Handler threads record into queues; a publisher thread writes them to the
    metric objects every ``publish_interval_s`` (see the module docstring) and
    :meth:`publish` does it at once.

    Parameters:
      concurrency: ``WORKER_CONCURRENCY`` (this process's handler threads).
      database: publish the connection pool's use (default: the database option is on).
      publish_interval_s: seconds between two publications (default ``PUBLISH_INTERVAL_S``).
      queues: the queues served, whose ``jobs_lost_total`` series start at 0 (default none).
    """

    def __init__(
        self,
        concurrency: int,
        database: bool | None = None,
        publish_interval_s: float = PUBLISH_INTERVAL_S,
        queues: Sequence[str] = (),
    ) -> None:
        self.concurrency = concurrency
        self.queues = list(queues)
        self.database = database_enabled() if database is None else database
        self.publish_interval_s = publish_interval_s
        #: Handler thread id -> ``perf_counter()`` when its job started (the jobs in flight).
        self._running: dict[int, float] = {}
        #: Recorded, not yet published: (queue, actor, outcome) and (queue, actor, seconds).
        self._outcomes: collections.deque[tuple[str, str, str]] = collections.deque()
        self._durations: collections.deque[tuple[str, str, float]] = collections.deque()
        #: Recorded, not yet published: (queue, seconds a due job waited for admission).
        self._waits: collections.deque[tuple[str, float]] = collections.deque()
        self._wait_timers: dict[str, Histogram] = {}
        self._children: dict[tuple[str, str, str], Counter] = {}
        self._timers: dict[tuple[str, str], Histogram] = {}
        self._publishing = threading.Lock()
        self._stop = threading.Event()

    # -- boot and shutdown -------------------------------------------------------------------

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        metrics = instruments()
        metrics.concurrency.set(self.concurrency)
        for queue in self.queues:  # a series from 0, so an alert sees its first increase
            metrics.lost.labels(canonical(queue))
        for actor in broker.actors.values():
            if actor.queue_name in self.queues:
                overrun.show_time_limits(canonical(actor.queue_name), actor.actor_name)
        self._stop.clear()
        threading.Thread(target=self._publish_loop, name="metrics", daemon=True).start()

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._stop.set()
        self.publish()

    def _publish_loop(self) -> None:
        while not self._stop.wait(self.publish_interval_s):
            try:
                self.publish()
            except Exception:  # a background thread never dies: one line, then go on
                logger.exception("publishing metrics failed")

    def publish(self) -> None:
        """Write the recorded outcomes, durations and admission waits, the in-flight count
        and (with the database option) the pool's use to the metric objects."""
        with self._publishing:
            metrics = instruments()
            outcomes: collections.Counter[tuple[str, str, str]] = collections.Counter()
            while self._outcomes:
                outcomes[self._outcomes.popleft()] += 1
            for key, count in outcomes.items():
                counter = self._children.get(key)
                if counter is None:
                    counter = self._children[key] = metrics.processed.labels(*key)
                counter.inc(count)
            durations: dict[tuple[str, str], list[float]] = {}
            while self._durations:
                queue, actor, seconds = self._durations.popleft()
                durations.setdefault((queue, actor), []).append(seconds)
            for labels, amounts in durations.items():
                timer = self._timers.get(labels)
                if timer is None:
                    timer = self._timers[labels] = metrics.duration.labels(*labels)
                observe_all(timer, amounts)
            waits: dict[str, list[float]] = {}
            while self._waits:
                queue, seconds = self._waits.popleft()
                waits.setdefault(queue, []).append(seconds)
            for queue, amounts in waits.items():
                timer = self._wait_timers.get(queue)
                if timer is None:
                    timer = self._wait_timers[queue] = metrics.admission_wait.labels(queue)
                observe_all(timer, amounts)
            metrics.inflight.set(len(self._running))
            if self.database:
                self.update_db_pool()

    def update_db_pool(self) -> None:
        """Publish this process's pool size and connections in use (cheap: no I/O)."""
        db = importlib.import_module(f"{__package__.rpartition('.')[0]}.db")  # database option

        try:
            pool = db.pool()
        except RuntimeError:
            return
        stats = pool.get_stats()
        gauges = db_instruments()
        gauges.size.set(pool.max_size)
        gauges.in_use.set(stats.get("pool_size", 0) - stats.get("pool_available", 0))

    # -- per message (handler threads: no lock, no I/O) ----------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self._running[threading.get_ident()] = time.perf_counter()

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self._end(broker, message, self._outcome(broker, message, exception), ran=True)
        if isinstance(exception, TimeLimitExceeded):  # given up or killed: counted where charged
            overrun.count_time_limit(canonical(message.queue_name), message.actor_name)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._end(broker, message, skip_outcome(message), ran=False)

    @staticmethod
    def _outcome(broker: Broker, message: MessageProxy, exception: BaseException | None) -> str:
        return job_outcome(broker, message, exception)

    def _end(self, broker: Broker, message: MessageProxy, outcome: str, *, ran: bool) -> None:
        """The handler is done: time it now, count and log its outcome once it is settled."""
        started = self._running.pop(threading.get_ident(), None)
        duration = 0.0
        queue = canonical(message.queue_name)
        if started is not None:
            duration = time.perf_counter() - started
            if ran:
                self._durations.append((queue, message.actor_name, duration))
        setattr(message, _ENDED, (outcome, duration, queue))

    # -- once the outcome is stored (Dramatiq's ack or nack succeeded) ------------------------

    def after_ack(self, broker: Broker, message: MessageProxy) -> None:
        """Count and log the job's outcome now that Redis holds it: a retry is counted only
        once its copy is stored, so a retry lost to an outage would never be counted."""
        ended: tuple[str, float, str] | None = getattr(message, _ENDED, None)
        if ended is None:  # not a handled job (e.g. a delayed message moved to its queue)
            return
        delattr(message, _ENDED)
        outcome, duration, queue = ended
        actor = message.actor_name
        lost = lost_reason(message)
        if lost is not None:
            self._lose(message, queue, outcome, duration, lost)
            return
        self.count(queue, actor, outcome)
        record = {
            "event": "job_end",
            "job_id": message.message_id,
            "queue": queue,
            "actor": actor,
            "outcome": outcome,
            "duration_s": round(duration, 6),
            "retries": message.options.get(RETRIES, 0),
        }
        if reason := message.options.get(DEAD_LETTER_REASON):  # dead-lettered: why, said once
            record["reason"] = reason
        logs.event(
            logger,
            logging.INFO if outcome in _ROUTINE else logging.WARNING,
            "job %s",
            (outcome,),
            record,
        )

    after_nack = after_ack

    def _lose(
        self, message: MessageProxy, queue: str, outcome: str, duration: float, reason: str
    ) -> None:
        """Its settlement found the message no longer held: count ``jobs_lost_total`` and log
        it as ``lost`` (with what the handler's outcome would have been), never as done."""
        instruments().lost.labels(queue).inc()
        logs.event(
            logger,
            logging.ERROR,
            "job lost: %s",
            (reason,),
            {
                "event": "job_end",
                "job_id": message.message_id,
                "queue": queue,
                "actor": message.actor_name,
                "outcome": "lost",
                "handler_outcome": outcome,
                "reason": reason,
                "duration_s": round(duration, 6),
            },
        )

    def after_broker_reset(self, broker: Broker, cause: str) -> None:
        """The broker saw Redis lose its data (:data:`..settlement.RESET_SIGNAL`; the broker
        logs it): count ``broker_resets_total``."""
        instruments().resets.inc()

    def after_throttle(self, broker: Broker, queue: str, reason: str, count: int) -> None:
        """A fetch left ``count`` messages of ``queue`` queued (the broker's
        :data:`..settlement.THROTTLE_SIGNAL`): count ``jobs_throttled_total{queue,reason}``
        (at most a fetch per poll: not the hot path)."""
        instruments().throttled.labels(queue, reason).inc(count)

    def after_admission(self, broker: Broker, queue: str, waited_s: float) -> None:
        """A fetch admitted a message of ``queue``, a queue under flow control, ``waited_s``
        after it was due (the broker's :data:`..settlement.ADMISSION_SIGNAL`): recorded for
        ``job_admission_wait_seconds{queue}``, published with the durations."""
        self._waits.append((queue, waited_s))

    def after_reject_message(self, broker: Broker, queue: str, actor: str, *, reason: str) -> None:
        """A malformed message was dead-lettered before any handler saw it (the broker's
        :data:`..settlement.REJECT_SIGNAL`): count it as ``dead_letter`` (the consumer logs it)."""
        self.count(queue, actor, "dead_letter")

    def count(self, queue: str, actor: str, outcome: str) -> None:
        """Add one to ``jobs_processed_total{queue,actor,outcome}`` at the next publication
        (O(1), no lock, no I/O)."""
        self._outcomes.append((queue, actor, outcome))
