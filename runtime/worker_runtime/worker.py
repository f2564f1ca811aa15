"""One worker process: Dramatiq's Worker with our drain.

On the first SIGTERM or SIGINT the process stops fetching at once, hands its
prefetched messages back, lets in-flight handlers finish within
``WORKER_SHUTDOWN_TIMEOUT_MS``, then interrupts whatever still runs (its message
is requeued, not failed), requeues anything still held in its acks sets, closes
the database pool and the broker, logs a drain summary and exits 0. A second
signal, at least a second after the first, closes the drain window at once.

A handler thread abandoned past its time limit (:mod:`.overrun`: the time-limit middleware
sends the process SIGTERM) is not waited for: its job is charged as a time limit
(:func:`.recovery.charge_time_limit`) and the process exits ``EX_REPLACE`` once the others
are drained; the supervisor starts another at once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import iter_queue
from dramatiq.errors import BrokerConnectionError

from . import accounting as recovery
from . import layout
from .boards import ProgressBoard, StateDirError
from .exitcodes import EX_OK, EX_REPLACE
from .lifecycle import LIFECYCLE, Lifecycle
from .middleware import CappedTimeLimit, GracefulShutdown
from .outage import ConsumerNoise
from .parentdeath import die_with_parent
from .redisbroker import SettlingRedisBroker
from .settings import WorkerSettings, refuse
from .stopsignals import StopSignals
from .timing import CONSUMER_STOP_S, DRAIN_REDIS_TIMEOUT_S, INTERRUPT_GRACE_S

logger = logging.getLogger(__name__)
#: How long a drain step waits on one thread before it looks at the others and ticks.
JOIN_POLL_S = 0.05
#: Seconds between two ticks of the main loop on the progress board (liveness reads them).
TICK_INTERVAL_S = 1.0
#: Longest pause (ms) of a handler thread between looks at the work queue, and of a
#: consumer waiting for a free slot (Dramatiq's ``worker_timeout``; its 1000 ms default slows
#: an idle drain to more than a second). An empty queue is polled every
#: :data:`.consumer.IDLE_POLL_MS` at most instead (1 s, as Dramatiq does), and an enqueue or
#: the drain wakes its consumer at once; a busy consumer does not poll: a settled delivery
#: wakes it to fill the freed slot (:mod:`.consumer`). Prefetch is
#: ``WORKER_PREFETCH`` (default: the concurrency), not Dramatiq's twice the threads, so no
#: message waits behind a long job in a busy process.
FETCH_TIMEOUT_MS = 200


def _join(
    threads: Iterable[threading.Thread],
    deadline: float,
    stop: Callable[[], bool],
    board: ProgressBoard,
    given_up: Callable[[threading.Thread], bool] = lambda thread: False,
) -> bool:
    """Wait until ``threads`` end (or are ``given_up``), ``deadline`` passes or ``stop()`` is
    true; True if all ended."""
    pending = [thread for thread in threads if thread.is_alive() and not given_up(thread)]
    while pending and time.monotonic() < deadline and not stop():
        pending[0].join(timeout=JOIN_POLL_S)
        pending = [thread for thread in pending if thread.is_alive() and not given_up(thread)]
        board.tick()
    return not pending


def _unless_redis_down(step: Callable[[], int], what: str) -> int:
    """Run a drain step that talks to Redis; while Redis is unreachable, log one line and
    go on: the messages stay in this worker's acks sets, and another worker recovers them
    once this worker's heartbeat is older than ``WORKER_HEARTBEAT_TIMEOUT_MS``."""
    moved = 0
    try:
        moved = step()
    except (redis.RedisError, BrokerConnectionError) as error:  # the consumer's hand-back
        logger.warning(
            f"drain: could not {what} held messages, Redis is unreachable; they are recovered "
            "after WORKER_HEARTBEAT_TIMEOUT_MS",
            extra={"error": f"{type(error).__name__}: {error}"},
        )
    return moved


def exit_past_threads_left_behind(code: int) -> None:
    """Exit now with ``code`` when a handler left a non-daemon thread running: the drain is
    over, and the interpreter's exit would wait for that thread (until the supervisor kills
    the process at the end of its window). Says which threads were left, runs the exit
    handlers (``atexit``: logging's flush, the tracer's export), flushes stdio, ``_exit``.
    Returns (the exit goes the usual way) when no such thread runs."""
    left = [
        thread
        for thread in threading.enumerate()
        if thread is not threading.main_thread() and not thread.daemon and thread.is_alive()
    ]
    if not left:
        return
    logger.warning(
        "exiting past %d non-daemon thread(s) a handler left running (the drain is over)",
        len(left),
        extra={"event": "threads_left_behind", "threads": [thread.name for thread in left]},
    )
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class WorkerProcess:
    """Runs the pool's queues in this process until SIGTERM, then drains.

    Parameters:
      settings: the validated settings (queues, concurrency, timeouts).
      broker: the broker with the whole middleware stack (:func:`.broker.build_broker`).
      shutdown: the broker's :class:`.GracefulShutdown`, which knows the handlers in flight.
      lifecycle: the shutdown flag and progress board the handlers and the ProgressRecorder
        middleware share (default: this process's).
      load_actors: declares the actors on ``broker``; called once the process has booted.
      time_limit: the broker's :class:`.CappedTimeLimit`, which lists the handler threads
        it abandoned (None: none are).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        broker: SettlingRedisBroker,
        shutdown: GracefulShutdown,
        lifecycle: Lifecycle = LIFECYCLE,
        load_actors: Callable[[], object] = lambda: None,
        time_limit: CappedTimeLimit | None = None,
    ) -> None:
        self.settings = settings
        self.time_limit = time_limit
        self.broker = broker
        self.shutdown = shutdown
        self.lifecycle = lifecycle
        self.load_actors = load_actors
        self.signals = StopSignals()

    def run(self) -> int:
        die_with_parent()
        self.signals.install()
        broker = self.broker
        broker.emit_after("process_boot")  # as Dramatiq's CLI: starts the time-limit watchdog
        self.load_actors()

        try:
            board = ProgressBoard(
                self.settings.worker_state_dir, self.settings.worker_concurrency, broker.broker_id
            )
        except StateDirError as error:  # full or read-only: a restart would fail the same way
            refuse([str(error)])
        self.lifecycle.attach(board)
        worker = dramatiq.Worker(
            broker,
            queues=set(self.settings.worker_queues),
            worker_threads=self.settings.worker_concurrency,
            worker_timeout=FETCH_TIMEOUT_MS,
        )
        worker.queue_prefetch = self.settings.prefetch
        noise = ConsumerNoise(broker.outage)  # Redis unreachable: one line, not one per 3 s
        for queue in layout.with_delay_queues(self.settings.worker_queues):
            logging.getLogger(ConsumerNoise.logger_name(queue)).addFilter(noise)
        worker.start()
        while not self.signals.wait(TICK_INTERVAL_S):
            board.tick()
        code = self.drain(worker, board)
        exit_past_threads_left_behind(code)
        return code

    def drain(self, worker: dramatiq.Worker, board: ProgressBoard) -> int:
        """Stop fetching, finish or requeue every message this process holds, clean up."""
        broker, shutdown = self.broker, self.shutdown
        started = time.monotonic()
        deadline = started + self.settings.worker_shutdown_timeout_ms / 1000
        finished_before = shutdown.finished
        self.lifecycle.request_shutdown()
        broker.stop_fetching()
        broker.bound_timeouts(DRAIN_REDIS_TIMEOUT_S)
        broker.emit_before("worker_shutdown", worker)
        logger.info("draining", extra={"in_flight": shutdown.in_flight})
        for consumer in worker.consumers.values():
            consumer.stop()
        for thread in worker.workers:
            thread.stop()
        signals = self.signals
        _join(worker.consumers.values(), started + CONSUMER_STOP_S, lambda: signals.hurried, board)
        handed_back = _unless_redis_down(lambda: self._requeue_prefetched(worker), "hand back")

        abandoned = self.time_limit.abandoned if self.time_limit is not None else {}

        def given_up(thread: threading.Thread) -> bool:
            return thread.ident in abandoned

        interrupted = 0
        if not _join(worker.workers, deadline, lambda: signals.hurried, board, given_up):
            interrupted = shutdown.interrupt()
            grace = time.monotonic() + INTERRUPT_GRACE_S
            _join(worker.workers, grace, lambda: False, board, given_up)
        given = list(abandoned.values())
        _unless_redis_down(lambda: self._charge_time_limits(broker, given), "charge")
        swept = _unless_redis_down(lambda: self._sweep(broker), "requeue")
        broker.emit_after("worker_shutdown", worker)
        broker.close()
        board.close()
        logger.info(
            "drained",
            extra={
                "finished": shutdown.finished - finished_before,
                "requeued": shutdown.requeued + handed_back + swept,
                "interrupted": interrupted,
                "abandoned": len(given),
                "elapsed_s": round(time.monotonic() - started, 3),
            },
        )
        return EX_REPLACE if given else EX_OK

    def _charge_time_limits(self, broker: RedisBroker, given: list[tuple[str, str]]) -> int:
        """Charge the jobs of abandoned threads (queue, redis id) as time limits."""
        for queue, redis_id in given:
            recovery.charge_time_limit(
                broker.client, broker.broker_id, queue, redis_id, self.settings.worker_max_attempts
            )
        return len(given)

    def _requeue_prefetched(self, worker: dramatiq.Worker) -> int:
        """Hand the messages waiting in the work queue back to Redis."""
        count = 0
        for item in iter_queue(worker.work_queue):
            worker.consumers[item.message.queue_name].requeue_messages([item.message])
            count += 1
        return count

    def _sweep(self, broker: RedisBroker) -> int:
        """Requeue whatever this process still holds (prefetch caches, stuck handlers)."""
        client: redis.Redis = broker.client
        count = 0
        for queue in layout.with_delay_queues(self.settings.worker_queues):
            held = client.smembers(layout.acks_key(broker.broker_id, queue))
            count += recovery.requeue(
                client, broker.broker_id, queue, [layout.text(h) for h in held]
            )
        return count
