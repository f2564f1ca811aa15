"""Where a job's time goes in the service's worker: a timestamp profile of the no-op case.

    python bench/noop_profile.py [--jobs 2000]

Bakes the template (``database=none``), starts its own redis-server and runs, in
one process, the service's broker and middleware stack with Dramatiq's Worker as
the ``worker`` command builds it (prefetch = concurrency, 200 ms idle poll). Every
middleware hook, the consumer's fetch and each delivery's settlement (the ack
with its outcome and the refill of its slot, one Lua call) are timed with ``perf_counter``; the handler is a
no-op. Three runs:

1. no-op jobs, 1 thread: the per-job breakdown (mean microseconds per job);
2. no-op jobs, 8 threads: the same, with the threads competing for the GIL;
3. 100 ms jobs, 1 thread, with each settlement refilling its slot (ours) and
   with Dramatiq's timed fetch instead (a full consumer sleeps a growing backoff,
   5 ms doubling with jitter up to the 200 ms poll, reset at each message): the
   idle gap between one job's end and the next job's start, which the refill removes.

Prints JSON and writes ``bench/results/noop_profile-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _workers

RESULTS = Path(__file__).resolve().parent / "results"

DRIVER = r"""
import json, statistics, sys, threading, time
from collections import defaultdict

import dramatiq
from dramatiq import Message

from orders_worker import actors  # noqa: F401
from worker_runtime.lifecycle import LIFECYCLE
from worker_runtime.boards import ProgressBoard
from orders_worker.broker import broker
from worker_runtime.settings import load_settings
from worker_runtime.consumer import SettlingConsumer
from worker_runtime.worker import FETCH_TIMEOUT_MS

jobs, ms, threads, wake = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
totals = defaultdict(float)
lock = threading.Lock()


def timed(name, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - started
            with lock:
                totals[name] += elapsed
    return wrapper


for middleware in broker.middleware:
    for hook in ("before_process_message", "after_process_message", "after_ack", "after_nack"):
        method = getattr(middleware, hook, None)
        if method is not None and getattr(type(middleware), hook) is not getattr(
                dramatiq.Middleware, hook, None):
            setattr(middleware, hook, timed(f"{type(middleware).__name__}.{hook}", method))
SettlingConsumer._fetch = timed("consumer fetch (Redis, consumer thread)", SettlingConsumer._fetch)
broker.settle_and_take = timed("settle: ack + outcome + refill (Redis)", broker.settle_and_take)
if not wake:
    # Dramatiq's consumer: a full consumer sleeps its growing backoff (5 ms doubling, with
    # jitter, up to worker_timeout), reset each time it hands a message on; no wake.
    from dramatiq.common import compute_backoff

    class TimedFetch(threading.Event):
        misses = 0
        def set(self):
            pass
        def wait(self, timeout=None):
            self.misses, backoff_ms = compute_backoff(self.misses, max_backoff=timeout * 1000)
            time.sleep(backoff_ms / 1000)
            return False
    original_init = SettlingConsumer.__init__
    original_admit = SettlingConsumer._admit
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._slot_freed = TimedFetch()
    def admit(self, *args, **kwargs):
        self._slot_freed.misses = 0
        return original_admit(self, *args, **kwargs)
    original_claim = SettlingConsumer._claim
    def claim(self, most, releasing=None):
        if releasing is not None:  # no refill by the settlement either
            original_claim(self, 0, releasing)
            return 0
        return original_claim(self, most)
    SettlingConsumer.__init__ = init
    SettlingConsumer._admit = admit
    SettlingConsumer._claim = claim

starts, ends = [], []
class Clock(dramatiq.Middleware):
    def before_process_message(self, broker, message):
        starts.append(time.perf_counter())
    def after_ack(self, broker, message):
        ends.append(time.perf_counter())
broker.add_middleware(Clock())

settings = load_settings()
broker.emit_after("process_boot")
board = ProgressBoard(settings.worker_state_dir, threads, broker.broker_id)
LIFECYCLE.attach(board)
queue = "notifications"
for _ in range(jobs):
    message = Message(queue_name=queue, actor_name="profile_job", args=(ms,), kwargs={},
                      options={})
    broker.enqueue(message)
worker = dramatiq.Worker(broker, queues={queue}, worker_threads=threads,
                         worker_timeout=FETCH_TIMEOUT_MS)
worker.queue_prefetch = threads
broker.client.config_resetstat()
began = time.perf_counter()
worker.start()
while len(ends) < jobs:
    time.sleep(0.005)
elapsed = ends[-1] - starts[0]
worker.stop()
gaps = sorted(s - e for s, e in zip(starts[1:], ends[:-1]))
per_job = {name: round(total / jobs * 1e6, 1) for name, total in sorted(totals.items())}
print(json.dumps({
    "jobs": jobs, "ms": ms, "threads": threads, "wake": wake,
    "elapsed_s": round(elapsed, 4), "jobs_per_s": round(jobs / elapsed, 1),
    "per_job_us": round(elapsed / jobs * threads * 1e6, 1),
    "hooks_us_per_job": per_job,
    "redis_us_per_job": {
        name: round(stats["usec"] / jobs, 1)
        for name, stats in broker.client.info("commandstats").items() if stats["usec"] / jobs >= 0.5
    },
    "redis_calls_per_job": {
        name: round(stats["calls"] / jobs, 2)
        for name, stats in broker.client.info("commandstats").items() if stats["usec"] / jobs >= 0.5
    },
    "gap_ms_mean": round(statistics.mean(gaps) * 1000, 3) if threads == 1 else None,
    "gap_ms_median": round(statistics.median(gaps) * 1000, 3) if threads == 1 else None,
}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="noop-profile-"))
    project, driver, server, env = _workers.in_process(
        root, DRIVER, WORKER_JOB_TIMEOUT_MS="20000", WORKER_SHUTDOWN_TIMEOUT_MS="25000"
    )
    client = redis.Redis.from_url(server.url)
    runs = [
        (args.jobs, 0.0, 1, "1"),
        (args.jobs, 0.0, 8, "1"),
        (30, 100.0, 1, "1"),
        (30, 100.0, 1, "0"),
    ]
    results = []
    try:
        for jobs, ms, threads, wake in runs:
            client.flushall()
            env["WORKER_CONCURRENCY"] = str(threads)
            out = subprocess.run(
                [sys.executable, str(driver), str(jobs), str(ms), str(threads), wake],
                env=env,
                cwd=project,
                check=True,
                stdout=subprocess.PIPE,
                text=True,
                timeout=600,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_path = RESULTS / f"noop_profile-{stamp}.json"
    out_path.write_text(
        json.dumps(
            {"cores": os.cpu_count(), "loadavg": os.getloadavg(), "results": {"runs": results}},
            indent=2,
        )
    )
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
