"""``status [--json]`` of a baked service against a real redis-server and real workers.

Two worker processes of 2 threads run 4 long jobs while 3 more wait and 1 is delayed;
``status`` (run with ``REDIS_URL`` alone: no worker setting, no state dir of the
workers') shows the queue's depth, the delayed one, the in-flight count, and each
process with its pool, host, pid and running jobs (actor, running time), from Redis
alone. Then one worker process is SIGKILLed: its supervisor forgets it and starts
another, which ``status`` shows instead. A heartbeat without a record (a process silent
for a heartbeat timeout) and a record that is not JSON are shown, never a crash.
"""

from __future__ import annotations

import json
import re
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from _lifecycle import QUEUE, Jobs, Worker, lc_project, started, wait_for

__all__ = ["lc_project"]
from bakery import project_env, run_cli

pytestmark = pytest.mark.slow


def status(project: Path, redis_url: str, *args: str) -> Any:
    env = project_env(project, REDIS_URL=redis_url, WORKER_STATE_DIR="/nonexistent")
    done = run_cli(project, "status", *args, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) if "--json" in args else done.stdout


def queue_row(found: dict[str, Any], queue: str = QUEUE) -> dict[str, Any]:
    return next(q for q in found["queues"] if q["queue"] == queue)


def live(found: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in found["processes"] if not p["silent"]]


def test_status_shows_queues_and_each_process_running_jobs_from_redis(
        lc_project: Path, redis_url: str, tmp_path: Path) -> None:
    jobs = Jobs(redis_url)
    for process in started(lambda: Worker(lc_project, redis_url, tmp_path / "w",
                                          WORKER_PROCESSES="2", WORKER_CONCURRENCY="2",
                                          WORKER_PREFETCH="2",
                                          WORKER_HEARTBEAT_TIMEOUT_MS="2000")):
        worker: Worker = process()
        wait_for(lambda: len(worker.children()) == 2, 30, "2 worker processes")
        enqueued_at = time.time()
        jobs.many("lc_long", 7, 60)
        wait_for(lambda: sum(bool(jobs.starts(f"j{i}")) for i in range(7)) == 4, 30,
                 "4 jobs running")

        found = wait_for(lambda: (s := status(lc_project, redis_url, "--json"))
                         and sum(len(p["jobs"]) for p in live(s)) == 4 and s, 10,
                         "status to show the 4 running jobs")
        row = queue_row(found)
        assert row["inflight"] == 4, row
        assert row["waiting"] == 3, row
        assert 0 < row["oldest_due_s"] < time.time() - enqueued_at + 5, row
        processes = live(found)
        assert sorted(p["pid"] for p in processes) == sorted(worker.children())
        for p in processes:
            assert p["pool"] == "interactive" and p["host"] == socket.gethostname(), p
            assert p["held"] == 2 and p["concurrency"] == 2, p
            assert p["heartbeat_age_s"] < 2, p
            assert len(p["jobs"]) == 2, p
            for job in p["jobs"]:
                assert job["actor"] == "lc_long" and job["queue"] == QUEUE, job
                assert 0 <= job["running_s"] <= time.time() - enqueued_at + 1, job

        table = status(lc_project, redis_url)
        assert "QUEUE" in table and "WAITING" in table and "IN FLIGHT" in table, table
        assert "lc_long" in table and "interactive" in table, table
        assert "2 live processes, 4 running jobs" in table, table

        # A worker process SIGKILLed: the supervisor forgets it, its replacement shows.
        victim = worker.children()[0]
        os.kill(victim, signal.SIGKILL)
        after = wait_for(lambda: (s := status(lc_project, redis_url, "--json"))
                         and len(live(s)) == 2 and victim not in [p["pid"] for p in s["processes"]]
                         and s, 30, "the killed process gone and its replacement shown")
        assert sorted(p["pid"] for p in live(after)) == sorted(worker.children())


def test_status_shows_silent_and_garbled_processes_without_failing(
        lc_project: Path, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    seconds, _ = client.time()
    client.zadd("dramatiq:__heartbeats__", {"silent-one": (seconds - 90) * 1000,
                                           "garbled-one": seconds * 1000})
    client.set("dramatiq:__process__.garbled-one", b"\xff not json")
    client.sadd("dramatiq:__acks__.silent-one.notifications", "a", "b")
    client.sadd("dramatiq:__acks__.garbled-one.notifications.DQ", "c")
    jobs = Jobs(redis_url)
    jobs.broker.enqueue(jobs.enqueue("lc_quick", "now").copy(), delay=600_000)

    found = status(lc_project, redis_url, "--json")
    by_id = {p["broker_id"]: p for p in found["processes"]}
    assert set(by_id) == {"silent-one", "garbled-one"}, "the producer's heartbeat is no process"
    assert by_id["silent-one"]["silent"] and by_id["silent-one"]["held"] == 2
    assert by_id["garbled-one"]["held"] == 0 and by_id["garbled-one"]["delayed"] == 1
    assert 89 < by_id["silent-one"]["heartbeat_age_s"] < 600
    assert by_id["garbled-one"]["silent"] and by_id["garbled-one"]["pool"] == "-"
    row = queue_row(found)
    # Held on the delay queue is delayed (a retry in its backoff), never in flight.
    assert (row["inflight"], row["waiting"], row["delayed"]) == (2, 1, 2), row
    table = status(lc_project, redis_url)
    assert re.search(r"\dm\d\ds ago \(silent\)", table), table


def test_status_names_an_unreachable_redis_in_one_line(lc_project: Path) -> None:
    env = project_env(lc_project, REDIS_URL="redis://127.0.0.1:1/0")
    done = run_cli(lc_project, "status", env=env)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "status: Redis at redis://127.0.0.1:1/0" in done.stderr
