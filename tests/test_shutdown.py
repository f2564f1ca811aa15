"""Graceful shutdown, proved with real worker processes and a real redis-server.

SIGTERM stops fetching, lets in-flight handlers finish within the drain window,
requeues everything else uncounted (never a retry, never stranded in an acks
set), and exits 0; a second signal or the end of the window interrupts and
requeues; a handler stopped at ``checkpoint()`` is requeued.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable

import pytest
from _lifecycle import Jobs, Worker, jobs, lc_project, wait_for, wait_ready, workers

pytestmark = pytest.mark.slow
__all__ = ["jobs", "lc_project", "workers"]


def drained_line(worker: Worker) -> dict[str, object]:
    """The worker process's drain summary log line."""
    for line in worker.log().splitlines():
        if line.startswith("{") and json.loads(line).get("msg") == "drained":
            return dict(json.loads(line))
    raise AssertionError(f"no drain summary in the log:\n{worker.log()}")


@pytest.mark.parametrize("round_", range(5))
def test_sigterm_under_load_loses_nothing_and_runs_nothing_twice(
        workers: Callable[..., Worker], jobs: Jobs, round_: int) -> None:
    ids = jobs.many("lc_sleep", 40, 1.0)
    first = workers()
    wait_for(lambda: jobs.started_count() >= 1, 20, "the first job to start")
    time.sleep(1.5)
    sent = time.time()
    first.signal(signal.SIGTERM)
    assert first.wait(timeout=10) == 0, first.log()
    drain = time.monotonic() - first.signalled_at
    assert drain < 1.0 + 1.0, f"drain took {drain:.2f} s for jobs of 1 s"

    done, queued = jobs.assert_exactly_once_or_queued(ids)
    assert done + queued == 40 and done >= 4 and queued >= 1
    assert jobs.delayed() == 0
    finished_in_drain = sum(1 for job_id in ids for _, stamp in jobs.dones(job_id) if stamp > sent)
    summary = drained_line(first)
    assert summary["finished"] == finished_in_drain and summary["interrupted"] == 0

    workers(WORKER_CONCURRENCY="16")
    wait_for(lambda: jobs.done_count() == 40, 30, "the second worker to finish the rest")
    for job_id in ids:
        assert len(jobs.dones(job_id)) == 1, job_id
    assert not jobs.queued_ids()


def test_drain_waits_only_for_the_longest_remaining_job(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    durations = (1.5, 2.5, 3.0, 3.5)
    for index, seconds in enumerate(durations):
        jobs.enqueue("lc_sleep", f"j{index}", seconds)
    worker = workers()
    wait_for(lambda: jobs.started_count() == 4, 20, "four jobs to start")
    time.sleep(0.5)
    sent = time.time()
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=10) == 0
    elapsed = time.monotonic() - worker.signalled_at
    ends = [jobs.starts(f"j{index}")[0][1] + seconds for index, seconds in enumerate(durations)]
    remaining = max(ends) - sent
    assert elapsed <= remaining + 1.0, f"drain {elapsed:.2f} s, longest remaining {remaining:.2f}"
    assert jobs.done_count() == 4


def test_idle_worker_exits_within_two_seconds(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    worker = workers()
    wait_ready(jobs)
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=10) == 0
    assert time.monotonic() - worker.signalled_at < 2.0
    assert not jobs.stranded()


def test_second_term_shortens_the_drain_and_strands_nothing(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    ids = jobs.many("lc_long", 8, 30.0)
    worker = workers()
    wait_for(lambda: jobs.started_count() == 4, 20, "four jobs to start")
    worker.signal(signal.SIGTERM)
    time.sleep(1.2)
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=10) == 0
    elapsed = time.monotonic() - worker.signalled_at
    assert elapsed < 3.0, f"the second TERM took {elapsed:.2f} s to end the drain"
    done, queued = jobs.assert_exactly_once_or_queued(ids)
    assert (done, queued) == (0, 8)
    assert jobs.delayed() == 0
    for message in jobs.queued():
        assert "retries" not in message.options and "crashes" not in message.options
    assert drained_line(worker)["interrupted"] == 4


def test_term_to_the_whole_process_group_is_one_signal(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    ids = jobs.many("lc_sleep", 12, 1.5)
    worker = workers()
    wait_for(lambda: jobs.started_count() == 4, 20, "four jobs to start")
    worker.signal(signal.SIGTERM, group=True)
    assert worker.wait(timeout=10) == 0, worker.log()
    done, queued = jobs.assert_exactly_once_or_queued(ids)
    assert done == 4 and queued == 8, "the in-flight jobs finish: a group TERM is no hurry"
    assert jobs.delayed() == 0


def test_job_outliving_the_window_is_interrupted_and_requeued_not_retried(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    # The job time limit (1 s) fires inside the drain window (1.5 s) for any job that can
    # be interrupted, so a job outlives the window only by ignoring its time limit.
    jobs.enqueue("lc_stubborn", "long", 30.0)
    worker = workers(WORKER_JOB_TIMEOUT_MS="1000", WORKER_SHUTDOWN_TIMEOUT_MS="1500")
    wait_for(lambda: jobs.started_count() == 1, 20, "the job to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=10) == 0, worker.log()
    elapsed = time.monotonic() - worker.signalled_at
    assert 1.4 <= elapsed < 3.0, f"drain took {elapsed:.2f} s with a 1.5 s window"
    assert jobs.assert_exactly_once_or_queued(["long"]) == (0, 1)
    (message,) = jobs.queued()
    assert "retries" not in message.options and "crashes" not in message.options
    assert jobs.delayed() == 0 and not jobs.dead_letters()
    summary = drained_line(worker)
    assert summary["interrupted"] == 1 and summary["requeued"] == 1


def test_handler_blocked_in_c_is_requeued_when_the_window_closes(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    jobs.enqueue("lc_block", "blocked", 30.0)
    worker = workers(WORKER_JOB_TIMEOUT_MS="1000", WORKER_SHUTDOWN_TIMEOUT_MS="1500")
    wait_for(lambda: jobs.started_count() == 1, 20, "the job to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=15) == 0, worker.log()
    assert time.monotonic() - worker.signalled_at < 6.0
    assert jobs.assert_exactly_once_or_queued(["blocked"]) == (0, 1)
    assert jobs.delayed() == 0


def test_handler_stopped_at_checkpoint_is_requeued(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    ids = jobs.many("lc_checkpoint", 2, 30.0)
    worker = workers()
    wait_for(lambda: jobs.started_count() == 2, 20, "the jobs to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=10) == 0, worker.log()
    assert time.monotonic() - worker.signalled_at < 1.5, "checkpoint() stops a handler at once"
    assert jobs.assert_exactly_once_or_queued(ids) == (0, 2)
    for message in jobs.queued():
        assert "retries" not in message.options
    assert jobs.delayed() == 0
    summary = drained_line(worker)
    assert summary["requeued"] == 2 and summary["interrupted"] == 0

    workers(WORKER_CONCURRENCY="2")
    wait_for(lambda: all(len(jobs.starts(job_id)) == 2 for job_id in ids), 20,
             "the requeued jobs to run again")
