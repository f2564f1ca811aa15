"""A broker reset is seen: Redis killed with jobs queued and in flight, restarted EMPTY.

A real redis-server without persistence, a worker of 2 processes x 2 threads, 60 jobs
that each record their effect in a second Redis (so the wipe cannot erase the count) and
then wait for the test's word. With 4 jobs in flight, Redis is SIGKILLed and restarted
empty on the same port. Each worker process says so once (``broker_reset``), counts
``broker_resets_total``, and ``/readyz`` is 503 naming the reset while the 4 deliveries
it held are unsettled; released, each settlement finds its message gone and is counted
in ``jobs_lost_total{queue}`` and logged ``lost``, never ``success``; then readiness is
200 again and a new job runs. Before: the 4 were counted ``success``, nothing was said,
``/readyz`` stayed 200.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from _lifecycle import Jobs, Worker, get, wait_for
from bakery import RedisServer
from test_redis_full import effect_project, server  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

WAITING_ACTORS = '''\
"""An actor that records its effect in a second Redis, then waits for the test's word."""

from __future__ import annotations

import os
import time

import dramatiq
import redis

_effects = redis.Redis.from_url(os.environ.get("EFFECTS_URL", "redis://127.0.0.1:1/0"))


@dramatiq.actor(queue_name="notifications", max_retries=0, time_limit=600_000)
def effect_then_wait(job_id: str) -> None:
    _effects.rpush("effects", job_id)
    while not _effects.exists("release"):
        time.sleep(0.02)
'''


@pytest.fixture
def broker_redis(tmp_path: Path) -> Iterator[RedisServer]:
    yield from server(tmp_path / "broker")


@pytest.fixture
def effects(tmp_path: Path) -> Iterator[tuple[redis.Redis, str]]:
    for found in server(tmp_path / "effects"):
        with redis.Redis.from_url(found.url) as client:
            yield client, found.url


def probe(url: str) -> tuple[int, str]:
    """GET ``url``: status and body; (0, "") while nothing listens yet."""
    try:
        return get(url)
    except OSError:
        return 0, ""


def series(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a /metrics text."""
    return sum(float(value) for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def counted(text: str, outcome: str) -> float:
    return sum(float(v) for v in re.findall(
        rf'^jobs_processed_total{{[^}}]*outcome="{outcome}"[^}}]*}} (\S+)$', text, re.M))


def test_a_broker_reset_is_said_counted_not_ready_and_nothing_lost_counts_as_success(
        effect_project: Path, broker_redis: RedisServer, effects: tuple[redis.Redis, str],
        tmp_path: Path) -> None:
    from bakery import add_actors

    add_actors(effect_project, reset_test=WAITING_ACTORS)
    record, effects_url = effects
    jobs = Jobs(broker_redis.url)
    worker = Worker(effect_project, broker_redis.url, tmp_path / "w", EFFECTS_URL=effects_url,
                    WORKER_PROCESSES="2", WORKER_CONCURRENCY="2",
                    WORKER_HEARTBEAT_TIMEOUT_MS="2000").start()
    ready = f"http://127.0.0.1:{worker.port}/readyz"
    try:
        wait_for(lambda: probe(ready)[0] == 200, 30, "the worker to be ready")
        for index in range(60):
            jobs.enqueue("effect_then_wait", f"j{index}")
        wait_for(lambda: record.llen("effects") >= 4, 30, "4 jobs in flight")
        time.sleep(0.5)  # the prefetch is full: nothing more is fetched
        in_flight = record.llen("effects")
        assert in_flight == 4, "2 processes x 2 threads, prefetch 2 each"

        broker_redis.kill()
        broker_redis.start()  # same port, EMPTY: no persistence
        status, body = wait_for(lambda: (r := probe(ready)) and r[0] == 503 and "reset" in r[1]
                                and r, 30, "readiness to name the reset")
        assert "broker reset: Redis lost its data" in body, body
        assert "Redis restarted empty (run_id" in body, body
        resets = wait_for(lambda: series(worker.metrics(), "broker_resets_total") == 2
                          and worker.metrics(), 10, "each process to count the reset")
        assert series(resets, "jobs_lost_total") == 0  # nothing settled yet

        record.set("release", 1)
        wait_for(lambda: series(worker.metrics(), "jobs_lost_total") == in_flight, 30,
                 "the in-flight settlements to be counted lost")
        wait_for(lambda: probe(ready)[0] == 200, 30, "readiness once every lost delivery ended")
        after = worker.metrics()
        assert counted(after, "success") == 0, "no lost job counted as success"
        records = worker.records()
        said = [r for r in records if r.get("event") == "broker_reset"]
        assert len(said) == 2, said  # once per worker process
        lost = [r for r in records if r.get("outcome") == "lost"]
        assert len(lost) == in_flight and all(r["handler_outcome"] == "success" for r in lost)
        assert not [r for r in records if r.get("outcome") == "success"]

        jobs.enqueue("effect_then_wait", "after")
        wait_for(lambda: b"after" in record.lrange("effects", 0, -1), 30, "a new job to run")
        wait_for(lambda: counted(worker.metrics(), "success") == 1, 10, "it to be counted")
        effects_recorded = record.llen("effects")
        print(f"reset: 60 queued, {in_flight} in flight counted lost, "
              f"{60 - in_flight} wiped with the data (reported by the reset), "
              f"{effects_recorded} effects recorded")
        assert worker.stop(timeout=30) == 0, worker.log()[-3000:]
    finally:
        worker.kill()
        jobs.client.close()
