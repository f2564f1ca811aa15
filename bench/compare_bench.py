"""Where the runtimes really differ: the service, bare Dramatiq 2.2.1 and Celery 5.6 side by side
in one run, and the distance of the service to Redis's own ceiling (issue #29).

    python bench/compare_bench.py [--quick] [--only PART ...] [--jobs N] [--bound S]

The runtimes, the job body and the staged batches are ``bench/_tools.py``'s (the same as
``throughput_bench.py``'s), on one redis-server. The parts, each a ratio in this run:

* ``scaling``: no-op jobs (``--noop``, default 3,000) at 8 threads, 1 process against 2
  (the service's ``WORKER_PROCESSES``, ``dramatiq --processes``, two Celery nodes with the
  threads pool), rounds alternating between all six workers; the medians' jobs/s.
* ``ceiling``: what Redis itself allows for one settle-and-fetch call per job: a pipelined
  client loop (32 calls per round trip) running the service's own SETTLE script (the baked
  ``layout``) over a pre-filled queue, with 1, 2 and 3 client processes, alone and with the job
  body's three writes beside each call; with Redis's own time per call (``INFO
  commandstats``) and redis-server's CPU time per call (``/proc``), whose inverse is what
  its one core allows. The service's no-op throughput at 1 and 2 processes (``scaling``) as a
  fraction of it.
* ``profile``: a no-op batch on one service process with ``py-spy record --gil`` on its
  worker process: where the interpreter's time goes (self time per module, the service's
  functions inclusive), with the CPU seconds per job of the worker process and of
  redis-server (``/proc``) beside the wall time per job.
* ``head_of_line``: two worker processes of one handler thread each (Celery: two nodes
  ``-c 1``), at each tool's defaults; one long job (``--long``, 3 s) released with 20 no-op
  jobs behind it. Each short job's wait (release to start), and how many waited behind the
  long one (longer than half of it) while the other process was free.
* ``redelivery``: one worker process of 2 threads per runtime (all at once, each on its
  queue) holding 6 jobs of 3 s; SIGKILL to the whole worker while its 2 first jobs run, a
  fresh worker started at once; the time from the kill until every job ran to the end, or
  how many had when ``--bound`` seconds (default 90) passed. Celery's Redis transport
  redelivers an unacknowledged message after its ``visibility_timeout`` (3,600 s by
  default); with early acks (its default) a running job is already acknowledged and lost.
* ``footprint``: per runtime (1 process, 8 threads, its defaults), resident memory of all its
  processes at idle and after ``--jobs`` (default 10,000) no-op jobs (RSS, and PSS: a forked
  child's pages shared with its parent counted once), and Redis round trips
  (``INFO stats``: ``total_reads_processed``, one per request a client sends, a pipeline's
  included) and commands (``total_commands_processed``: a script's own counted one by one)
  per idle second over ``--window`` s and per job, less the bench's own calls and the job
  body's three.

Writes ``bench/results/compare_bench-<UTC>.json`` (``partial`` with ``--quick`` or
``--only``); ``bench/report.py`` reads it. The figures depend on the machine's load: the
core count and the load averages are in the JSON.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import queue as queue_module
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results
import _tools
import _workers

PARTS = ("scaling", "ceiling", "profile", "head_of_line", "redelivery", "footprint")
#: Calls per round trip of the ceiling loop (the consumer's handler threads settle one each).
CEILING_PIPELINE = 32
#: Client processes of the ceiling loop (the best is the ceiling).
CEILING_CLIENTS = (1, 2, 3)
SHORT_JOBS = 20
#: Phases of a job in the profile: a sample counts for a phase when a frame of its stack runs
#: the function named (qualified as py-spy names it).
PHASES = {
    "job body": "Actor.__call__",
    "middleware before": "SettlingRedisBroker.emit_before",
    "middleware after": "SettlingRedisBroker.emit_after",
    "settle + take next": "SettlingConsumer._settle",
}
REDELIVERY_JOBS = 6


# -- scaling ---------------------------------------------------------------------------
def scaling(bench: _tools.Bench, jobs: int, rounds: int, tools: list[str]) -> dict[str, Any]:
    configs = [
        (tool, processes)
        for tool in ("service", "bare", "celery_threads")
        for processes in (1, 2)
        if tool in tools
    ]
    workers = []
    try:
        for index, (tool, processes) in enumerate(configs):
            workers.append(bench.start(tool, 8, processes=processes, queue=index % 2))
        spans: dict[int, list[float]] = {id(w): [] for w in workers}
        for index in range(rounds):
            for worker in _tools.rotate(workers, index):
                spans[id(worker)].append(bench.round(worker, jobs, 0.0)["span_s"])
    finally:
        for worker in workers:
            bench.stop(worker)
    result: dict[str, Any] = {"jobs": jobs, "threads": 8, "rounds": rounds}
    for worker in workers:
        median = statistics.median(spans[id(worker)])
        entry = result.setdefault(worker.tool, {})
        entry[f"{worker.processes}p"] = {
            "span_s": round(median, 4),
            "jobs_per_s": round(jobs / median, 1),
            "spans_s": [round(s, 4) for s in spans[id(worker)]],
        }
    for worker in workers:
        entry = result[worker.tool]
        entry["two_vs_one"] = round(entry["2p"]["jobs_per_s"] / entry["1p"]["jobs_per_s"], 3)
    return result


# -- ceiling ---------------------------------------------------------------------------
def _report(out: Any, procs: list[Any]) -> Any:
    """The next client's report; a client that died says so at once (not after 600 s)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1)
        except queue_module.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise SystemExit(f"a ceiling client failed (exit {failed[0]}): see its traceback")
    raise SystemExit("the ceiling clients sent no report within 600 s")


def _ceiling_client(
    url: str, sha: str, keys: list[str], broker_id: str, queue: str, body: bool, go: Any, out: Any
) -> None:
    from worker_runtime import layout

    client = redis.Redis.from_url(url)
    lanes = ["none"] * CEILING_PIPELINE  # a first call takes a message and settles nothing
    go.wait()
    started, done = time.time(), 0
    while lanes:
        pipe = client.pipeline(transaction=False)
        for redis_id in lanes:
            # the message id is the redis id here (the pre-filled index says so)
            argv = layout.settle_args(("ack", redis_id, "", ""), broker_id, 1, redis_id, queue)
            pipe.evalsha(sha, len(keys), *keys, *argv)
            if body and redis_id != "none":
                pipe.zadd("ceiling:first", {"t": time.time()}, lt=True)
                pipe.zadd("ceiling:last", {"t": time.time()}, gt=True)
                pipe.incr("ceiling:done")
        replies = [r for r in pipe.execute() if isinstance(r, list)]
        done += sum(int(r[0]) for r in replies)
        # each reply: settled, then what it took (layout.taken reads it: one id or none)
        lanes = [redis_id for r in replies for redis_id, _ in layout.taken(r, head=1)[1]]
    out.put((started, time.time(), done))


def ceiling(bench: _tools.Bench, jobs: int) -> dict[str, Any]:
    """The pipelined loop over the service's own SETTLE script (see the module docstring)."""
    layout = bench.layout
    client = bench.client
    redis_pid = int(client.info("server")["process_id"])
    sha = client.script_load(layout.SETTLE)
    queue = "ceiling"
    body = _workers.message("bench_notifications", "r0", 0.0, queue=queue).encode()
    result: dict[str, Any] = {"jobs": jobs, "pipeline": CEILING_PIPELINE}
    context = multiprocessing.get_context("fork")

    def fill(count: int) -> None:
        ids = [f"c{i}" for i in range(count)]
        for start in range(0, count, 5000):
            pipe = client.pipeline(transaction=False)
            pipe.hset(
                f"{_workers.NS}:{queue}.msgs", mapping={i: body for i in ids[start : start + 5000]}
            )
            pipe.rpush(f"{_workers.NS}:{queue}", *ids[start : start + 5000])
            pipe.hset(
                layout.message_index_key(),
                mapping={i: layout.message_place(queue, i) for i in ids[start : start + 5000]},
            )
            pipe.execute()

    # redis-benchmark (a C client: 8 connections, 16 calls per round trip) runs the script
    # on the pre-filled queue; the id it settles is random (an ack that finds nothing: the
    # script's removal from the acks set misses and its HDELs are skipped).
    calls = max(jobs * 2, 50_000)
    fill(calls)
    keys = list(layout.settle_keys("ceiling-bench", queue, queue))
    # An ack of a random id, then take one for the same broker (the script's own ARGV order).
    settlement = ("ack", "__rand_int__", "", "")
    argv = [
        str(a) for a in layout.settle_args(settlement, "ceiling-bench", 1, "__rand_int__", queue)
    ]
    cpu = _cpu_s(redis_pid)
    bench_run = subprocess.run(
        [
            "redis-benchmark",
            "-h",
            "127.0.0.1",
            "-p",
            str(bench.redis.port),
            "-n",
            str(calls),
            "-c",
            "8",
            "-P",
            "16",
            "--csv",
            "EVALSHA",
            sha,
            str(len(keys)),
            *keys,
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    cpu = _cpu_s(redis_pid) - cpu
    rps = float(bench_run.stdout.strip().splitlines()[-1].split('","')[1])
    result["redis_benchmark"] = {
        "calls": calls,
        "connections": 8,
        "pipeline": 16,
        "jobs_per_s": round(rps, 1),
        "left_in_queue": client.llen(f"{_workers.NS}:{queue}"),
        "redis_cpu_us_per_job": round(cpu / calls * 1e6, 2),
    }
    client.delete(
        f"{_workers.NS}:{queue}", f"{_workers.NS}:{queue}.msgs", keys[0], layout.message_index_key()
    )
    for with_body in (False, True):
        for clients in CEILING_CLIENTS:
            fill(jobs)
            client.config_resetstat()
            go, out = context.Event(), context.Queue()
            procs = []
            for index in range(clients):
                broker_id = f"ceiling-{index}"
                keys = list(layout.settle_keys(broker_id, queue, queue))
                procs.append(
                    context.Process(
                        target=_ceiling_client,
                        args=(bench.redis_url, sha, keys, broker_id, queue, with_body, go, out),
                    )
                )
            for proc in procs:
                proc.start()
            time.sleep(0.5)
            redis_cpu = _cpu_s(redis_pid)
            go.set()
            reports = [_report(out, procs) for _ in procs]
            redis_cpu = _cpu_s(redis_pid) - redis_cpu
            for proc in procs:
                proc.join()
            stats = client.info("commandstats")
            calls = stats["cmdstat_evalsha"]
            settled = sum(r[2] for r in reports)
            elapsed = max(r[1] for r in reports) - min(r[0] for r in reports)
            busy_us = sum(v["usec"] for v in stats.values())
            result[f"{'body' if with_body else 'script'}_{clients}c"] = {
                "clients": clients,
                "body": with_body,
                "settled": settled,
                "elapsed_s": round(elapsed, 4),
                "jobs_per_s": round(settled / elapsed, 1),
                "redis_us_per_settle": round(calls["usec_per_call"], 2),
                "redis_cpu_us_per_job": round(redis_cpu / settled * 1e6, 2),
                "redis_busy_fraction": round(busy_us / 1e6 / elapsed, 3),
            }
    best = max(result[f"script_{c}c"]["jobs_per_s"] for c in CEILING_CLIENTS)
    with_writes = max(result[f"body_{c}c"]["jobs_per_s"] for c in CEILING_CLIENTS)
    cpu = min(result[f"script_{c}c"]["redis_cpu_us_per_job"] for c in CEILING_CLIENTS)
    result["ceiling_jobs_per_s"] = result["redis_benchmark"]["jobs_per_s"]
    result["python_loop_jobs_per_s"] = best
    result["python_loop_with_body_jobs_per_s"] = with_writes
    result["redis_core_bound_jobs_per_s"] = round(1e6 / cpu, 1) if cpu else None
    return result


# -- profile ---------------------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _module_of(filename: str) -> str:
    """A frame's file as py-spy names it, as a module label (``service: consumer``)."""
    path = "/" + filename.removesuffix(".py")
    if "bench_throughput" in path:
        return "job body"
    for marker, name in (
        ("/orders_worker/", "service: "),
        ("/dramatiq/", "dramatiq: "),
        ("/redis/", "redis-py: "),
        ("/prometheus_client/", "prometheus: "),
    ):
        if marker in path:
            return name + path.rsplit(marker, 1)[1]
    return "other: " + Path(path).name


def profile(bench: _tools.Bench, jobs: int) -> dict[str, Any]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    worker = bench.start("service", 8)
    try:
        supervisor = worker.procs[0].pid
        children = _children(supervisor)
        target = children[0] if children else supervisor
        redis_pid = int(bench.client.info("server")["process_id"])
        out = bench.root / "profile.txt"
        run = bench.new_run()
        bench.prepare(worker, run, [0.0] * jobs)
        recorder = subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(target),
                "--gil",
                "--rate",
                "400",
                "--format",
                "raw",
                "--output",
                str(out),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(1.0)
        cpu_before = _cpu_s(target)
        redis_before = _cpu_s(redis_pid) if redis_pid else 0.0
        released = bench.release(worker)
        bench.wait_done(run, jobs, 600, worker)
        wall = time.time() - released
        cpu = _cpu_s(target) - cpu_before
        redis_cpu = (_cpu_s(redis_pid) - redis_before) if redis_pid else None
        recorder.send_signal(signal.SIGINT)
        _, errors = recorder.communicate(timeout=60)
    finally:
        bench.stop(worker)
    result: dict[str, Any] = {
        "jobs": jobs,
        "wall_us_per_job": round(wall / jobs * 1e6, 1),
        "worker_cpu_us_per_job": round(cpu / jobs * 1e6, 1),
        "redis_cpu_us_per_job": round(redis_cpu / jobs * 1e6, 1) if redis_cpu else None,
    }
    if os.environ.get("BENCH_KEEP_PROFILE"):
        shutil.copy(out, os.environ["BENCH_KEEP_PROFILE"])
    if not out.exists():
        result["error"] = errors.decode()[-500:]
        return result
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    phases: Counter[str] = Counter()
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [f for f in stack.split(";") if " (" in f and f.endswith(")")]
        if not frames:
            continue
        function, filename = frames[-1][:-1].split(" (", 1)
        self_time[_module_of(filename.rsplit(":", 1)[0])] += count
        functions = {frame.split(" (", 1)[0] for frame in frames}
        for phase, name in PHASES.items():
            if name in functions:
                phases[phase] += count
        seen = set()
        for frame in frames:
            function, location = frame[:-1].split(" (", 1)
            filename = location.rsplit(":", 1)[0]
            module = _module_of(filename)
            if module.startswith(("service", "dramatiq", "job body")):
                key = f"{module}: {function}"
                if key not in seen:
                    seen.add(key)
                    inclusive[key] += count
    result["samples"] = total
    result["phase_share"] = {k: round(phases[k] / total, 3) if total else 0 for k in PHASES}
    result["self_share"] = {k: round(v / total, 3) for k, v in self_time.most_common(14)}
    result["service_inclusive_share"] = {
        k: round(v / total, 3) for k, v in inclusive.most_common(14)
    }
    return result


# -- head-of-line ----------------------------------------------------------------------
def head_of_line(bench: _tools.Bench, long_ms: float, tools: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "long_ms": long_ms,
        "short_jobs": SHORT_JOBS,
        "processes": 2,
        "threads": 1,
    }
    for tool in tools:
        worker = bench.start(tool, 1, processes=2)
        try:
            run = bench.new_run("t")
            bench.prepare(worker, run, [long_ms] + [0.0] * SHORT_JOBS)
            released = bench.release(worker)
            bench.wait_done(run, SHORT_JOBS + 1, 120 + long_ms / 1000, worker)
        finally:
            bench.stop(worker)
        starts = bench.starts(run)
        long_start = next(t for t, _, ms in starts if ms == long_ms)
        waits = sorted(t - released for t, _, ms in starts if ms == 0.0)
        blocked = [w for w in waits if w > long_ms / 2000]
        result[tool] = {
            "max_wait_s": round(waits[-1], 3),
            "median_wait_s": round(statistics.median(waits), 3),
            "behind_long": len(blocked),
            "long_started_after_s": round(long_start - released, 3),
        }
    return result


# -- redelivery ------------------------------------------------------------------------
def redelivery(bench: _tools.Bench, bound: float, tools: list[str]) -> dict[str, Any]:
    job_ms = 3000.0
    result: dict[str, Any] = {
        "bound_s": bound,
        "jobs": REDELIVERY_JOBS,
        "job_ms": job_ms,
        "threads": 2,
    }
    first = {tool: bench.start(tool, 2, queue=2) for tool in tools}
    runs = {}
    for tool, worker in first.items():
        runs[tool] = bench.new_run("t")
        bench.prepare(worker, runs[tool], [job_ms] * REDELIVERY_JOBS)
        bench.release(worker)
    deadline = time.monotonic() + 60
    while any(len(bench.starts(runs[t])) < 2 for t in tools) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    waiting = {}
    killed = {}
    for tool, worker in first.items():
        waiting[tool] = bench.client.llen(bench.queue_key(worker))
        bench.kill(worker)
        killed[tool] = time.time()
    second = {tool: bench.start(tool, 2, queue=2, warm=False) for tool in tools}
    finished: dict[str, float] = {}
    deadline = time.monotonic() + bound
    try:
        while len(finished) < len(tools) and time.monotonic() < deadline:
            for tool in tools:
                if tool not in finished and bench.done(runs[tool]) >= REDELIVERY_JOBS:
                    finished[tool] = time.time() - killed[tool]
            time.sleep(0.05)
    finally:
        for worker in second.values():
            bench.stop(worker)
    unacked = _celery_unacked(bench.client)
    for tool in tools:
        held = REDELIVERY_JOBS - waiting[tool]
        entry = {
            "held": held,
            "done": bench.done(runs[tool]),
            "all_done_after_s": round(finished[tool], 2) if tool in finished else None,
        }
        if tool in _tools.CELERY:
            # Held and neither run again nor waiting in Celery's unacked hash: acknowledged
            # when they started (Celery's early acks), so gone with the killed worker.
            entry["in_unacked"] = unacked.get(runs[tool], 0)
            rerun = max(0, entry["done"] - waiting[tool])
            entry["lost"] = held - entry["in_unacked"] - rerun
        result[tool] = entry
    return result


def _celery_unacked(client: redis.Redis) -> Counter[str]:
    """How many of each run's messages wait in Celery's ``unacked`` hash (its Redis
    transport's held messages, restored after the visibility timeout)."""
    held: Counter[str] = Counter()
    for raw in client.hvals("unacked"):
        envelope = json.loads(raw)[0]
        args = json.loads(base64.b64decode(envelope["body"]))[0]
        held[args[0]] += 1
    return held


# -- footprint -------------------------------------------------------------------------
def _counters(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("stats")
    return int(stats["total_reads_processed"]), int(stats["total_commands_processed"])


def footprint(bench: _tools.Bench, jobs: int, window: float, tools: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {"jobs": jobs, "window_s": window, "threads": 8}
    client = bench.client
    for tool in tools:
        worker = bench.start(tool, 8)
        try:
            time.sleep(2.0)
            pids = bench.pids(worker)
            idle_rss = sum(_tools.rss_mb(p) for p in pids)
            idle_pss = sum(_tools.rss_mb(p, "Pss") for p in pids)
            reads, commands = _counters(client)
            started = time.monotonic()
            time.sleep(window)
            reads2, commands2 = _counters(client)
            elapsed = time.monotonic() - started
            # The second INFO counts itself: one read, one command.
            idle_reads = (reads2 - reads - 1) / elapsed
            idle_commands = (commands2 - commands - 1) / elapsed
            run = bench.new_run()
            bench.prepare(worker, run, [0.0] * jobs)
            polls = bench.polls
            reads, commands = _counters(client)
            released = time.monotonic()
            bench.release(worker)
            bench.wait_done(run, jobs, 900, worker, step=0.02)
            reads2, commands2 = _counters(client)
            busy = time.monotonic() - released
            own_calls = (bench.polls - polls) + 1 + 1  # the polls, the release, the INFO
            own_commands = own_calls + (1 if tool == "service" else 0)  # the PUBLISH
            # What the runtime sent while the batch ran (its idle polls included).
            job_reads = (reads2 - reads - own_calls - BODY_CALLS * jobs) / jobs
            job_commands = (commands2 - commands - own_commands - BODY_CALLS * jobs) / jobs
            time.sleep(1.0)
            per_process = [round(_tools.rss_mb(p), 1) for p in bench.pids(worker)]
            pss_after = sum(_tools.rss_mb(p, "Pss") for p in bench.pids(worker))
        finally:
            bench.stop(worker)
        result[tool] = {
            "processes": len(pids),
            "idle_rss_mb": round(idle_rss, 1),
            "rss_after_jobs_mb": round(sum(per_process), 1),
            "per_process_rss_mb": per_process,
            "idle_pss_mb": round(idle_pss, 1),
            "pss_after_jobs_mb": round(pss_after, 1),
            "idle_round_trips_per_s": round(idle_reads, 2),
            "idle_commands_per_s": round(idle_commands, 2),
            "round_trips_per_job": round(job_reads, 3),
            "commands_per_job": round(job_commands, 3),
            "batch_s": round(busy, 3),
        }
    return result


BODY_CALLS = _tools.BODY_CALLS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 round (a smoke run)")
    parser.add_argument("--only", action="append", choices=PARTS, help="only this part")
    parser.add_argument(
        "--tool",
        action="append",
        choices=_tools.TOOLS[1:],
        help="only the service and this tool (repeatable; default: all)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--noop", type=int, default=3000, help="no-op jobs per scaling round")
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs of the footprint")
    parser.add_argument("--window", type=float, default=10.0, help="idle window (s)")
    parser.add_argument("--bound", type=float, default=90.0, help="redelivery wait bound (s)")
    parser.add_argument("--long", type=float, default=3000.0, help="the long job (ms)")
    if parser.parse_known_args()[0].quick:  # small sizes unless given
        parser.set_defaults(rounds=1, noop=200, jobs=300, window=2.0, bound=5.0, long=1500.0)
    args = parser.parse_args()
    tools = ["service", *(args.tool or _tools.TOOLS[1:])]
    parts = args.only or list(PARTS)
    root = Path(tempfile.mkdtemp(prefix="compare-bench-"))
    load_before = os.getloadavg()
    bench = _tools.Bench(root)
    results: dict[str, Any] = {}
    try:
        for part in parts:
            started = time.monotonic()
            if part == "scaling":
                results[part] = scaling(bench, args.noop, args.rounds, tools)
            elif part == "ceiling":
                results[part] = ceiling(bench, max(args.noop * 5, 2000))
            elif part == "profile":
                results[part] = profile(bench, args.jobs)
            elif part == "head_of_line":
                results[part] = head_of_line(bench, args.long, tools)
            elif part == "redelivery":
                results[part] = redelivery(bench, args.bound, tools)
            elif part == "footprint":
                results[part] = footprint(bench, args.jobs, args.window, tools)
            results[part]["loadavg"] = list(os.getloadavg())
            results[part]["took_s"] = round(time.monotonic() - started, 1)
            print(part, json.dumps(results[part]), flush=True)
    finally:
        bench.close()
        shutil.rmtree(root, ignore_errors=True)
    if "scaling" in results and "ceiling" in results:
        service, top = results["scaling"]["service"], results["ceiling"]
        results["ceiling_fraction"] = {
            f"{n}p": {
                name: round(service[f"{n}p"]["jobs_per_s"] / top[key], 3)
                for name, key in (
                    ("of_ceiling", "ceiling_jobs_per_s"),
                    ("of_python_loop", "python_loop_jobs_per_s"),
                    ("of_python_loop_with_body", "python_loop_with_body_jobs_per_s"),
                )
            }
            for n in (1, 2)
        }
    _results.write(
        "compare_bench",
        results,
        partial=bool(args.quick or args.only or args.tool),
        loadavg_before=list(load_before),
        versions=_tools.versions(),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
