"""Throughput: the service's own worker against bare Dramatiq 2.2.1, side by side in one run.

    python bench/throughput_bench.py [--rounds 3] [--quick] [--shape NAME ...]

Both run the same actor body (three small Redis writes per job, plus the job's
sleep) on the same redis-server, one worker process each, started once per
configuration (process start is not measured). Rounds alternate between the two
(service, bare, service, bare, ...) and each figure is the median of the rounds.
A round enqueues a pre-built batch in one pipeline and measures

* ``span``: from the first job's start to the last job's end (the jobs record both
  in Redis), the figure the table and the goals use: it is what throughput and the
  scaling law are about; and
* ``total``: from the enqueue to the last job's end, which adds the idle poll of an
  empty queue at the batch's start (service: at most 200 ms; Dramatiq: its
  ``worker_timeout``, 1 s by default).

Work shapes (issue #11): 48 jobs of 100 ms at 1, 2, 4 and 8 threads (reported in
slices of 100 ms against the ideal 48/threads), 3,000 near-no-op jobs at 8 threads,
1,000 jobs of 10 ms at 8 threads. Each shape runs twice: at each tool's defaults
(service: ``WORKER_PREFETCH`` = concurrency; Dramatiq: prefetch twice the threads),
and at equal prefetch (Dramatiq's ``dramatiq_queue_prefetch`` = the threads, the
service's default). Writes ``bench/results/throughput_bench-<UTC>.json`` (marked
``partial`` with ``--quick`` or ``--shape``: ``bench/report.py`` reports whole runs).

The figures depend on the machine's load: run it on a quiet machine and quote the
core count with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _workers  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SERVICE_QUEUE = _workers.QUEUE
BARE_QUEUE = "bare"

#: The actor body both tools run: three small Redis writes and the job's sleep.
BODY = '''
import os
import time

import dramatiq
import redis

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


def _run(run, ms):
    _client.zadd("bench:" + run + ":first", {"t": time.time()}, lt=True)
    if ms:
        time.sleep(ms / 1000)
    _client.zadd("bench:" + run + ":last", {"t": time.time()}, gt=True)
    _client.incr("bench:" + run + ":done")
'''
SERVICE_ACTOR = BODY + f'''

@dramatiq.actor(queue_name="{SERVICE_QUEUE}", max_retries=0)
def bench_job(run, ms):
    _run(run, ms)
'''
BARE_MODULE = BODY + f'''
from dramatiq.brokers.redis import RedisBroker

dramatiq.set_broker(RedisBroker(url=os.environ["REDIS_URL"]))


@dramatiq.actor(queue_name="{BARE_QUEUE}", max_retries=0)
def bench_job(run, ms):
    _run(run, ms)
'''

#: (name, jobs, ms per job, threads)
SHAPES = [
    ("48x100ms", 48, 100.0, 1),
    ("48x100ms", 48, 100.0, 2),
    ("48x100ms", 48, 100.0, 4),
    ("48x100ms", 48, 100.0, 8),
    ("3000xnoop", 3000, 0.0, 8),
    ("1000x10ms", 1000, 10.0, 8),
]


class Bench:
    """A redis-server, a baked service with the bench actor, and the bare Dramatiq module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.project = _workers.bake(root, {"bench_throughput": SERVICE_ACTOR}, database="none")
        bare = root / "bare"
        bare.mkdir()
        (bare / "bare_bench.py").write_text(BARE_MODULE)
        self.bare_dir = bare
        self.redis = _workers.redis_server(root / "redis")
        self.redis_url = self.redis.url
        self.client = redis.Redis.from_url(self.redis_url)
        self.runs = 0

    def close(self) -> None:
        self.redis.stop()

    def start_service(self, threads: int, prefetch: int | None) -> subprocess.Popen[bytes]:
        env = _workers.worker_env(
            self.project, self.redis_url, self.root / "state", WORKER_QUEUES=SERVICE_QUEUE,
            WORKER_CONCURRENCY=str(threads), WORKER_JOB_TIMEOUT_MS="20000",
            WORKER_SHUTDOWN_TIMEOUT_MS="25000")
        if prefetch is not None:
            env["WORKER_PREFETCH"] = str(prefetch)
        return self._started(_workers.start_worker(self.project, env, self._log(SERVICE_QUEUE)),
                             SERVICE_QUEUE)

    def start_bare(self, threads: int, prefetch: int | None) -> subprocess.Popen[bytes]:
        env = _workers.foreign_free_env(dict(os.environ))
        env.update(PYTHONPATH=str(self.bare_dir), REDIS_URL=self.redis_url)
        if prefetch is not None:
            env["dramatiq_queue_prefetch"] = str(prefetch)
        command = [_workers.PYTHON, "-m", "dramatiq", "bare_bench", "--processes", "1",
                   "--threads", str(threads)]
        return self._started(_workers.start(command, self.bare_dir, env, self._log(BARE_QUEUE)),
                             BARE_QUEUE)

    def _log(self, queue: str) -> Path:
        return self.root / f"{queue}.log"

    def _started(self, proc: subprocess.Popen[bytes], queue: str) -> subprocess.Popen[bytes]:
        self.round(queue, 4, 0.0)  # warm up: the worker consumes (imports done, threads up)
        return proc

    def round(self, queue: str, jobs: int, ms: float) -> dict[str, float]:
        """Run one pre-built batch on ``queue``; return its span and total in seconds."""
        self.runs += 1
        run = f"r{self.runs}"
        pipe = _workers.pipeline(
            self.client, [_workers.message("bench_job", run, ms, queue=queue) for _ in range(jobs)])
        enqueued = time.time()
        pipe.execute()
        _workers.wait_for(lambda: int(self.client.get(f"bench:{run}:done") or 0) >= jobs,
                          600, f"{jobs} jobs on {queue}")
        first = float(self.client.zscore(f"bench:{run}:first", "t") or 0)
        last = float(self.client.zscore(f"bench:{run}:last", "t") or 0)
        return {"span_s": last - first, "total_s": last - enqueued}


def measure(bench: Bench, shape: tuple[str, int, float, int], equal_prefetch: bool,
            rounds: int) -> dict[str, Any]:
    name, jobs, ms, threads = shape
    prefetch = threads if equal_prefetch else None
    procs = [bench.start_service(threads, None), bench.start_bare(threads, prefetch)]
    samples: dict[str, list[dict[str, float]]] = {"service": [], "bare": []}
    try:
        for index in range(rounds):
            order = [("service", SERVICE_QUEUE), ("bare", BARE_QUEUE)]
            for tool, queue in order if index % 2 == 0 else order[::-1]:
                samples[tool].append(bench.round(queue, jobs, ms))
    finally:
        for proc in procs:
            _workers.stop(proc)
    result: dict[str, Any] = {"shape": name, "jobs": jobs, "ms": ms, "threads": threads,
                              "prefetch": "equal" if equal_prefetch else "defaults"}
    for tool, rows in samples.items():
        span = statistics.median(row["span_s"] for row in rows)
        total = statistics.median(row["total_s"] for row in rows)
        result[tool] = {"span_s": round(span, 4), "total_s": round(total, 4),
                        "spans_s": [round(row["span_s"], 4) for row in rows]}
        if ms >= 100:
            result[tool]["slices"] = round(span / (ms / 1000), 2)
    if ms >= 100:
        result["ideal_slices"] = jobs / threads
        result["service_vs_ideal"] = round(result["service"]["slices"] / (jobs / threads), 3)
        result["bare_vs_ideal"] = round(result["bare"]["slices"] / (jobs / threads), 3)
    # Throughput ratio: > 1 means the service finished the batch faster than bare Dramatiq.
    result["throughput_vs_bare"] = round(result["bare"]["span_s"] / result["service"]["span_s"], 3)
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| work | threads | prefetch | bare Dramatiq | service | ideal | service/bare thr. |",
             "|---|---|---|---|---|---|---|"]
    for row in results:
        if "ideal_slices" in row:
            bare, ours = f"{row['bare']['slices']} slices", f"{row['service']['slices']} slices"
            ideal = f"{row['ideal_slices']:g}"
        else:
            bare, ours, ideal = f"{row['bare']['span_s']:.2f} s", f"{row['service']['span_s']:.2f} s", ""
        lines.append(f"| {row['shape']} | {row['threads']} | {row['prefetch']} | {bare} | {ours} "
                     f"| {ideal} | {row['throughput_vs_bare']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="defaults only, 1 round")
    parser.add_argument("--shape", action="append", choices=sorted({s[0] for s in SHAPES}),
                        help="only this work shape (repeatable; default: all)")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    modes = [False] if args.quick else [False, True]
    root = Path(tempfile.mkdtemp(prefix="throughput-bench-"))
    bench = Bench(root)
    results = []
    load_before = os.getloadavg()
    try:
        for equal in modes:
            for shape in SHAPES:
                if args.shape and shape[0] not in args.shape:
                    continue
                row = measure(bench, shape, equal, rounds)
                print(json.dumps(row), flush=True)
                results.append(row)
    finally:
        bench.close()
        shutil.rmtree(root, ignore_errors=True)
    print(table(results))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"throughput_bench-{stamp}.json"
    out.write_text(json.dumps({"cores": os.cpu_count(), "rounds": rounds,
                               "partial": bool(args.quick or args.shape),
                               "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                               "results": {"rows": results, "table": table(results)}}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
