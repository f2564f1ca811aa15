"""The edges of the drain, with real worker processes and a real redis-server.

* Redis blackholed (:mod:`blackhole`: a loopback proxy that stops forwarding) while four jobs
  run: SIGTERM still ends the worker within its drain window, exit 0 (every Redis call of
  the drain is bounded), and what it could not settle stays held in Redis: once the path
  heals, another worker recovers it and every job is done (nothing lost).
* A handler that leaves a non-daemon thread running: the drain finishes and the process
  exits at once, exit 0, saying which thread it left (no kill at the end of the window).
* A handler that closes file descriptors 1 and 2: the worker's log lines keep reaching its
  log (the worker writes through descriptors of its own), none goes into a file opened
  later (a Redis connection: Redis sees no protocol error), and the metrics count every job.

The test actors record their starts and ends to ``RECORD_URL`` (Redis itself), not through
the path under test.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _lifecycle import (
    DRAIN_WINDOW_S,
    Jobs,
    Worker,
    jobs,
    lc_project,
    make_test_project,
    wait_for,
    wait_ready,
)
from bakery import RedisServer
from blackhole import Blackhole

pytestmark = pytest.mark.slow
__all__ = ["jobs", "lc_project"]

EDGE_ACTORS = '''\
"""Actors of the drain-edge tests: each records its starts and ends to RECORD_URL."""

from __future__ import annotations

import os
import threading
import time

import dramatiq
import redis

_client = redis.Redis.from_url(os.environ["RECORD_URL"])


def _record(kind: str, job_id: str) -> None:
    _client.rpush(f"test:{kind}:{job_id}", f"{os.getpid()} {time.time()}")


@dramatiq.actor(queue_name="notifications", max_retries=4)
def edge_sleep(job_id: str, seconds: float) -> None:
    _record("start", job_id)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", max_retries=4)
def edge_thread(job_id: str) -> None:
    """Leaves a non-daemon thread behind that would hold an interpreter's exit 10 min."""
    _record("start", job_id)
    threading.Thread(target=time.sleep, args=(600,), name="left-behind", daemon=False).start()
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", max_retries=4)
def edge_close_stdio(job_id: str) -> None:
    """Closes the process's standard output and error."""
    _record("start", job_id)
    os.close(1)
    os.close(2)
    _record("done", job_id)
'''

#: Heartbeat timeout of these workers: a blackholed worker's messages are recovered soon.
HEARTBEAT_TIMEOUT_MS = "4000"


@pytest.fixture(scope="module")
def edge_project(lc_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_project(lc_project, tmp_path_factory.mktemp("edges") / lc_project.name,
                             edge_test=EDGE_ACTORS)


@pytest.fixture
def edge_workers(edge_project: Path, redis_url: str, tmp_path: Path,
                 ) -> Iterator[Callable[..., Worker]]:
    """``edge_workers(url=redis_url, **env)`` starts a worker on ``url`` whose actors record
    to the test's Redis; all are killed at teardown."""
    started: list[Worker] = []
    count = iter(range(100))

    def start(url: str = redis_url, **env: str) -> Worker:
        worker = Worker(edge_project, url, tmp_path / f"w{next(count)}", RECORD_URL=redis_url,
                        WORKER_HEARTBEAT_TIMEOUT_MS=HEARTBEAT_TIMEOUT_MS, **env)
        started.append(worker)
        return worker.start()

    yield start
    for worker in started:
        worker.kill()


def drained(worker: Worker) -> dict[str, object]:
    (record,) = [r for r in worker.records() if r.get("msg") == "drained"]
    return record


def test_sigterm_with_redis_blackholed_drains_in_the_window_and_loses_nothing(
        edge_workers: Callable[..., Worker], redis_server: object, redis_url: str,
        jobs: Jobs) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with Blackhole(port) as hole:
        first = edge_workers(hole.url)
        wait_ready(jobs)
        ids = jobs.many("edge_sleep", 8, 2.0, prefix="b")  # 4 run, 4 wait their turn
        wait_for(lambda: jobs.started_count() >= 4, 30, "four jobs running")
        cut_at = time.time()
        hole.cut()
        signalled = first.signal(signal.SIGTERM)
        code = first.wait(timeout=DRAIN_WINDOW_S + 30)
        # Timed from the test's side too: SIGTERM to exit within the drain window (and so
        # well inside the pod's grace, the window plus worker_infra's margin).
        took = time.monotonic() - signalled
        assert took < DRAIN_WINDOW_S, f"exited {took:.1f} s after SIGTERM"
        assert code == 0, first.log()[-4000:]
        assert not first.records("drain_overrun"), first.log()[-4000:]
        assert float(str(drained(first)["elapsed_s"])) < DRAIN_WINDOW_S, drained(first)
        assert jobs.stranded(), "what the blackholed worker held is left for recovery"
        hole.heal()
    second = edge_workers()
    wait_for(lambda: all(jobs.dones(job_id) for job_id in ids), 60, "every job done", step=0.2)
    wait_for(lambda: not jobs.stranded(), 30, "nothing held", step=0.2)
    assert second.stop(timeout=30) == 0, second.log()[-3000:]
    # Only a job that ran when the path was cut may run again (its end could not be stored).
    ran_twice = [job_id for job_id in ids if len(jobs.dones(job_id)) > 1]
    assert all(jobs.starts(job_id)[0][1] < cut_at for job_id in ran_twice), ran_twice


def test_a_non_daemon_thread_left_by_a_handler_does_not_hold_the_exit(
        edge_workers: Callable[..., Worker], jobs: Jobs) -> None:
    worker = edge_workers()
    wait_ready(jobs)
    jobs.enqueue("edge_thread", "t1")
    wait_for(lambda: jobs.dones("t1"), 30, "the job")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=DRAIN_WINDOW_S) == 0, worker.log()[-3000:]
    assert not worker.records("drain_overrun"), worker.log()[-3000:]
    (left,) = worker.records("threads_left_behind")
    assert "left-behind" in str(left["threads"]), left


def test_a_handler_closing_stdout_and_stderr_leaves_the_logs_and_redis_intact(
        edge_project: Path, tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    redis_log = tmp_path / "redis" / "redis-server.txt"
    server = RedisServer(tmp_path / "redis", options=(
        "--logfile", str(redis_log), "--loglevel", "verbose"))
    server.start()
    jobs = Jobs(server.url)
    worker = Worker(edge_project, server.url, tmp_path / "w", RECORD_URL=server.url).start()
    try:
        wait_ready(jobs)
        jobs.enqueue("edge_close_stdio", "c0")
        wait_for(lambda: jobs.dones("c0"), 30, "the job that closes its stdio")
        ids = jobs.many("edge_sleep", 12, 0.2, prefix="after")  # other threads connect now
        wait_for(lambda: all(jobs.dones(job_id) for job_id in ids), 60, "the jobs after it")
        # each job_end line is written after the job's own records
        wait_for(lambda: len(worker.records("job_end")) >= 13, 10, "13 job_end lines")
        assert len(worker.records("job_end")) == 13, worker.log()[-3000:]
        assert "Protocol error" not in redis_log.read_text(), redis_log.read_text()[-3000:]
        # the metrics are published every few seconds: all 13 jobs counted, none lost
        wait_for(lambda: success_total(worker.metrics()) == 13, 20, "13 successes counted")
        assert worker.stop(timeout=30) == 0, worker.log()[-3000:]
    finally:
        worker.kill()
        jobs.client.close()
        server.stop()


def success_total(metrics: str) -> float:
    """The jobs counted a success in ``metrics`` (the text of /metrics)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("jobs_processed_total{") and 'outcome="success"' in line)
