"""The client pool is sized for the process, not capped at redis-py's 100 by accident.

redis-py 8 stops a ConnectionPool at 100 connections ("Too many connections"). A worker
process holds a fetch per queue and per delay queue, and a settlement lane plus a client
call per handler thread: a pool of 100 queues, or ``WORKER_CONCURRENCY=256`` (the highest
the setting allows), needs more. Real workers run both to completion on a real Redis.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import dramatiq
import pytest
import redis
from _lifecycle import NS, Worker, wait_for
from bakery import copy_project
from dramatiq.brokers.redis import RedisBroker

pytestmark = pytest.mark.slow

QUEUES = [f"w{index:03d}" for index in range(100)]
#: The highest WORKER_CONCURRENCY the setting allows (pools.Concurrency).
HIGHEST_CONCURRENCY = 256

WIDE_ACTORS = f'''\
"""One actor per queue of the pool "wide", and one for the many-threads test."""

from __future__ import annotations

import time

import dramatiq


def _record(job_id: str, seconds: float = 0.0) -> None:
    """Sleeps, then records the job through the broker's client (its pool is the one sized)."""
    time.sleep(seconds)
    dramatiq.get_broker().client.rpush("test:done", job_id)


for _queue in {QUEUES!r}:
    dramatiq.actor(_record, actor_name=f"wide_{{_queue}}", queue_name=_queue)


@dramatiq.actor(queue_name="notifications")
def many_threads(job_id: str, seconds: float) -> None:
    _record(job_id, seconds)
'''

WIDE_POOL = f"""

[pools.wide]                     # the connection-sizing test: 100 queues in one pool
queues = {QUEUES!r}
processes = 1
concurrency = 4
job_timeout_ms = 30000
shutdown_timeout_ms = 40000
memory = "640Mi"
cpu = "250m"
handler_memory = "32Mi"
min_replicas = 1
max_replicas = 1
backlog_age_target_s = 5
uses = []
""".replace("'", '"')


@pytest.fixture(scope="session")
def wide_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = bake(database="none")
    project = copy_project(base, tmp_path_factory.mktemp("wide") / base.name,
                           wide_test=WIDE_ACTORS)
    with (project / "pools.toml").open("a") as pools:
        pools.write(WIDE_POOL)
    return project


def assert_all_done(worker: Worker, client: redis.Redis, expected: set[str], timeout: float
                    ) -> None:
    wait_for(lambda: {raw.decode() for raw in client.lrange("test:done", 0, -1)} >= expected,
             timeout, f"{len(expected)} jobs done")
    assert "Too many connections" not in worker.log()
    assert worker.stop(timeout=60) == 0, worker.log()[-3000:]
    assert not [key for key in client.scan_iter(match=f"{NS}:__acks__.*") if client.scard(key)]


def test_a_pool_of_100_queues_runs_a_job_on_each(wide_project: Path, redis_url: str,
                                                 tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    broker = RedisBroker(url=redis_url)
    for queue in QUEUES:
        broker.enqueue(dramatiq.Message(queue_name=queue, actor_name=f"wide_{queue}",
                                        args=(queue,), kwargs={}, options={}))
    broker.close()
    worker = Worker(wide_project, redis_url, tmp_path / "w", WORKER_POOL="wide",
                    WORKER_CONCURRENCY="4").start()
    try:
        assert_all_done(worker, client, set(QUEUES), 120)
    finally:
        worker.kill()
        client.close()


def test_the_highest_concurrency_runs_every_thread(wide_project: Path, redis_url: str,
                                                   tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    broker = RedisBroker(url=redis_url)
    ids = [f"t{index}" for index in range(2 * HIGHEST_CONCURRENCY)]
    for job_id in ids:
        broker.enqueue(dramatiq.Message(queue_name="notifications", actor_name="many_threads",
                                        args=(job_id, 1.0), kwargs={}, options={}))
    broker.close()
    worker = Worker(wide_project, redis_url, tmp_path / "w",
                    WORKER_CONCURRENCY=str(HIGHEST_CONCURRENCY),
                    WORKER_JOB_TIMEOUT_MS="60000", WORKER_SHUTDOWN_TIMEOUT_MS="70000").start()
    try:
        assert_all_done(worker, client, set(ids), 180)
    finally:
        worker.kill()
        client.close()
