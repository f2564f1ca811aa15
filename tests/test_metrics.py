"""Metrics (DESIGN 2.3): a real supervisor with 2 worker processes, a real redis-server, and
exact values on /metrics after a known workload; backlog read at scrape time in O(1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

import pytest
import redis
from dramatiq.message import Message
from prometheus_client.parser import text_string_to_metric_families

from _lifecycle import Worker, free_port, get, wait_for
from bakery import DATABASE_POOL, DATABASE_QUEUE, PYTHON, copy_project, package_of, project_env

pytestmark = pytest.mark.slow

QUEUE = "notifications"
MAX_ATTEMPTS = 3
PROCESSES = 2
CONCURRENCY = 3

TEST_ACTORS = '''
"""Actors of the metrics tests (written into a copy of the bake)."""

import os
import time

import dramatiq
import redis
from dramatiq.middleware import CurrentMessage

from ..lifecycle import checkpoint

_redis = redis.Redis.from_url(os.environ["REDIS_URL"])


@dramatiq.actor(queue_name="notifications", max_retries=0)
def m_ok(n):
    pass


@dramatiq.actor(queue_name="notifications", max_retries=3, min_backoff=100, max_backoff=200)
def m_flaky(n):
    if CurrentMessage.get_current_message().options.get("retries", 0) == 0:
        raise RuntimeError("fails on its first delivery")


@dramatiq.actor(queue_name="notifications", max_retries=1, min_backoff=100, max_backoff=200)
def m_poison(n):
    raise RuntimeError("always fails")


@dramatiq.actor(queue_name="notifications", throws=(ValueError,))
def m_abort(n):
    raise ValueError("aborted on purpose")


@dramatiq.actor(queue_name="notifications", max_retries=0)
def m_slow(n):
    _redis.set("m_slow:pid", os.getpid())
    if _redis.incr("m_slow:runs") > 1:
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        checkpoint()
        time.sleep(0.02)


@dramatiq.actor(queue_name="DATABASE_QUEUE", max_retries=0)
def m_hold_db(n):
    from .. import db

    with db.connection():
        _redis.incr("m_hold_db:holding")
        while not _redis.exists("m_hold_db:release"):
            time.sleep(0.02)
'''


# -- helpers --------------------------------------------------------------------------------


def copy_with_actors(project: Path, target: Path) -> Path:
    """``project`` copied into the directory ``target`` with the metrics test actors."""
    actors = TEST_ACTORS.replace('"DATABASE_QUEUE"', repr(DATABASE_QUEUE))
    return copy_project(project, target / project.name, metrics_test=actors)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    status, text = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def enqueue(client: redis.Redis, actor: str, *args: Any, queue: str = QUEUE,
            **options: Any) -> Message[Any]:
    """Enqueue as Dramatiq's RedisBroker does (hash body + rpush id)."""
    redis_id = str(uuid.uuid4())
    message: Message[Any] = Message(queue_name=queue, actor_name=actor, args=args, kwargs={},
                                    options={**options, "redis_message_id": redis_id})
    client.hset(f"dramatiq:{queue}.msgs", redis_id, message.encode())
    client.rpush(f"dramatiq:{queue}", redis_id)
    return message


class Pool(Worker):
    """The worker (supervisor) for one test: :data:`PROCESSES` processes of
    :data:`CONCURRENCY` threads, :data:`MAX_ATTEMPTS` attempts; ``start`` returns once the
    exporter answers and every worker process reported its threads."""

    def __init__(self, project: Path, redis_url: str, tmp_path: Path, **env: str) -> None:
        super().__init__(project, redis_url, tmp_path, WORKER_PROCESSES=str(PROCESSES),
                         WORKER_CONCURRENCY=str(CONCURRENCY),
                         WORKER_MAX_ATTEMPTS=str(MAX_ATTEMPTS), **env)

    def start(self) -> Self:
        super().start()
        wait_for(self._ready, 30, "the exporter and every worker process")
        return self

    def _ready(self) -> bool:
        assert self.process is not None and self.process.poll() is None, self.log()
        try:
            samples = scrape(self.port)
        except OSError:
            return False
        return value(samples, "worker_concurrency") == PROCESSES * CONCURRENCY

    def job_lines(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("event") == "job_end"]

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL to the group when it has not exited within ``timeout`` s."""
        try:
            return super().stop(signum, timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -signal.SIGKILL


@pytest.fixture(scope="module")
def metrics_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_with_actors(bake(database="none", sandbox_pool="no"),
                            tmp_path_factory.mktemp("metrics"))


@pytest.fixture
def pool(metrics_project: Path, redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Pool]]:
    started: list[Pool] = []

    def _start(project: Path = metrics_project, **env: str) -> Pool:
        started.append(Pool(project, redis_url, tmp_path, **env).start())
        return started[-1]

    yield _start
    for item in started:
        if item.process is not None and item.process.poll() is None:
            item.stop()


def exporter_only(project: Path, redis_url: str, tmp_path: Path,
                  ) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """The supervisor's exporter alone: a pool with no worker process (a stopped pool)."""
    port = free_port()
    state = tmp_path / "state"
    (state / "metrics").mkdir(parents=True)
    code = (f"import time; import {package_of(project)}; from worker_runtime import exporter; "
            "from worker_runtime.settings import load_settings; "
            "exporter.start_exporter(load_settings()); time.sleep(600)")
    env = project_env(project, WORKER_POOL="interactive", REDIS_URL=redis_url,
                      WORKER_STATE_DIR=str(state), METRICS_PORT=str(port),
                      PROMETHEUS_MULTIPROC_DIR=str(state / "metrics"))
    process = subprocess.Popen([PYTHON, "-c", code], cwd=project, env=env)
    try:
        wait_for(lambda: _answers(port), 20, "the exporter")
        yield port, process
    finally:
        process.kill()
        process.wait()


def _answers(port: int) -> bool:
    try:
        return get(f"http://127.0.0.1:{port}/livez")[0] in {200, 503}
    except OSError:
        return False


@pytest.fixture
def stopped_pool(metrics_project: Path, redis_url: str, tmp_path: Path,
                 ) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    yield from exporter_only(metrics_project, redis_url, tmp_path)


# -- tests ----------------------------------------------------------------------------------


def test_counts_outcomes_durations_and_gauges_exactly(
        pool: Callable[..., Pool], redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    worker = pool()
    samples = scrape(worker.port)
    assert value(samples, "worker_concurrency") == PROCESSES * CONCURRENCY
    assert value(samples, "worker_inflight_jobs") == 0
    assert value(samples, "db_pool_size") is None  # no database option in this bake

    for n in range(30):
        enqueue(client, "m_ok", n)
    for n in range(5):
        enqueue(client, "m_flaky", n)
    for n in range(2):
        enqueue(client, "m_poison", n)
    for n in range(3):
        enqueue(client, "m_abort", n)
    # Over its attempt budget: refused before running (Attempts), dead-lettered.
    refused = enqueue(client, "m_ok", 99, retries=MAX_ATTEMPTS)

    expected = {
        ("m_ok", "success"): 30, ("m_ok", "dead_letter"): 1,
        ("m_flaky", "retry"): 5, ("m_flaky", "success"): 5,
        ("m_poison", "retry"): 2, ("m_poison", "dead_letter"): 2,
        ("m_abort", "failure"): 3,
    }

    def counts() -> dict[tuple[str, str], float]:
        found = series(scrape(worker.port), "jobs_processed_total")
        return {(dict(k)["actor"], dict(k)["outcome"]): v for k, v in found.items()
                if dict(k)["queue"] == QUEUE}

    wait_for(lambda: counts() == expected, 40, f"counts {expected}")
    time.sleep(0.5)  # nothing more arrives
    assert counts() == expected
    samples = scrape(worker.port)
    durations = {dict(k)["actor"]: v for k, v in
                 series(samples, "job_duration_seconds_count").items()}
    assert durations == {"m_ok": 30, "m_flaky": 10, "m_poison": 4, "m_abort": 3}
    assert value(samples, "job_duration_seconds_bucket", queue=QUEUE, actor="m_ok",
                 le="+Inf") == 30
    assert value(samples, "worker_inflight_jobs") == 0
    # Poison (2), aborted by throws (3, Dramatiq keeps failed messages) and the refused one.
    assert value(samples, "queue_dead_letters", queue=QUEUE) == 6
    assert value(samples, "queue_depth", queue=QUEUE) == 0
    assert value(samples, "queue_depth", queue=f"{QUEUE}.DQ") == 0
    assert value(samples, "queue_oldest_message_seconds", queue=QUEUE) == 0

    # One JSON line per job end, with id, queue, actor, duration and outcome.
    lines = wait_for(lambda: len(worker.job_lines()) == 48 and worker.job_lines(), 10,
                     "48 job_end lines")
    outcomes: dict[tuple[str, str], int] = {}
    for line in lines:
        assert {"job_id", "queue", "actor", "duration_s", "outcome"} <= line.keys()
        assert line["queue"] == QUEUE
        outcomes[line["actor"], line["outcome"]] = outcomes.get(
            (line["actor"], line["outcome"]), 0) + 1
    assert outcomes == expected
    assert [line["job_id"] for line in lines if line["outcome"] == "dead_letter"
            and line["actor"] == "m_ok"] == [refused.message_id]

    # In flight: one long job; then a shutdown of its process requeues it (outcome
    # "requeued"), another process runs it again, and the dead process's counts stay.
    enqueue(client, "m_slow", 1)
    pid = int(wait_for(lambda: client.get("m_slow:pid"), 10, "m_slow to start"))
    wait_for(lambda: value(scrape(worker.port), "worker_inflight_jobs") == 1, 10, "in-flight 1")
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: client.get("m_slow:runs") == b"2", 30, "m_slow to run again")
    expected |= {("m_slow", "requeued"): 1, ("m_slow", "success"): 1}
    wait_for(lambda: counts() == expected, 20, f"counts {expected}")

    def settled() -> bool:
        found = scrape(worker.port)
        return (value(found, "worker_concurrency") == PROCESSES * CONCURRENCY
                and value(found, "worker_inflight_jobs") == 0)

    # The replaced process's live gauges are gone (mark_process_dead), its counters are not.
    wait_for(settled, 20, "the replacement process")
    assert counts() == expected
    samples = scrape(worker.port)
    assert value(samples, "job_duration_seconds_count", queue=QUEUE, actor="m_slow") == 2
    assert value(samples, "job_duration_seconds_count", queue=QUEUE, actor="m_ok") == 30


def test_backlog_of_a_stopped_pool_grows_with_time(
        stopped_pool: tuple[int, subprocess.Popen[bytes]], redis_url: str) -> None:
    port, _ = stopped_pool
    client = redis.Redis.from_url(redis_url)
    samples = scrape(port)
    assert value(samples, "queue_depth", queue=QUEUE) == 0
    assert value(samples, "queue_oldest_message_seconds", queue=QUEUE) == 0
    assert value(samples, "queue_dead_letters", queue=QUEUE) == 0
    assert series(samples, "jobs_processed_total") == {}

    now_ms = int(time.time() * 1000)
    first = enqueue(client, "m_ok", 0)
    client.hset(f"dramatiq:{QUEUE}.msgs", first.options["redis_message_id"],
                first.copy(message_timestamp=now_ms - 10_000).encode())
    for n in range(1, 25):
        enqueue(client, "m_ok", n)
    # Delayed messages nobody fetched, due 5 s ago.
    for n in range(4):
        enqueue(client, "m_ok", n, queue=f"{QUEUE}.DQ", eta=now_ms - 5_000)
    for n in range(7):
        client.zadd(f"dramatiq:{QUEUE}.XQ", {f"dead-{n}": now_ms})

    before = time.time()
    samples = scrape(port)
    after = time.time()
    assert value(samples, "queue_depth", queue=QUEUE) == 25
    assert value(samples, "queue_depth", queue=f"{QUEUE}.DQ") == 4
    assert value(samples, "queue_dead_letters", queue=QUEUE) == 7
    oldest = value(samples, "queue_oldest_message_seconds", queue=QUEUE)
    assert oldest is not None
    # timed from both ends of the scrape; the age is in whole ms (Redis's TIME, truncated)
    low, high = before * 1000 - now_ms + 10_000, after * 1000 - now_ms + 10_000
    assert int(low) - 1 <= oldest * 1000 <= high + 1, (low, oldest, high)
    overdue = value(samples, "queue_oldest_message_seconds", queue=f"{QUEUE}.DQ")
    assert overdue is not None
    assert 5.0 <= overdue <= after - now_ms / 1000 + 5.0

    time.sleep(1.5)
    later = scrape(port)
    grown = value(later, "queue_oldest_message_seconds", queue=QUEUE)
    assert grown is not None
    assert 1.5 <= grown - oldest <= 1.5 + (time.time() - before)
    assert value(later, "queue_depth", queue=QUEUE) == 25

    # The head is the next message in line: once it is taken, the next one's age shows.
    head = client.lpop(f"dramatiq:{QUEUE}")
    assert head == first.options["redis_message_id"].encode()
    newer = value(scrape(port), "queue_oldest_message_seconds", queue=QUEUE)
    assert newer is not None and newer < grown - 9
    assert value(scrape(port), "queue_depth", queue=QUEUE) == 24


def test_a_scrape_costs_one_redis_call_whatever_the_backlog(
        stopped_pool: tuple[int, subprocess.Popen[bytes]], redis_url: str) -> None:
    port, _ = stopped_pool
    client = redis.Redis.from_url(redis_url)
    pipe = client.pipeline(transaction=False)
    body = Message(queue_name=QUEUE, actor_name="m_ok", args=(1,), kwargs={},
                   options={}).encode()
    for n in range(20_000):
        pipe.hset(f"dramatiq:{QUEUE}.msgs", f"id-{n}", body)
        pipe.rpush(f"dramatiq:{QUEUE}", f"id-{n}")
    pipe.execute()
    # A head id whose body is gone (acked meanwhile) is skipped, within a bounded probe.
    client.lpush(f"dramatiq:{QUEUE}", "gone")

    scrape(port)  # the exporter's connection is open (its handshake is not a scrape's cost)
    client.config_resetstat()
    samples = scrape(port)
    stats = client.info("commandstats")
    assert value(samples, "queue_depth", queue=QUEUE) == 20_001
    assert value(samples, "queue_oldest_message_seconds", queue=QUEUE) > 0  # type: ignore[operator]
    calls = {name.removeprefix("cmdstat_"): int(stat["calls"]) for name, stat in stats.items()}
    calls.pop("config|resetstat", None)
    assert calls.pop("eval") == 1  # one round trip for the whole backlog
    # broker_full: one write probe per scrape (a short-lived key; refused when Redis is full).
    assert calls.pop("set") == 1
    # Redis's TIME: the backlog age is judged on Redis's clock, not the exporter host's (#22).
    assert calls.pop("time") == 1
    # Inside it, a constant number of O(1) commands per queue (the delay queue's due set:
    # its size and its earliest); beside it, the live consumers of queue_consumers and
    # queue_unserved: the heartbeats, read with TIME in one pipeline (then each worker's
    # record and acks sets: none here); and the flow state of queue_paused, one HMGET of the
    # paused queues, and of jobs_deduplicated_total, one HMGET of the unique jobs' counts (#42;
    # no downstream budget in this pool: nothing more). The queue's lanes (#42: the high and
    # low lists beside Dramatiq's, and the fair lane's sorted set) add a length and a head each.
    assert calls == {"llen": 4, "lrange": 4, "hget": 2, "zcard": 3, "zrange": 3, "hmget": 2}


def test_livez_and_readyz(metrics_project: Path, redis_url: str, redis_server: Any,
                          tmp_path: Path) -> None:
    # A worker process that died without being buried makes the container not live.
    state = tmp_path / "state"
    board_code = (f"from pathlib import Path; from worker_runtime.boards "
                  f"import ProgressBoard; ProgressBoard(Path({str(state)!r}), 2, 'b-1')")
    for port, _ in exporter_only(metrics_project, redis_url, tmp_path):
        assert get(f"http://127.0.0.1:{port}/livez") == (200, "ok\n")
        assert get(f"http://127.0.0.1:{port}/readyz") == (200, "ok\n")
        assert get(f"http://127.0.0.1:{port}/nope")[0] == 404
        subprocess.run([PYTHON, "-c", board_code], check=True,
                       env=project_env(metrics_project))
        status, text = get(f"http://127.0.0.1:{port}/livez")
        assert status == 503 and "has died" in text
        redis_server.stop()
        try:
            status, text = get(f"http://127.0.0.1:{port}/readyz")
            assert status == 503 and text.startswith("redis:")
            # /metrics still answers; only the backlog series are missing.
            assert get(f"http://127.0.0.1:{port}/metrics")[0] == 200
        finally:
            redis_server.start()


def test_db_pool_in_use_reaches_db_pool_size(
        pool: Callable[..., Pool], bake: Callable[..., Path], redis_url: str,
        database_url: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    project = copy_with_actors(bake(sandbox_pool="no"), tmp_path_factory.mktemp("metrics_db"))
    worker = pool(project, WORKER_POOL=DATABASE_POOL, DATABASE_URL=database_url,
                  DB_POOL_SIZE=str(CONCURRENCY))
    client = redis.Redis.from_url(redis_url)
    size = PROCESSES * CONCURRENCY

    def gauges() -> tuple[float | None, float | None]:
        samples = scrape(worker.port)
        return value(samples, "db_pool_in_use"), value(samples, "db_pool_size")

    wait_for(lambda: gauges() == (0, size), 10, "idle pools")
    for n in range(2):
        enqueue(client, "m_hold_db", n, queue=DATABASE_QUEUE)
    wait_for(lambda: client.get("m_hold_db:holding") == b"2", 10, "2 holders")
    wait_for(lambda: gauges() == (2, size), 5, "2 connections in use")
    # Saturation: every handler holds a connection (the over-concurrency symptom).
    for n in range(2, size):
        enqueue(client, "m_hold_db", n, queue=DATABASE_QUEUE)
    wait_for(lambda: client.get("m_hold_db:holding") == str(size).encode(), 10, "all holders")
    wait_for(lambda: gauges() == (size, size), 5, "pools saturated")
    assert value(scrape(worker.port), "worker_inflight_jobs") == size
    client.set("m_hold_db:release", 1)
    wait_for(lambda: gauges() == (0, size), 10, "connections returned")
    # A handler returns its connection before its job is settled and counted: wait for the
    # count (read at once, a loaded machine showed 3 of 6).
    done = {frozenset({"queue": DATABASE_QUEUE, "actor": "m_hold_db",
                       "outcome": "success"}.items()): size}
    wait_for(lambda: series(scrape(worker.port), "jobs_processed_total") == done, 10,
             f"{size} successes counted")


def test_one_exporter_per_container(metrics_project: Path) -> None:
    """Dramatiq's own Prometheus middleware (a second exporter) is not in the stack."""
    code = (f"from {package_of(metrics_project)}.broker import broker; "
            "print(sorted(type(m).__name__ for m in broker.middleware))")
    out = subprocess.run([PYTHON, "-c", code], env=project_env(
        metrics_project, WORKER_POOL="interactive"), capture_output=True, text=True,
        check=True, cwd=metrics_project).stdout
    assert "Prometheus" not in out and "Metrics" in out
    assert sys.executable == PYTHON
