"""Metrics benchmarks, measured side by side in one run; prints ratios (not a timed test).

    python bench/metrics_bench.py [--messages 10000] [--rounds 3] [--big 1000000]

1. Scrape cost: GET /metrics from the exporter (multiprocess collector + backlog read from
   Redis at scrape time) with 0, 10,000 and 1,000,000 messages waiting; the ratio to the
   empty case shows the backlog read is O(1) in the queue's length.
2. Throughput of a no-op actor through the service's full middleware stack (the baked
   ``worker`` command: supervisor, 1 process, metrics, progress, attempts, retries, ...)
   against bare Dramatiq (default middleware) on the same Redis, same queue, same threads
   and prefetch; rounds alternate so both see the same machine. Target: >= 0.95 of bare.

Bakes the template into a temp dir and starts its own redis-server on a free port.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results
import _workers
from _workers import PACKAGE, QUEUE

THREADS = 8

NOOP_ACTOR = """
import dramatiq


@dramatiq.actor(queue_name="notifications", max_retries=0)
def bench_noop(n):
    pass
"""

BARE_WORKER = """
import sys, time
import dramatiq
from dramatiq.brokers.redis import RedisBroker

broker = RedisBroker(url=sys.argv[1])
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="notifications", max_retries=0)
def bench_noop(n):
    pass


worker = dramatiq.Worker(broker, queues={"notifications"}, worker_threads=int(sys.argv[2]))
if sys.argv[3] != "default":
    worker.queue_prefetch = int(sys.argv[3])
worker.start()
while True:
    time.sleep(1)
"""


STACK_WORKER = '''
"""Our broker and full middleware stack, in a Worker with Dramatiq's default prefetch."""
import os, sys, time
from pathlib import Path
import dramatiq
from orders_worker import actors  # noqa: F401
from orders_worker.lifecycle import LIFECYCLE
from orders_worker.broker import broker
from orders_worker.boards import ProgressBoard

broker.emit_after("process_boot")
board = ProgressBoard(Path(os.environ["WORKER_STATE_DIR"]), int(sys.argv[1]), broker.broker_id)
LIFECYCLE.attach(board)
worker = dramatiq.Worker(broker, queues={"notifications"}, worker_threads=int(sys.argv[1]))
worker.start()
while True:
    time.sleep(1)
    board.tick()
'''


def fill(client: redis.Redis, count: int, actor: str = "bench_noop") -> None:
    """Enqueue ``count`` messages of ``actor``, numbered from 0."""
    _workers.push(client, (_workers.message(actor, n) for n in range(count)))


def env_for(project: Path, redis_url: str, state: Path) -> dict[str, str]:
    return _workers.worker_env(
        project, redis_url, state, WORKER_CONCURRENCY=str(THREADS), LOG_LEVEL="INFO"
    )


# -- 1. scrape cost ---------------------------------------------------------------------------


def scrape_ms(url: str, samples: int = 40) -> float:
    timings = []
    for _ in range(samples):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as response:
            response.read()
        timings.append((time.perf_counter() - started) * 1000)
    return statistics.median(timings)


def bench_scrape(project: Path, redis_url: str, work: Path, big: int) -> dict[str, Any]:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    state = work / "scrape-state"
    (state / "metrics").mkdir(parents=True)
    env = env_for(project, redis_url, state)
    port = env["METRICS_PORT"]
    env["PROMETHEUS_MULTIPROC_DIR"] = str(state / "metrics")
    code = (
        f"import time; import {PACKAGE}; from worker_runtime import exporter; "
        "from worker_runtime.settings import load_settings; "
        "exporter.start_exporter(load_settings()); time.sleep(3600)"
    )
    exporter = subprocess.Popen(
        [sys.executable, "-c", code], cwd=project, env=env, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        for _ in range(200):
            try:
                scrape_ms(url, 1)
                break
            except OSError:
                time.sleep(0.05)
        results: dict[int, float] = {}
        eval_us: dict[int, float] = {}
        waiting = 0
        for target in (0, 10_000, big):
            fill(client, target - waiting)
            waiting = target
            assert client.llen(f"dramatiq:{QUEUE}") == target
            scrape_ms(url, 5)  # warm up (the exporter's connection, a rehashing hash)
            client.config_resetstat()
            results[target] = scrape_ms(url)
            eval_us[target] = float(client.info("commandstats")["cmdstat_eval"]["usec_per_call"])
        print("\n== scrape GET /metrics (median of 40), messages waiting in one queue")
        base, base_us = results[0], eval_us[0]
        for target, ms in results.items():
            print(
                f"  {target:>9,} waiting: {ms:7.2f} ms  ratio to empty {ms / base:5.2f}   "
                f"Redis time of the backlog call {eval_us[target]:6.1f} us  "
                f"ratio {eval_us[target] / base_us:5.2f}"
            )
        return {"scrape_ms": results, "eval_us": eval_us}
    finally:
        exporter.terminate()
        exporter.wait()
        client.flushall()


# -- 2. throughput ----------------------------------------------------------------------------


def drain_rate(
    client: redis.Redis, count: int, start_worker: list[str], cwd: Path, env: dict[str, str]
) -> float:
    """Messages/s from the first message taken to the last one acked."""
    client.flushall()
    fill(client, count)
    worker = _workers.start(start_worker, cwd, env)
    try:
        bodies = f"dramatiq:{QUEUE}.msgs"

        def taken() -> bool:
            if worker.poll() is not None:
                raise RuntimeError("the worker did not start")
            return client.hlen(bodies) < count

        _workers.wait_for(taken, 600, "the worker to take a message")
        started = time.perf_counter()
        _workers.wait_for(lambda: not client.hlen(bodies), 600, "the worker to finish")
        elapsed = time.perf_counter() - started
    finally:
        _workers.stop(worker)
    return count / elapsed


def bench_throughput(
    project: Path, redis_url: str, work: Path, count: int, rounds: int
) -> dict[str, Any]:
    client = redis.Redis.from_url(redis_url)
    bare_script = work / "bare_worker.py"
    bare_script.write_text(BARE_WORKER)
    stack_script = work / "stack_worker.py"
    stack_script.write_text(STACK_WORKER)
    bare, bare_default, ours, stack = [], [], [], []
    bare_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for index in range(rounds):
        bare.append(
            drain_rate(
                client,
                count,
                [sys.executable, str(bare_script), redis_url, str(THREADS), str(THREADS)],
                work,
                bare_env,
            )
        )
        bare_default.append(
            drain_rate(
                client,
                count,
                [sys.executable, str(bare_script), redis_url, str(THREADS), "default"],
                work,
                bare_env,
            )
        )
        state = work / f"state-{index}"
        ours.append(
            drain_rate(
                client,
                count,
                [sys.executable, "-m", PACKAGE, "worker"],
                project,
                env_for(project, redis_url, state),
            )
        )
        env = env_for(project, redis_url, work / f"stack-{index}")
        (work / f"stack-{index}" / "metrics").mkdir(parents=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(work / f"stack-{index}" / "metrics")
        stack.append(
            drain_rate(
                client, count, [sys.executable, str(stack_script), str(THREADS)], project, env
            )
        )
        print(
            f"  round {index + 1}: bare {bare[-1]:6.0f}   ours {ours[-1]:6.0f}   "
            f"bare, default prefetch {bare_default[-1]:6.0f}   our stack, default prefetch "
            f"{stack[-1]:6.0f} msg/s"
        )
    b, o = statistics.median(bare), statistics.median(ours)
    d = statistics.median(bare_default)
    print(
        f"\n== throughput, no-op actor, 1 process x {THREADS} threads, {count:,} messages, "
        f"median of {rounds}"
    )
    print(f"  bare Dramatiq, prefetch = threads (as ours):   {b:8.0f} msg/s")
    print(f"  full stack (ours):                             {o:8.0f} msg/s")
    print(f"  ratio ours / bare:                             {o / b:8.3f}   (target >= 0.95)")
    print(f"  bare Dramatiq, default prefetch (2 x threads): {d:8.0f} msg/s")
    print(
        f"  ratio ours / bare with default prefetch:       {o / d:8.3f}   (our default "
        "WORKER_PREFETCH = concurrency; raise it per pool for very short jobs)"
    )
    m = statistics.median(stack)
    print(f"  our middleware stack, default prefetch:        {m:8.0f} msg/s")
    print(f"  ratio stack / bare, both default prefetch:     {m / d:8.3f}   (middleware cost)")
    return {
        "bare": b,
        "ours": o,
        "bare_default_prefetch": d,
        "stack_default_prefetch": m,
        "messages": count,
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big", type=int, default=1_000_000)
    parser.add_argument("--skip-scrape", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="metrics-bench-") as tmp:
        work = Path(tmp)
        project = _workers.bake(
            work / "bake", {"bench_noop": NOOP_ACTOR}, database="none", sandbox_pool="no"
        )
        server = _workers.redis_server(work / "redis")
        redis_url = server.url
        try:
            numbers: dict[str, Any] = {}
            if not args.skip_scrape:
                numbers.update(bench_scrape(project, redis_url, work, args.big))
            if not args.skip_throughput:
                numbers["throughput"] = bench_throughput(
                    project, redis_url, work, args.messages, args.rounds
                )
            _results.write("metrics_bench", numbers)
        finally:
            server.stop()
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
