"""``status`` and ``dlq list`` against a million messages and 50 simulated worker processes:
wall time and peak memory of each command, as an operator runs it.

    python bench/console_bench.py [--messages N] [--processes P] [--baseline-from DIR]

One redis-server holds ``--messages`` (default 1,000,000) waiting messages on
``notifications`` and as many dead letters on ``reports`` (written the way Dramatiq
and the worker write them, pipelined), and ``--processes`` (default 50) simulated worker
processes: a heartbeat, a process record with 4 running jobs, and an acks set of 4
deliveries each, as :class:`~.middleware.recovery.Recovery` publishes them.

Each command runs as a child process of the baked service (``python -m orders_worker``);
its wall time is measured around it and its peak memory is the child's ``ru_maxrss``
(``os.wait4``). ``status`` is also timed inside one process (``read_status`` alone, no
interpreter start). ``--baseline-from`` bakes another checkout of the template (e.g.
``/work/main`` before #27) and runs its ``dlq list`` on a tenth of the dead letters,
side by side. Writes ``bench/results/console_bench-<UTC>.json``.

    python bench/console_bench.py --worker-calls [--jobs N] [--window S] [--baseline REV]

The Redis calls the truthful status, the activity charts and the progress reports (#41)
added to a worker: one worker process of 8 threads of this build and of ``--baseline``
(default: the parent of the commit that added ``tests/test_status_truth.py``), each on
its own redis-server, counted with ``MONITOR`` (the bench's own connection and the job
body's calls, keys ``bench:*``, left out): per no-op job (``--jobs``, after 200 of
warm-up), per idle second (``--window``), and, on this build, per ``checkpoint(progress=,
note=)`` a handler makes. Round trips are the commands the worker sent; commands in
scripts are those its Lua ran. Counts and ratios in one run (no timing), written as a
``partial`` console_bench result (``"part": "worker_calls"``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis
from cookiecutter.main import cookiecutter

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results
import _workers
import flow_bench

DEAD_QUEUE = "reports"
BATCH = 20_000


def fill(client: redis.Redis, count: int) -> None:
    """``count`` waiting messages and ``count`` dead letters (2 reasons x 3 actors)."""
    now = int(time.time() * 1000)
    for start in range(0, count, BATCH):
        pipe = client.pipeline(transaction=False)
        for index in range(start, min(count, start + BATCH)):
            waiting = f"w{index:07d}"
            body = json.dumps(
                {
                    "queue_name": _workers.QUEUE,
                    "actor_name": "send_notification",
                    "args": [index],
                    "kwargs": {},
                    "options": {"redis_message_id": waiting},
                    "message_id": waiting,
                    "message_timestamp": now - 60_000,
                }
            )
            pipe.hset(f"{_workers.NS}:{_workers.QUEUE}.msgs", waiting, body)
            pipe.rpush(f"{_workers.NS}:{_workers.QUEUE}", waiting)
            dead = f"d{index:07d}"
            letter = json.dumps(
                {
                    "queue_name": DEAD_QUEUE,
                    "actor_name": f"build_report_{index % 3}",
                    "args": [index],
                    "kwargs": {},
                    "message_id": dead,
                    "message_timestamp": now - 3_600_000,
                    "options": {
                        "redis_message_id": dead,
                        "dead_letter_reason": "KeyError: 'q3'"
                        if index % 2
                        else "TimeoutError: partner",
                    },
                }
            )
            pipe.zadd(f"{_workers.NS}:{DEAD_QUEUE}.XQ", {dead: now - count + index})
            pipe.hset(f"{_workers.NS}:{DEAD_QUEUE}.XQ.msgs", dead, letter)
        pipe.execute()


def simulate(client: redis.Redis, processes: int) -> None:
    """``processes`` worker processes as Recovery publishes them: heartbeat, record, acks."""
    seconds, _ = client.time()
    now = int(seconds) * 1000
    pipe = client.pipeline(transaction=False)
    for index in range(processes):
        broker_id = f"bench-{index:03d}"
        jobs = [
            {
                "queue": _workers.QUEUE,
                "redis_id": f"w{index:03d}{slot}",
                "message_id": f"m{index}{slot}",
                "actor": "send_notification",
                "started_ms": now - 1000 * slot,
            }
            for slot in range(4)
        ]
        record = {
            "pool": "interactive",
            "host": f"orders-worker-{index // 2}",
            "pid": 100 + index,
            "queues": [_workers.QUEUE],
            "concurrency": 4,
            "started_ms": now,
            "jobs": jobs,
        }
        pipe.zadd(f"{_workers.NS}:__heartbeats__", {broker_id: now})
        pipe.set(f"{_workers.NS}:__process__.{broker_id}", json.dumps(record), px=600_000)
        pipe.sadd(
            f"{_workers.NS}:__acks__.{broker_id}.{_workers.QUEUE}",
            *[job["redis_id"] for job in jobs],
        )
    pipe.execute()


def measure(project: Path, env: dict[str, str], *args: str) -> dict[str, Any]:
    """Run ``python -m <package> *args``: wall seconds, peak RSS (MB), exit code, output size."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        child = subprocess.Popen(
            [_workers.PYTHON, "-m", _workers.package_of(project), *args],
            cwd=project,
            env=env,
            stdout=out,
            stderr=subprocess.DEVNULL,
        )
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        size = out.tell()
        out.seek(max(0, size - 300))
        tail = out.read().decode(errors="replace").strip().splitlines()[-1:]
    return {
        "args": list(args),
        "wall_s": round(wall, 3),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "exit": child.returncode,
        "output_bytes": size,
        "last_line": tail[0] if tail else "",
    }


IN_PROCESS = """
import json, sys, time
import redis
import {package}
from worker_runtime.status import read_status, pools_queues
client = redis.Redis.from_url(sys.argv[1])
queues = pools_queues()
times = []
for _ in range(5):
    start = time.perf_counter()
    status = read_status(client, queues)
    times.append(time.perf_counter() - start)
print(json.dumps({{"best_s": min(times), "median_s": sorted(times)[2],
                  "processes": len(status.processes),
                  "jobs": sum(len(p.jobs) for p in status.processes)}}))
"""


#: The actors the worker-calls part runs (in both builds: nothing newer than either): a
#: no-op job, and one reporting its progress (``checkpoint(progress=)``: this build only).
CALLS_ACTORS = """
import os

import dramatiq
import redis

from ..lifecycle import checkpoint

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


@dramatiq.actor(queue_name="notifications", max_retries=0)
def calls_noop(run):
    _client.incr("bench:" + run)


@dramatiq.actor(queue_name="notifications", max_retries=0)
def calls_progress(run, steps):
    for step in range(steps):
        checkpoint(progress=(step + 1) / steps, note=f"step {step + 1} of {steps}")
    _client.incr("bench:" + run)
"""


class Tally(threading.Thread):
    """What ``MONITOR`` shows inside a window, by command: ``sent`` (round trips a worker
    sent) and ``lua`` (run inside its scripts); the connection at ``ours`` (the bench's) and
    every command naming a ``bench:*`` key (the job body's) left out. A window opens and
    closes at marker commands the bench sends (``GET bench:mark:*``), so it is cut where
    Redis ran them, however far the monitor's reading lags behind."""

    START, STOP = "bench:mark:start", "bench:mark:stop"

    def __init__(self, url: str, ours: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.ours = ours
        self.counting = False
        self.closed = threading.Event()
        self.counts: dict[str, collections.Counter[str]] = {
            "sent": collections.Counter(),
            "lua": collections.Counter(),
        }

    def run(self) -> None:
        try:
            with self.client.monitor() as monitor:
                for command in monitor.listen():
                    words = command["command"].split(" ")
                    if f"{command['client_address']}:{command['client_port']}" == self.ours:
                        if words[-1] == self.START:
                            self.counting = True
                        elif words[-1] == self.STOP:
                            self.counting = False
                            self.closed.set()
                        continue
                    if not self.counting or any(word.startswith("bench:") for word in words):
                        continue
                    kind = "lua" if command["client_type"] == "lua" else "sent"
                    self.counts[kind][words[0].lower()] += 1
        except (redis.RedisError, OSError):
            return

    def window(self, client: redis.Redis, work: Any) -> dict[str, dict[str, int]]:
        """Count while ``work()`` runs (``client``: the bench's connection, at ``ours``):
        the counts of that window."""
        for counter in self.counts.values():
            counter.clear()
        self.closed.clear()
        client.get(self.START)
        try:
            work()
        finally:
            time.sleep(0.3)  # what the last settlement sends after the job body
            client.get(self.STOP)
            self.closed.wait(60)
        return {kind: dict(counter) for kind, counter in self.counts.items()}


def per(counts: dict[str, dict[str, int]], unit: float) -> dict[str, Any]:
    """``counts`` divided by ``unit`` (jobs, seconds, checkpoints), with totals."""
    return {
        **{f"{kind}_total": round(sum(c.values()) / unit, 3) for kind, c in counts.items()},
        **{
            kind: {k: round(v / unit, 3) for k, v in sorted(c.items())}
            for kind, c in counts.items()
        },
    }


def run_jobs(client: redis.Redis, tally: Tally, run: str, jobs: int, actor: str, *args: Any) -> Any:
    """Stage ``jobs`` messages of ``actor`` (uncounted), release them and count until the
    last one's body ran: the window's counts."""
    staged = f"bench:staging:{run}"
    pipe = client.pipeline(transaction=False)
    for _ in range(jobs):
        item = _workers.message(actor, run, *args)
        redis_id = item.options["redis_message_id"]
        pipe.hset(f"{_workers.NS}:{_workers.QUEUE}.msgs", redis_id, item.encode())
        pipe.rpush(staged, redis_id)
    pipe.execute()

    def work() -> None:
        client.rename(staged, f"{_workers.NS}:{_workers.QUEUE}")
        client.publish(f"{_workers.NS}:__wake__", _workers.QUEUE)
        _workers.wait_for(lambda: int(client.get("bench:" + run) or 0) >= jobs, 600, run)

    return tally.window(client, work)


def worker_calls(root: Path, builds: dict[str, Path], jobs: int, window_s: float) -> dict[str, Any]:
    """Each build's Redis calls per job, per idle second and (this build) per checkpoint."""
    found: dict[str, Any] = {}
    for name, project in builds.items():
        server = _workers.redis_server(root / f"redis-calls-{name}")
        process = flow_bench.start(project, server, root, f"calls-{name}", WORKER_CONCURRENCY="8")
        client = redis.Redis.from_url(server.url, single_connection_client=True)
        tally = Tally(server.url, str(client.client_info()["addr"]))
        tally.start()
        try:
            time.sleep(0.5)  # the monitor is attached
            run_jobs(client, tally, "warm", 200, "calls_noop")
            found[name] = {
                "per_job": per(run_jobs(client, tally, "jobs", jobs, "calls_noop"), jobs)
            }
            found[name]["per_idle_s"] = per(
                tally.window(client, lambda: time.sleep(window_s)), window_s
            )
            if name == "this":
                steps, few = 20, max(50, jobs // 10)
                plain = run_jobs(client, tally, "p0", few, "calls_progress", 0)
                reported = run_jobs(client, tally, "p20", few, "calls_progress", steps)
                found[name]["per_checkpoint"] = {
                    kind: round(
                        (sum(reported[kind].values()) - sum(plain[kind].values())) / (few * steps),
                        4,
                    )
                    for kind in ("sent", "lua")
                }
        finally:
            _workers.stop(process)
            client.close()
            server.stop()
        print(name, found[name], flush=True)
    if "baseline" in found:
        this, base = found["this"], found["baseline"]
        for unit in ("per_job", "per_idle_s"):
            for kind in ("sent", "lua"):
                key = f"{kind}_total"
                found[f"{unit}_{kind}_ratio"] = round(
                    this[unit][key] / max(base[unit][key], 1e-9), 3
                )
                names = set(this[unit][kind]) | set(base[unit][kind])
                found[f"{unit}_{kind}_added"] = {
                    n: round(this[unit][kind].get(n, 0) - base[unit][kind].get(n, 0), 3)
                    for n in sorted(names)
                    if abs(this[unit][kind].get(n, 0) - base[unit][kind].get(n, 0)) >= 0.005
                }
    return found


def default_calls_baseline() -> str:
    added = flow_bench.git(
        "log", "--diff-filter=A", "--format=%H", "--", "tests/test_status_truth.py"
    ).splitlines()
    if not added:
        raise SystemExit("no commit adds tests/test_status_truth.py: give --baseline")
    return flow_bench.git("rev-parse", f"{added[-1]}^")


def calls_main(args: argparse.Namespace) -> None:
    revision = args.baseline or default_calls_baseline()
    with tempfile.TemporaryDirectory(prefix="console-calls-") as tmp:
        root = Path(tmp)
        this = _workers.add_actors(
            flow_bench.bake_project(root / "this", database="none"), flow_bench=CALLS_ACTORS
        )
        baseline = flow_bench.bake_at(revision, root / "baseline", CALLS_ACTORS)
        results = {
            "baseline_revision": revision,
            "head": flow_bench.git("rev-parse", "HEAD"),
            "jobs": args.jobs,
            "window_s": args.window,
            **worker_calls(root, {"this": this, "baseline": baseline}, args.jobs, args.window),
        }
    # partial: kept beside the full runs, not the one bench/report.py summarises
    _results.write("console_bench", results, part="worker_calls", partial=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--processes", type=int, default=50)
    parser.add_argument("--baseline-from", type=Path, help="another checkout of the template")
    parser.add_argument(
        "--worker-calls", action="store_true", help="only the Redis calls a worker makes"
    )
    parser.add_argument("--jobs", type=int, default=2000, help="--worker-calls: no-op jobs")
    parser.add_argument("--window", type=float, default=20.0, help="--worker-calls: idle s")
    parser.add_argument("--baseline", help="--worker-calls: the template revision compared")
    args = parser.parse_args()
    if args.worker_calls:
        calls_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        project = _workers.bake(root / "bake", database="none")
        server = _workers.redis_server(root / "redis")
        try:
            client = redis.Redis.from_url(server.url)
            started = time.perf_counter()
            fill(client, args.messages)
            simulate(client, args.processes)
            print(
                f"filled {args.messages:,} + {args.messages:,} and {args.processes} processes "
                f"in {time.perf_counter() - started:.0f} s; Redis uses "
                f"{client.info('memory')['used_memory'] / 2**20:.0f} MiB",
                flush=True,
            )
            env = _workers.foreign_free_env(_workers.project_env(project, REDIS_URL=server.url))
            results: dict[str, Any] = {"messages": args.messages, "processes": args.processes}
            inner = subprocess.run(
                [_workers.PYTHON, "-c", IN_PROCESS.format(package=_workers.PACKAGE), server.url],
                cwd=project,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results["status_read"] = json.loads(inner.stdout)
            print("status read_status:", results["status_read"], flush=True)
            for name, command in (
                ("status", ("status",)),
                ("status_json", ("status", "--json")),
                ("dlq_list", ("dlq", "list", "--queue", DEAD_QUEUE)),
                ("dlq_list_json", ("dlq", "list", "--queue", DEAD_QUEUE, "--json")),
            ):
                results[name] = measure(project, env, *command)
                print(name, results[name], flush=True)
            if args.baseline_from:
                base = Path(
                    cookiecutter(
                        str(args.baseline_from),
                        no_input=True,
                        output_dir=str(root / "base"),
                        extra_context={"database": "none"},
                    )
                )
                tenth = args.messages // 10
                zset = f"{_workers.NS}:{DEAD_QUEUE}.XQ"
                while client.zcard(zset) > tenth:  # in steps: one big removal outlasts a
                    client.zremrangebyrank(zset, tenth, tenth + 49_999)  # loaded socket timeout
                base_env = _workers.foreign_free_env(
                    _workers.project_env(base, REDIS_URL=server.url)
                )
                results["baseline_letters"] = tenth
                results["baseline_dlq_list"] = measure(
                    base, base_env, "dlq", "list", "--queue", DEAD_QUEUE
                )
                results["dlq_list_at_baseline"] = measure(
                    project, env, "dlq", "list", "--queue", DEAD_QUEUE
                )
                print("baseline", results["baseline_dlq_list"], results["dlq_list_at_baseline"])
        finally:
            server.stop()
    _results.write("console_bench", results)


if __name__ == "__main__":
    main()
