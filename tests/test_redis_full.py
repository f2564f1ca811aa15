"""A full Redis strands nothing the worker could move; readiness and producers say it is full.

A real redis-server with ``maxmemory 8mb`` and ``noeviction``: 40 jobs are queued, then
Redis is filled until it refuses writes (``OOM command not allowed``). A worker started
against it runs every job (its fetch, heartbeat, settlements and recovery pass free
before they write, so Redis takes them); each job records its effect in a second Redis.
Filled again, ``/readyz`` is 503 naming the full broker, and a producer's enqueue raises
``BrokerFull``, one line naming the actor. Once memory is freed the worker is ready and a
new job runs. Before, the fetch script's first write (the heartbeat) was refused: the
worker ran none of the jobs, and readiness said 200.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from _lifecycle import Jobs, Worker, get, make_test_project, wait_for
from bakery import PYTHON, RedisServer, package_of, project_env

pytestmark = pytest.mark.slow

EFFECT_ACTORS = '''\
"""An actor that records its effect in a second Redis (EFFECTS_URL)."""

from __future__ import annotations

import os

import dramatiq
import redis

# Connects on first use: a producer that imports the actors needs no EFFECTS_URL.
_effects = redis.Redis.from_url(os.environ.get("EFFECTS_URL", "redis://127.0.0.1:1/0"))


@dramatiq.actor(queue_name="notifications", max_retries=0)
def record_effect(job_id: str) -> None:
    _effects.rpush("effects", job_id)
'''

PRODUCER = """
import sys
from worker_runtime.brokerstate import BrokerFull
from {package}.producer import enqueue
try:
    enqueue("record_effect", sys.argv[1])
except BrokerFull as error:
    print(error)
    sys.exit(1)
"""


def server(directory: Path, *options: str) -> Iterator[RedisServer]:
    directory.mkdir()
    found = RedisServer(directory, options=options)
    found.start()
    yield found
    found.stop()


@pytest.fixture
def full_redis(tmp_path: Path) -> Iterator[RedisServer]:
    yield from server(tmp_path / "broker", "--maxmemory", "8mb", "--maxmemory-policy",
                      "noeviction")


@pytest.fixture
def effects(tmp_path: Path) -> Iterator[redis.Redis]:
    for found in server(tmp_path / "effects"):
        with redis.Redis.from_url(found.url) as client:
            yield client


@pytest.fixture(scope="session")
def effect_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = bake(database="none")
    return make_test_project(base, tmp_path_factory.mktemp("effects") / base.name,
                             effect_test=EFFECT_ACTORS)


def fill(client: redis.Redis) -> int:
    """Write 100 kB values until Redis refuses one for being full; return how many."""
    count = 0
    while True:
        try:
            client.set(f"filler:{client.dbsize()}:{count}", b"x" * 100_000)
        except redis.ResponseError as error:
            assert isinstance(error, redis.exceptions.OutOfMemoryError), error
            return count
        count += 1


def produce(project: Path, url: str, job_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-c", PRODUCER.format(package=package_of(project)), job_id], cwd=project,
        env=project_env(project, REDIS_URL=url), capture_output=True, text=True, timeout=60)


def test_a_full_redis_drains_its_jobs_says_full_and_recovers_once_freed(
        effect_project: Path, full_redis: RedisServer, effects: redis.Redis,
        tmp_path: Path) -> None:
    effects_url = f"redis://127.0.0.1:{effects.connection_pool.connection_kwargs['port']}/0"
    broker = redis.Redis.from_url(full_redis.url)
    jobs = Jobs(full_redis.url)
    for index in range(40):
        jobs.enqueue("record_effect", f"q{index}")
    assert fill(broker) > 0
    worker = Worker(effect_project, full_redis.url, tmp_path / "w", EFFECTS_URL=effects_url,
                    WORKER_HEARTBEAT_TIMEOUT_MS="2000").start()
    try:
        wait_for(lambda: effects.llen("effects") >= 40, 60, "the 40 queued jobs to run")
        assert not broker.llen("dramatiq:notifications"), "nothing left queued"
        wait_for(lambda: not any(broker.scard(key) for key in
                                 broker.scan_iter(match="dramatiq:__acks__.*")),
                 10, "nothing held")
        fill(broker)  # the acks freed a little: full again
        status, body = wait_for(lambda: (r := get(f"http://127.0.0.1:{worker.port}/readyz"))
                                and r[0] == 503 and r, 20, "readiness to say full")
        assert "full" in body and "OOM" in body, body
        refused = produce(effect_project, full_redis.url, "refused")
        assert refused.returncode == 1, refused.stderr[-2000:]
        assert refused.stdout.count("\n") == 1, refused.stdout
        assert "Redis is full" in refused.stdout and "'record_effect'" in refused.stdout
        recovery_failed = [r for r in worker.records() if "recovery pass failed" in r.get("msg", "")]
        assert not recovery_failed, recovery_failed[:3]

        for key in broker.scan_iter(match="filler:*", count=1000):
            broker.delete(key)
        wait_for(lambda: get(f"http://127.0.0.1:{worker.port}/readyz")[0] == 200, 20,
                 "readiness once memory is freed")
        assert produce(effect_project, full_redis.url, "after").returncode == 0
        wait_for(lambda: b"after" in effects.lrange("effects", 0, -1), 30, "a new job to run")
        assert sorted(effects.lrange("effects", 0, -1)) == sorted(
            [f"q{index}".encode() for index in range(40)] + [b"after"]), "each job ran once"
        assert worker.stop(timeout=30) == 0, worker.log()[-3000:]
    finally:
        worker.kill()
        broker.close()
        jobs.client.close()
