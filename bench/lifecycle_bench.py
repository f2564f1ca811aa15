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
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from cookiecutter.main import cookiecutter
from dramatiq.message import Message

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

TEMPLATE = Path(__file__).resolve().parents[1]
QUEUE = "notifications"
PACKAGE = "orders_worker"
THREADS = 4

ACTORS = '''
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
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.005)


class Bench:
    def __init__(self, root: Path) -> None:
        self.root = root
        project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(root),
                                    extra_context={"database": "none"}))
        (project / "src" / PACKAGE / "actors" / "bench_lifecycle.py").write_text(ACTORS)
        self.project = project
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.redis_proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.redis_port),
             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(root)],
            stdout=subprocess.DEVNULL)
        self.client = redis.Redis.from_url(self.redis_url)
        wait_for(self._pong, 10, "redis-server")
        self.metrics_port = free_port()
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("WORKER_", "REDIS_", "DATABASE_"))}
        self.env.update(PYTHONPATH=str(project / "src"), WORKER_POOL="interactive",
                        REDIS_URL=self.redis_url, WORKER_STATE_DIR=str(root / "state"),
                        METRICS_PORT=str(self.metrics_port), WORKER_PROCESSES="1",
                        WORKER_CONCURRENCY=str(THREADS), WORKER_JOB_TIMEOUT_MS="20000",
                        WORKER_SHUTDOWN_TIMEOUT_MS="25000")

    def _pong(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def close(self) -> None:
        self.redis_proc.terminate()
        self.redis_proc.wait()

    def start_worker(self) -> subprocess.Popen[bytes]:
        self.client.flushall()
        proc = subprocess.Popen([sys.executable, "-m", PACKAGE, "worker"], cwd=self.project,
                                env=self.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: self.client.zcard("dramatiq:__heartbeats__"), 30, "the worker")
        return proc

    def enqueue(self, job_id: str, seconds: float) -> None:
        message: Message[Any] = Message(queue_name=QUEUE, actor_name="bench_sleep",
                                        args=(job_id, seconds), kwargs={}, options={})
        redis_id = message.message_id
        message = message.copy(options={"redis_message_id": redis_id})
        self.client.hset(f"dramatiq:{QUEUE}.msgs", redis_id, message.encode())
        self.client.rpush(f"dramatiq:{QUEUE}", redis_id)

    def starts(self) -> list[tuple[str, float, float]]:
        rows = []
        for raw in self.client.lrange("bench:start", 0, -1):
            job_id, stamp, seconds = raw.decode().split()
            rows.append((job_id, float(stamp), float(seconds)))
        return rows

    def term_and_time(self, proc: subprocess.Popen[bytes]) -> tuple[float, float]:
        """SIGTERM now; return (drain seconds, longest remaining job at the signal)."""
        sent_wall, sent = time.time(), time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        drain = time.monotonic() - sent
        if code != 0:
            raise SystemExit(f"worker exited {code}")
        done = {raw.decode() for raw in self.client.lrange("bench:done", 0, -1)}
        remaining = [stamp + seconds - sent_wall for job_id, stamp, seconds in self.starts()
                     if job_id in done and stamp < sent_wall]
        return drain, max([0.0, *remaining])

    def drain_idle(self) -> tuple[float, float]:
        proc = self.start_worker()
        time.sleep(0.5)
        return self.term_and_time(proc)

    def drain_staggered(self) -> tuple[float, float]:
        proc = self.start_worker()
        for index, seconds in enumerate((1.0, 1.5, 2.0, 2.5)):
            self.enqueue(f"s{index}", seconds)
        wait_for(lambda: self.client.llen("bench:start") == 4, 10, "four jobs")
        time.sleep(0.5)
        return self.term_and_time(proc)

    def drain_loaded(self) -> tuple[float, float]:
        proc = self.start_worker()
        for index in range(40):
            self.enqueue(f"l{index}", 1.0)
        wait_for(lambda: self.client.llen("bench:start"), 10, "the first job")
        time.sleep(1.5)
        return self.term_and_time(proc)

    def throughput(self, jobs: int = 24, seconds: float = 1.0) -> float:
        proc = self.start_worker()
        started = time.monotonic()
        for index in range(jobs):
            self.enqueue(f"t{index}", seconds)
        wait_for(lambda: self.client.llen("bench:done") == jobs, 120, "the jobs")
        elapsed = time.monotonic() - started
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        return elapsed / (jobs * seconds / THREADS)

    def probes(self, count: int) -> tuple[float, float]:
        proc = self.start_worker()
        try:
            execs = []
            for _ in range(count):
                started = time.perf_counter()
                subprocess.run([sys.executable, "-m", PACKAGE, "healthcheck", "live"],
                               cwd=self.project, env=self.env, check=True,
                               stdout=subprocess.DEVNULL)
                execs.append(time.perf_counter() - started)
            url = f"http://127.0.0.1:{self.metrics_port}/livez"
            https = []
            for _ in range(count * 10):
                started = time.perf_counter()
                with urllib.request.urlopen(url, timeout=5) as response:
                    response.read()
                https.append(time.perf_counter() - started)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        return statistics.median(execs) * 1000, statistics.median(https) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probes", type=int, default=20)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lifecycle-bench-"))
    bench = Bench(root)
    try:
        print(f"drain latency after SIGTERM, median of {args.rounds} (supervisor + 1 process, "
              f"{THREADS} threads)")
        print(f"  {'shape':<34}{'drain s':>9}{'ideal s':>9}{'over ms':>9}{'ratio':>7}")
        shapes = [("idle", bench.drain_idle),
                  ("4 jobs, 0.5-2.0 s left", bench.drain_staggered),
                  ("40 x 1 s jobs, TERM after 1.5 s", bench.drain_loaded)]
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
        print(f"liveness probe, median: exec healthcheck live {exec_ms:.1f} ms, "
              f"GET /livez {http_ms:.2f} ms (exec / http = {exec_ms / http_ms:.0f}x)")
        _results.write("lifecycle_bench", {"drain": drains, "throughput_vs_ideal": ratio,
                                           "probe_exec_ms": exec_ms, "probe_http_ms": http_ms},
                       rounds=args.rounds)
    finally:
        bench.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
