"""A retry is never lost while Redis is down: the original is held until its retry copy is stored.

A real worker runs 8 jobs against an append-only redis-server (``appendonly yes``,
``appendfsync always``). Redis is stopped while all 8 run; then every job fails.
The retry copies cannot be stored, so nothing is acked and no retry is counted;
Redis restarts from its append-only file, the retries are stored with the acks and
run: every job completes exactly once, nothing is dead-lettered or left held, and
``jobs_processed_total`` counts exactly 8 retries and 8 successes.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from _lifecycle import NS, QUEUE, Jobs, Worker, make_test_project, wait_for
from bakery import RedisServer
from test_malformed import counted

pytestmark = pytest.mark.slow

OUTAGE_ACTORS = '''\
"""An actor that waits for the test's verdict: fail (during the outage) or pass."""

from __future__ import annotations

import os
import time
from pathlib import Path

import dramatiq

_DIR = Path(os.environ["OUTAGE_DIR"])


@dramatiq.actor(queue_name="notifications", max_retries=4, min_backoff=100, max_backoff=300)
def flaky(job_id: str) -> None:
    (_DIR / f"{job_id}.{time.time_ns()}.start").touch()
    while not (_DIR / "pass").exists():
        if (_DIR / "fail").exists():
            raise RuntimeError("failed while Redis was down")
        time.sleep(0.02)
    (_DIR / f"{job_id}.{time.time_ns()}.done").touch()
'''


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[RedisServer]:
    directory = tmp_path / "redis"
    directory.mkdir()
    server = RedisServer(directory, appendonly=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def outage_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = bake(database="none")
    return make_test_project(base, tmp_path_factory.mktemp("outage") / base.name,
                             outage_test=OUTAGE_ACTORS)


def test_jobs_failing_while_redis_is_down_are_all_retried_none_lost(
        outage_project: Path, aof_redis: RedisServer, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    jobs = Jobs(aof_redis.url)
    ids = [f"o{index}" for index in range(8)]
    for job_id in ids:
        jobs.enqueue("flaky", job_id)
    worker = Worker(outage_project, aof_redis.url, tmp_path / "w", OUTAGE_DIR=str(marks),
                    WORKER_CONCURRENCY="8", WORKER_MAX_ATTEMPTS="5").start()
    try:
        wait_for(lambda: len(list(marks.glob("*.start"))) == 8, 30, "all 8 jobs to start")
        aof_redis.stop()
        (marks / "fail").touch()
        time.sleep(2.0)  # every handler has raised and tried to store its retry
        retries_counted_during_outage = counted(worker.metrics(), "retry")

        aof_redis.start()
        (marks / "fail").unlink()
        (marks / "pass").touch()
        wait_for(lambda: len(list(marks.glob("*.done"))) == 8, 40, "every job to complete")
        assert retries_counted_during_outage == 0, "no retry is counted before it is stored"
        time.sleep(0.5)
        for job_id in ids:
            assert len(list(marks.glob(f"{job_id}.*.done"))) == 1, job_id
            assert len(list(marks.glob(f"{job_id}.*.start"))) == 2, job_id
        client = redis.Redis.from_url(aof_redis.url)
        assert not client.zcard(f"{NS}:{QUEUE}.XQ"), "nothing dead-lettered"
        wait_for(lambda: not jobs.stranded(), 10, "nothing held in an acks set")
        assert not client.llen(f"{NS}:{QUEUE}") and not client.llen(f"{NS}:{QUEUE}.DQ")
        after = wait_for(lambda: next((t for t in [worker.metrics()] if counted(t, "success") == 8),
                                      None), 10, "8 successes to be counted")
        assert counted(after, "retry") == 8, after
        retried = [r for r in worker.records() if r.get("outcome") == "retry"]
        assert len(retried) == 8
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=20) == 0, worker.log()[-3000:]
        client.close()
    finally:
        worker.kill()
        jobs.client.close()
        jobs.broker.close()
