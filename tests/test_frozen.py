"""A worker process stopped past its heartbeat, with real processes and a real Redis: while
it is stopped it is not ready, and once resumed it runs none of the jobs another worker
recovered from it (neither its running jobs, stopped at their next instruction, nor the
ones it had only prefetched), each counted in ``jobs_lost_total``. A process frozen with no
signal, by a C call that holds the interpreter lock, is not ready either."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable

import pytest
from _lifecycle import (
    Jobs,
    Worker,
    get,
    jobs,
    lc_project,
    wait_for,
    workers,
)

pytestmark = pytest.mark.slow
__all__ = ["jobs", "lc_project", "workers"]
HEARTBEAT_TIMEOUT_MS = 3000


def lost_total(worker: Worker) -> float:
    found = re.search(r'^jobs_lost_total\{[^}]*queue="notifications"[^}]*\} (\S+)$',
                      worker.metrics(), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_resumed_worker_runs_none_of_the_jobs_another_recovered_and_was_not_ready(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    env = {"WORKER_HEARTBEAT_TIMEOUT_MS": str(HEARTBEAT_TIMEOUT_MS)}
    ids = jobs.many("lc_checkpoint", 4, 6.0)
    first = workers(WORKER_CONCURRENCY="2", WORKER_PREFETCH="4", **env)
    wait_for(lambda: jobs.started_count() == 2 and not jobs.queued(), 20,
             "two jobs running and two prefetched")
    running = [job_id for job_id in ids if jobs.starts(job_id)]
    prefetched = [job_id for job_id in ids if job_id not in running]
    (child,) = first.children()
    os.kill(child, signal.SIGSTOP)
    try:
        ready = first.healthcheck("ready")
        status, body = get(f"http://127.0.0.1:{first.port}/readyz")
        assert ready.returncode == 1 and "is stopped" in ready.stdout + ready.stderr, ready
        assert status == 503 and f"worker process {child} is stopped" in body, body
        # Another worker recovers the four (each charged as a crash: they then run one at a
        # time there, as suspects) and starts them.
        second = workers(**env)
        wait_for(lambda: "recovered the messages of a dead worker" in second.log(),
                 HEARTBEAT_TIMEOUT_MS / 1000 + 20, "the other worker to recover the four")
        wait_for(lambda: any(len(jobs.starts(job_id)) == 2 for job_id in running)
                 or any(jobs.starts(job_id) for job_id in prefetched), 20,
                 "the other worker to start one")
    finally:
        os.kill(child, signal.SIGCONT)
    wait_for(lambda: all(jobs.dones(job_id) for job_id in ids), 60, "all four to complete")
    wait_for(lambda: lost_total(first) == 4, 10, "the resumed worker to count four lost")
    assert [len(jobs.dones(job_id)) for job_id in ids] == [1, 1, 1, 1], "4 sent, 4 runs"
    assert all(pid != child for job_id in ids for pid, _ in jobs.dones(job_id))
    assert [len(jobs.starts(job_id)) for job_id in prefetched] == [1, 1], "never started twice"
    assert "stopped jobs this worker no longer holds" in first.log()
    wait_for(lambda: first.healthcheck("ready").returncode == 0, 20, "ready once resumed")
    assert not jobs.stranded() and not jobs.queued()


def test_a_process_frozen_by_a_c_call_holding_the_interpreter_is_not_ready(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    """No signal: a catastrophic regular expression holds the interpreter lock, so every
    thread of its process stops (the heartbeat's too) though the process runs. Past half the
    heartbeat timeout its main loop's silence makes the pod not ready, naming the process;
    the supervisor kills it at the job's time limit, and the replaced process is ready."""
    jobs.enqueue("lc_regex", "frozen", 32, time_limit=12_000)
    worker = workers(WORKER_HEARTBEAT_TIMEOUT_MS="4000", WORKER_MAX_ATTEMPTS="1")
    wait_for(lambda: jobs.starts("frozen"), 20, "the regex to start")
    (child,) = worker.children()
    frozen = f"worker process {child} is frozen: main loop silent for"
    wait_for(lambda: (r := get(f"http://127.0.0.1:{worker.port}/readyz"))[0] == 503
             and frozen in r[1], 10, "readiness to fail, naming the frozen process")
    ready = worker.healthcheck("ready")
    assert ready.returncode == 1 and frozen in ready.stdout + ready.stderr, ready
    wait_for(jobs.dead_letters, 40, "the supervisor to end it at its time limit")
    wait_for(lambda: worker.healthcheck("ready").returncode == 0, 30, "ready once replaced")
    assert child not in worker.children()
    assert worker.stop() == 0
