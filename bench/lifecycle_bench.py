"""Lifecycle benchmarks, measured side by side in one run; prints numbers and ratios.

    python bench/lifecycle_bench.py [--rounds 3] [--probes 20]

1. Drain latency: time from SIGTERM to the exit of the baked ``worker`` command
   (supervisor + 1 process, 4 threads) against the ideal, the longest remaining job
   at the moment of the signal (0 for an idle worker). Three shapes: idle; four jobs
   with 0.5 / 1.0 / 1.5 / 2.0 s left; 40 one-second jobs with SIGTERM after 1.5 s.
   Reported as the overhead in ms and the ratio to the ideal.
2. Throughput of 1 s jobs on 4 threads against the ideal (jobs x seconds / threads):
   the cost of fetch pauses between jobs.
3. Cost of one liveness probe: exec ``python -m <pkg> healthcheck live`` (what a
   Kubernetes exec probe runs) against HTTP GET /livez on the running exporter.

Bakes the template (``database=none``) into a temp dir and starts its own
redis-server on a free port.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results
import _workers

THREADS = 4

ACTORS = """
import os
import time

import dramatiq
import redis

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


@dramatiq.actor(queue_name="notifications", max_retries=0, time_limit=600_000)
def bench_sleep(job_id, seconds):
    _client.rpush("bench:start", f"{job_id} {time.time()} {seconds}")
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(0.05, left))
    _client.rpush("bench:done", job_id)
"""


class Bench:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.project = _workers.bake(root, {"bench_lifecycle": ACTORS}, database="none")
        self.redis = _workers.redis_server(root / "redis")
        self.client = redis.Redis.from_url(self.redis.url)
        self.env = _workers.worker_env(
            self.project,
            self.redis.url,
            root / "state",
            WORKER_CONCURRENCY=str(THREADS),
            WORKER_JOB_TIMEOUT_MS="20000",
            WORKER_SHUTDOWN_TIMEOUT_MS="25000",
        )
        self.metrics_port = int(self.env["METRICS_PORT"])

    def close(self) -> None:
        self.redis.stop()

    def start_worker(self) -> subprocess.Popen[bytes]:
        self.client.flushall()
        proc = _workers.start_worker(self.project, self.env)
        _workers.wait_started(self.client, proc)
        return proc

    def enqueue(self, job_id: str, seconds: float) -> None:
        _workers.push(self.client, [_workers.message("bench_sleep", job_id, seconds)])

    def starts(self) -> list[tuple[str, float, float]]:
        rows = []
        for raw in self.client.lrange("bench:start", 0, -1):
            job_id, stamp, seconds = raw.decode().split()
            rows.append((job_id, float(stamp), float(seconds)))
        return rows

    def term_and_time(self, proc: subprocess.Popen[bytes]) -> tuple[float, float]:
        """SIGTERM now; return (drain seconds, longest remaining job at the signal)."""
        sent_wall, sent = time.time(), time.monotonic()
        code = _workers.stop(proc, timeout=60, group=False)
        drain = time.monotonic() - sent
        if code != 0:
            raise SystemExit(f"worker exited {code}")
        done = {raw.decode() for raw in self.client.lrange("bench:done", 0, -1)}
        remaining = [
            stamp + seconds - sent_wall
            for job_id, stamp, seconds in self.starts()
            if job_id in done and stamp < sent_wall
        ]
        return drain, max([0.0, *remaining])

    def drain_idle(self) -> tuple[float, float]:
        proc = self.start_worker()
        time.sleep(0.5)
        return self.term_and_time(proc)

    def drain_staggered(self) -> tuple[float, float]:
        proc = self.start_worker()
        for index, seconds in enumerate((1.0, 1.5, 2.0, 2.5)):
            self.enqueue(f"s{index}", seconds)
        _workers.wait_for(lambda: self.client.llen("bench:start") == 4, 10, "four jobs")
        time.sleep(0.5)
        return self.term_and_time(proc)

    def drain_loaded(self) -> tuple[float, float]:
        proc = self.start_worker()
        for index in range(40):
            self.enqueue(f"l{index}", 1.0)
        _workers.wait_for(lambda: self.client.llen("bench:start"), 10, "the first job")
        time.sleep(1.5)
        return self.term_and_time(proc)

    def throughput(self, jobs: int = 24, seconds: float = 1.0) -> float:
        proc = self.start_worker()
        started = time.monotonic()
        for index in range(jobs):
            self.enqueue(f"t{index}", seconds)
        _workers.wait_for(lambda: self.client.llen("bench:done") == jobs, 120, "the jobs")
        elapsed = time.monotonic() - started
        _workers.stop(proc, timeout=60, group=False)
        return elapsed / (jobs * seconds / THREADS)

    def probes(self, count: int) -> tuple[float, float]:
        proc = self.start_worker()
        try:
            execs = []
            for _ in range(count):
                started = time.perf_counter()
                subprocess.run(
                    [_workers.PYTHON, "-m", _workers.PACKAGE, "healthcheck", "live"],
                    cwd=self.project,
                    env=self.env,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                execs.append(time.perf_counter() - started)
            url = f"http://127.0.0.1:{self.metrics_port}/livez"
            https = []
            for _ in range(count * 10):
                started = time.perf_counter()
                with urllib.request.urlopen(url, timeout=5) as response:
                    response.read()
                https.append(time.perf_counter() - started)
        finally:
            _workers.stop(proc, timeout=60, group=False)
        return statistics.median(execs) * 1000, statistics.median(https) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probes", type=int, default=20)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lifecycle-bench-"))
    bench = Bench(root)
    try:
        print(
            f"drain latency after SIGTERM, median of {args.rounds} (supervisor + 1 process, "
            f"{THREADS} threads)"
        )
        print(f"  {'shape':<34}{'drain s':>9}{'ideal s':>9}{'over ms':>9}{'ratio':>7}")
        shapes = [
            ("idle", bench.drain_idle),
            ("4 jobs, 0.5-2.0 s left", bench.drain_staggered),
            ("40 x 1 s jobs, TERM after 1.5 s", bench.drain_loaded),
        ]
        drains = []
        for name, measure in shapes:
            rounds = [measure() for _ in range(args.rounds)]
            drain = statistics.median(r[0] for r in rounds)
            ideal = statistics.median(r[1] for r in rounds)
            drains.append({"shape": name, "drain_s": drain, "ideal_s": ideal})
            ratio = f"{drain / ideal:7.2f}" if ideal > 0 else f"{'-':>7}"
            print(f"  {name:<34}{drain:9.3f}{ideal:9.3f}{(drain - ideal) * 1000:9.0f}{ratio}")
        ratio = bench.throughput()
        print(f"throughput of 1 s jobs on {THREADS} threads: {ratio:.2f} x the ideal time")
        exec_ms, http_ms = bench.probes(args.probes)
        print(
            f"liveness probe, median: exec healthcheck live {exec_ms:.1f} ms, "
            f"GET /livez {http_ms:.2f} ms (exec / http = {exec_ms / http_ms:.0f}x)"
        )
        _results.write(
            "lifecycle_bench",
            {
                "drain": drains,
                "throughput_vs_ideal": ratio,
                "probe_exec_ms": exec_ms,
                "probe_http_ms": http_ms,
            },
            rounds=args.rounds,
        )
    finally:
        bench.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
