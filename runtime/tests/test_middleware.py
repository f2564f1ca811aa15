"""The middleware on Dramatiq's StubBroker, as Dramatiq tests its own: fast, no Redis.

The real-process suite (template tests) stays the proof; these give a middleware
change feedback in seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dramatiq
import pytest
from dramatiq import Worker
from dramatiq.brokers.stub import StubBroker

from worker_runtime.boards import ProgressBoard, read_boards
from worker_runtime.lifecycle import Lifecycle, Requeue
from worker_runtime.middleware import GracefulShutdown, ProgressRecorder
from worker_runtime.middleware.attempts import SuspectGate
from worker_runtime.settlement import ACK, REQUEUE

from stub_brokers import SettlingStubBroker


def run_worker(broker: StubBroker, queue: str, threads: int = 1) -> Iterator[Worker]:
    worker = Worker(broker, worker_timeout=20, worker_threads=threads)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def lifecycle(tmp_path: Path) -> Iterator[Lifecycle]:
    process = Lifecycle()
    board = ProgressBoard(tmp_path, slots=1, broker_id="stub")
    process.attach(board)
    yield process
    board.close()


def test_progress_marks_the_slot_busy_while_a_job_runs(
    lifecycle: Lifecycle, tmp_path: Path
) -> None:
    broker = StubBroker(middleware=[ProgressRecorder(lifecycle)])
    seen: list[float] = []

    @dramatiq.actor(broker=broker)
    def job() -> None:
        (snapshot,) = read_boards(tmp_path)
        seen.append(snapshot.slots[0].job_started)
        lifecycle.checkpoint()

    job.send()
    for _ in run_worker(broker, job.queue_name):
        broker.join(job.queue_name, timeout=5000)
    (snapshot,) = read_boards(tmp_path)
    assert seen and seen[0] > 0, "the job's slot was busy while it ran"
    assert snapshot.slots[0].job_started == 0, "idle again after the job"
    assert snapshot.slots[0].last_progress >= seen[0]


def test_checkpoint_raises_requeue_once_shutdown_is_requested(lifecycle: Lifecycle) -> None:
    lifecycle.checkpoint()
    lifecycle.request_shutdown()
    assert lifecycle.shutdown_requested()
    with pytest.raises(Requeue):
        lifecycle.checkpoint()


def test_graceful_shutdown_interrupts_in_flight_handlers_and_requeues_them() -> None:
    shutdown = GracefulShutdown()
    broker = SettlingStubBroker(middleware=[shutdown])
    started = threading.Event()

    @dramatiq.actor(broker=broker)
    def endless() -> None:
        started.set()
        while True:
            time.sleep(0.01)

    endless_id = endless.send().message_id
    for _ in run_worker(broker, endless.queue_name):
        assert started.wait(5)
        assert shutdown.in_flight == 1
        assert shutdown.interrupt() == 1
        deadline = time.monotonic() + 5
        while shutdown.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
    assert shutdown.in_flight == 0
    assert (shutdown.requeued, shutdown.finished) == (1, 0)
    assert broker.settled == [(endless.queue_name, endless_id, REQUEUE)]


def test_graceful_shutdown_counts_finished_jobs() -> None:
    shutdown = GracefulShutdown()
    broker = SettlingStubBroker(middleware=[shutdown])

    @dramatiq.actor(broker=broker)
    def quick() -> None: ...

    for _ in range(3):
        quick.send()
    for _ in run_worker(broker, quick.queue_name):
        broker.join(quick.queue_name, timeout=5000)
    assert (shutdown.finished, shutdown.requeued, shutdown.in_flight) == (3, 0, 0)
    assert broker.settlements() == [ACK] * 3


def test_suspect_gate_runs_a_suspect_alone() -> None:
    gate = SuspectGate()
    assert gate.enter(False, lambda: False)
    blocked = threading.Event()

    def suspect() -> None:
        assert gate.enter(True, lambda: False)
        blocked.set()
        gate.leave()

    thread = threading.Thread(target=suspect)
    thread.start()
    assert not blocked.wait(0.3), "the suspect ran beside an ordinary handler"
    assert not gate.enter(False, lambda: True), "no new handler starts while a suspect waits"
    gate.leave()
    thread.join(5)
    assert blocked.is_set()


def test_attempts_skips_a_message_whose_deliveries_are_used_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker_runtime.middleware import attempts

    dead: list[str] = []
    monkeypatch.setattr(
        attempts, "dead_letter_delivery", lambda broker, message, reason: dead.append(reason)
    )
    broker = StubBroker(middleware=[attempts.Attempts(max_attempts=3)])
    ran: list[str] = []

    @dramatiq.actor(broker=broker)
    def job(name: str) -> None:
        ran.append(name)

    job.send_with_options(args=("fresh",), retries=1, crashes=1)
    job.send_with_options(args=("spent",), retries=2, crashes=1)
    for _ in run_worker(broker, job.queue_name):
        broker.join(job.queue_name, timeout=5000)
    assert ran == ["fresh"]
    assert dead == ["3 deliveries used up WORKER_MAX_ATTEMPTS=3"]
