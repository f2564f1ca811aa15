"""Python work per job: the function calls a no-op job costs, this worker against bare Dramatiq.

    python bench/call_count.py [--jobs 2000]

A process bound by the interpreter lock pays for every Python and C call a job makes,
and more with 8 threads than with one (each call runs on caches the other threads and
the kernel left cold). Counting the calls is exact where timings on a shared machine
move by a few percent from run to run, so this script counts them: one handler thread,
``sys.setprofile`` on every thread, no-op jobs, after 100 jobs of warm-up.

Both run in their own process against the same redis-server: the baked service's broker
and middleware stack with Dramatiq's Worker as the ``worker`` command builds it, and
bare Dramatiq's RedisBroker with its default middleware and prefetch. Prints the calls
per job by package and the largest differences, and writes
``bench/results/call_count-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results
import _workers

DRIVER = r"""
import collections, json, os, sys, threading, time

import dramatiq
from dramatiq import Message

which, jobs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ended = []


class Count(dramatiq.Middleware):
    def after_ack(self, broker, message):
        ended.append(1)


if which == "service":
    from orders_worker import actors, logs  # noqa: F401
    from orders_worker.boards import ProgressBoard
    from orders_worker.broker import broker
    from orders_worker.lifecycle import LIFECYCLE
    from orders_worker.runtime import FETCH_TIMEOUT_MS
    from orders_worker.settings import load_settings

    logs.configure("bench")
    settings = load_settings()
    broker.emit_after("process_boot")
    LIFECYCLE.attach(ProgressBoard(settings.worker_state_dir, 1, broker.broker_id))
    actor, timeout, prefetch = "profile_job", FETCH_TIMEOUT_MS, 1
else:
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=os.environ["REDIS_URL"])
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name="notifications", max_retries=0)
    def bare_job(ms):
        pass

    actor, timeout, prefetch = "bare_job", 1000, 2  # Dramatiq's defaults for one thread
broker.add_middleware(Count())
for _ in range(jobs + 200):
    broker.enqueue(Message(queue_name="notifications", actor_name=actor, args=(0,), kwargs={},
                           options={}))
calls = collections.Counter()


def profile(frame, event, arg):
    if event == "call":
        calls[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
    elif event == "c_call":
        calls[("C", getattr(arg, "__qualname__", repr(arg)))] += 1


threading.setprofile(profile)
worker = dramatiq.Worker(broker, queues={"notifications"}, worker_threads=1,
                         worker_timeout=timeout)
worker.queue_prefetch = prefetch
worker.start()
while len(ended) < 100:
    time.sleep(0.01)
calls.clear()
first = len(ended)
while len(ended) < first + jobs:
    time.sleep(0.01)
counted, done = dict(calls), len(ended) - first
threading.setprofile(None)
worker.stop()
with open(out, "w") as file:
    json.dump({"jobs": done, "calls": {f"{path}::{name}": n / done
                                       for (path, name), n in counted.items()}}, file)
"""

PACKAGES = (
    "orders_worker",
    "dramatiq",
    "redis",
    "logging",
    "threading",
    "queue",
    "opentelemetry",
    "prometheus_client",
    "orjson",
)


def package(key: str) -> str:
    path, _, name = key.partition("::")
    if path == "C":
        return "C: " + name.split(".")[0]
    for each in PACKAGES:
        if f"/{each}/" in path or path.endswith(f"/{each}.py"):
            return each
    return "other"


def short(key: str) -> str:
    path, _, name = key.partition("::")
    for marker in ("/site-packages/", "/src/", "/lib/python"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}::{name}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="call-count-"))
    project, driver, server, env = _workers.in_process(root, DRIVER, WORKER_CONCURRENCY="1")
    counts: dict[str, dict[str, float]] = {}
    try:
        for which in ("service", "bare"):
            out = root / f"{which}.json"
            subprocess.run(
                [sys.executable, str(driver), which, str(args.jobs), str(out)],
                env=env,
                cwd=project,
                check=True,
                timeout=600,
                stderr=subprocess.DEVNULL,
            )
            counts[which] = json.loads(out.read_text())["calls"]
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    totals = {which: round(sum(calls.values()), 1) for which, calls in counts.items()}
    by_package: dict[str, dict[str, float]] = {}
    for which, calls in counts.items():
        grouped: collections.Counter[str] = collections.Counter()
        for key, n in calls.items():
            grouped[package(key)] += n
        by_package[which] = {name: round(n, 1) for name, n in grouped.most_common()}
    keys = set(counts["service"]) | set(counts["bare"])

    def diff(key: str) -> float:
        return counts["service"].get(key, 0.0) - counts["bare"].get(key, 0.0)

    largest = [
        {
            "call": short(key),
            "service": round(counts["service"].get(key, 0.0), 2),
            "bare": round(counts["bare"].get(key, 0.0), 2),
        }
        for key in sorted(keys, key=lambda key: -abs(diff(key)))[:30]
    ]
    results: dict[str, Any] = {
        "jobs": args.jobs,
        "calls_per_job": totals,
        "by_package": by_package,
        "largest_differences": largest,
    }
    print(json.dumps({"calls_per_job": totals}))
    for name in sorted(set(by_package["service"]) | set(by_package["bare"])):
        print(
            f"  {name:24s} service {by_package['service'].get(name, 0):7.1f}"
            f"  bare {by_package['bare'].get(name, 0):7.1f}"
        )
    _results.write("call_count", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
