"""No head-of-line blocking: a short job never waits behind a long one while another process idles.

Two worker processes, one handler thread each (the default prefetch: the
concurrency). A long job runs until the test releases it; 20 short jobs are
queued behind it. Every short job must complete while the long one still runs:
the long job's process holds no message it cannot start, and the consumer of the
other process fetches each next job as soon as its slot frees. Nothing here is
timed: a short job held behind the long one would simply never complete before
the release (the wait gives up after a generous bound).

The control case sets ``WORKER_PREFETCH=2`` (Dramatiq's habit of prefetching
more than the threads): there a short job is held behind the long one, so the
test can see the blocking it rules out.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _lifecycle import Jobs, Worker, jobs, make_test_project, wait_for

pytestmark = pytest.mark.slow
__all__ = ["jobs"]

HOL_ACTORS = '''\
"""A long job that runs until the test releases it."""

from __future__ import annotations

import os
import time

import dramatiq
import redis

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


@dramatiq.actor(queue_name="notifications", max_retries=0, time_limit=600_000)
def hol_long(job_id: str) -> None:
    _client.rpush(f"test:start:{job_id}", f"{os.getpid()} {time.time()}")
    deadline = time.monotonic() + 120
    while not _client.exists("test:release") and time.monotonic() < deadline:
        time.sleep(0.02)
    _client.rpush(f"test:done:{job_id}", f"{os.getpid()} {time.time()}")
'''
SHORT = 20


@pytest.fixture(scope="session")
def hol_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = bake(database="none")
    return make_test_project(base, tmp_path_factory.mktemp("hol") / base.name,
                             hol_test=HOL_ACTORS)


@pytest.fixture
def pool(hol_project: Path, redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def _start(**env: str) -> Worker:
        worker = Worker(hol_project, redis_url, tmp_path / "w", **env)
        started.append(worker)
        return worker.start()

    yield _start
    for worker in started:
        worker.kill()


def _run(pool: Callable[..., Worker], jobs: Jobs, **env: str) -> tuple[Worker, list[str], bool]:
    """Long job first, then the short ones; True when every short one completed before the
    release of the long one."""
    jobs.enqueue("hol_long", "long")
    shorts = jobs.many("lc_quick", SHORT, prefix="s")
    # The long job outlives the harness's 20 s job limit (the control waits 20 s for shorts).
    worker = pool(WORKER_PROCESSES="2", WORKER_CONCURRENCY="1", WORKER_JOB_TIMEOUT_MS="120000",
                  WORKER_SHUTDOWN_TIMEOUT_MS="125000", **env)
    wait_for(lambda: jobs.starts("long"), 30, "the long job to start")
    try:
        wait_for(lambda: all(jobs.dones(job_id) for job_id in shorts), 20,
                 "every short job while the long one runs")
        unblocked = True
    except AssertionError:
        unblocked = False
    assert not jobs.dones("long"), "the long job ran until released"
    jobs.client.set("test:release", 1)
    wait_for(lambda: jobs.dones("long"), 10, "the long job to end once released")
    wait_for(lambda: all(jobs.dones(job_id) for job_id in shorts), 20, "every short job")
    return worker, shorts, unblocked


def test_short_jobs_never_wait_behind_a_long_one_while_another_process_idles(
        pool: Callable[..., Worker], jobs: Jobs) -> None:
    worker, shorts, unblocked = _run(pool, jobs)
    assert unblocked, "a short job waited behind the long one"
    (long_pid, _), = jobs.starts("long")
    ran_beside = {pid for job_id in shorts for pid, _ in jobs.starts(job_id)}
    assert ran_beside and long_pid not in ran_beside, "the other process ran every short job"
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0


def test_control_prefetching_more_than_the_threads_holds_a_short_job_behind_the_long_one(
        pool: Callable[..., Worker], jobs: Jobs) -> None:
    started = time.monotonic()
    worker, shorts, unblocked = _run(pool, jobs, WORKER_PREFETCH="2")
    assert not unblocked, "with prefetch 2 the long job's process holds a short one"
    (long_pid, _), = jobs.starts("long")
    (held, _), = [(job_id, pid) for job_id in shorts for pid, _ in jobs.starts(job_id)
                  if pid == long_pid]
    assert jobs.starts(held)[0][1] >= jobs.dones("long")[0][1], "it ran after the long job"
    assert time.monotonic() - started < 120
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0
