"""Flow control (issue #42): its cost, its accuracy and the idle cost of a held-back queue,
side by side in one run.

    python bench/flow_bench.py [--rounds 5] [--jobs 3000] [--window 60] [--quick]
                               [--baseline REV]

* Cost: near-no-op jobs (one ``INCR``) through one worker process of 8 threads, three ways,
  rounds alternating (each starts with the next): ``on``, the service with flow control
  deciding every fetch (pool ``external``, which uses ``partner_api``, its budget and rate
  raised so far by ``DOWNSTREAM_PARTNER_API_*`` that they never bind: every fetch and
  refill runs the admission and charges the slots); ``off``, the same build on a pool that
  uses no downstream (the fetch checks only the pause); ``today``, the template before flow
  control (``--baseline``, default the parent of the commit that added ``layout/flow.py``).
  A batch is staged (untimed), released in one round trip, and timed to its last job.
  Goals: ``on`` costs at most 10 % over ``off``; ``off`` within 5 % of ``today``.
* Accuracy: 4 processes x 8 threads against a fake downstream that counts the calls in
  flight and their starts, with a budget of 10 and a rate of 50/s over ``--window`` s:
  the peak in flight (<= 10), the starts a second against the rate, attempts spent while
  waiting (each job starting more than once, retries, dead letters: 0).
* Lanes (priorities, ``layout/queuelanes.py``): the same no-op jobs through one worker
  process of 8 threads, rounds alternating: ``one``, every job on the queue's default lane
  (what a queue whose senders name no priority pays: the fetch's ``LLEN`` of each lane);
  ``two``, half high and half low (both busy for most of the run: the fetch chooses a
  lane per job and keeps the starvation counts); ``before``, the template before lanes
  (``--lanes-baseline``, default the parent of the commit that added
  ``layout/queuelanes.py``). Figures: ``one_vs_before_cost``, ``two_vs_one_cost``.
* Fairness (per-key fair lanes): key A with 20,000 no-op jobs queued (``--fair-backlog``,
  staged while the queue is paused), key B's 10 sent after A's first 100 ran, through one worker process of 8 threads: B's
  worst wait (send to start) against B's 10 sent to the same idle worker alone
  (``worst_wait_ratio``), and how many of A's jobs were done between B's send and the poll
  that saw B's last start (FIFO: the whole backlog left, ``a_backlog_left_at_bs_send``).
* Idle cost: Redis round trips a second of one worker process whose queue is held back
  (its budget taken by one long job, 50 waiting), paused (50 waiting), or empty and idle
  (``MONITOR``, as ``idle_cost.py``): no busy loop.

Writes ``bench/results/flow_bench-<UTC>.json`` (``partial`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cookiecutter.main import cookiecutter

import _results
import _tools
import _workers
import idle_cost

TEMPLATE, bake_project = _workers.bakery.TEMPLATE, _workers.bakery.bake_project

ACTORS = """
import os
import time

import dramatiq
import redis

_client = redis.Redis.from_url(os.environ["REDIS_URL"])
_ENTER = _client.register_script(
    "local n = redis.call('incr', KEYS[1]) "
    "if n > tonumber(redis.call('get', KEYS[2]) or '0') then redis.call('set', KEYS[2], n) end "
    "return n"
)


@dramatiq.actor(queue_name="notifications", max_retries=0)
def flow_noop(run):
    _client.incr("bench:" + run)


@dramatiq.actor(queue_name="partner", max_retries=0)
def flow_noop_gated(run):
    _client.incr("bench:" + run)


@dramatiq.actor(queue_name="partner", max_retries=3)
def flow_call(job_id, ms):
    _ENTER(keys=["fake:inflight", "fake:peak"])
    _client.rpush("fake:starts", time.time())
    _client.hincrby("fake:runs", job_id, 1)
    try:
        time.sleep(ms / 1000)
    finally:
        _client.decr("fake:inflight")
"""
#: The keyed actor of the fairness section (a bake of this revision only: before lanes, an
#: actor option ``fair_key`` is refused).
FAIR_ACTORS = """
import os
import time

import redis
from worker_runtime.typed import JobArguments, actor

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


class TenantJob(JobArguments):
    tenant_id: str
    job_id: str


@actor(queue_name="notifications", max_retries=0, fair_key="tenant_id")
def flow_tenant(job: TenantJob):
    if job.tenant_id != "A":
        _client.hset("fair:start", job.job_id, time.time())
    _client.incr("fair:done")
"""
#: Budget and rate so high that they never bind (the ``on`` configuration).
UNBOUND = {
    "DOWNSTREAM_PARTNER_API_CAPACITY": "1000000",
    "DOWNSTREAM_PARTNER_API_RESERVED": "0",
    "DOWNSTREAM_PARTNER_API_RATE": "100000000/s",
}
#: (name, pool, queue, actor, extra environment) of the cost configurations.
CONFIGS = [
    ("on", "external", "partner", "flow_noop_gated", UNBOUND),
    ("off", "interactive", "notifications", "flow_noop", {}),
    ("today", "interactive", "notifications", "flow_noop", {}),
]
ACCURACY_BUDGET, ACCURACY_RATE, ACCURACY_MS = 10, 50.0, 100


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(TEMPLATE), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def default_baseline(module: str = "flow") -> str:
    """The parent of the commit that added ``layout/<module>.py``."""
    added = git("log", "--diff-filter=A", "--format=%H", "--", f"*layout/{module}.py")
    if not added:
        raise SystemExit(f"no commit adds layout/{module}.py: give its baseline")
    return git("rev-parse", f"{added.splitlines()[-1]}^")


def bake_at(revision: str, root: Path, actors: str = ACTORS) -> Path:
    """The template as of ``revision``, baked (``database=none``) with ``actors`` (default
    :data:`ACTORS`)."""
    source = root / "template"
    source.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(TEMPLATE), "archive", revision], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    out = root / "bake"
    project = Path(
        cookiecutter(
            str(source), no_input=True, output_dir=str(out), extra_context={"database": "none"}
        )
    )
    return _workers.add_actors(project, flow_bench=actors)


def start(project: Path, server: Any, root: Path, name: str, **settings: str) -> Any:
    env = _workers.worker_env(project, server.url, root / f"state-{name}", **settings)
    runtime = project.parents[1] / "template" / "runtime"
    if runtime.is_dir():  # a baseline bake runs on its own revision's runtime, not this one
        env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{runtime}"
    (root / f"state-{name}").mkdir(parents=True, exist_ok=True)
    process = _workers.start_worker(project, env, root / f"{name}.log")
    client = redis.Redis.from_url(server.url)
    _workers.wait_started(client, process, timeout=120)
    client.close()
    return process


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds ``pids`` used so far (gone ones: 0)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def batch(
    client: redis.Redis,
    queue: str,
    actor: str,
    run: str,
    jobs: int,
    pids: list[int],
    lanes: tuple[str, ...] = ("normal",),
) -> tuple[float, float]:
    """Stage ``jobs`` messages (untimed), release them in one round trip, wait for the last:
    the seconds from the release to the last job's end, and the CPU seconds the worker's
    processes and its redis-server used meanwhile (less sensitive to the machine's load).
    ``lanes``: the priorities the jobs are spread over, in turn (``layout.lane_key``'s
    names: ``<queue>`` for normal, ``<queue>.<priority>`` for the others)."""
    messages = [_workers.message(actor, run, queue=queue) for _ in range(jobs)]
    pipe = client.pipeline(transaction=False)
    for index, item in enumerate(messages):
        lane = lanes[index % len(lanes)]
        if lane != "normal":
            item = item.copy(options={"priority": lane})
        redis_id = item.options["redis_message_id"]
        pipe.hset(f"{_workers.NS}:{queue}.msgs", redis_id, item.encode())
        pipe.rpush(f"bench:staging:{queue}:{lane}", redis_id)
    pipe.execute()
    pipe = client.pipeline(transaction=False)
    for lane in lanes:
        listed = f"{_workers.NS}:{queue}" + ("" if lane == "normal" else f".{lane}")
        pipe.rename(f"bench:staging:{queue}:{lane}", listed)
    pipe.publish(f"{_workers.NS}:__wake__", queue)
    cpu = cpu_s(pids)
    released = time.perf_counter()
    pipe.execute()
    _workers.wait_for(lambda: int(client.get("bench:" + run) or 0) >= jobs, 600, f"run {run}")
    return time.perf_counter() - released, cpu_s(pids) - cpu


def cost(root: Path, current: Path, baseline: Path, rounds: int, jobs: int) -> dict[str, Any]:
    running: dict[str, tuple[Any, Any, redis.Redis, str, str]] = {}
    try:
        for name, pool, queue, actor, extra in CONFIGS:
            server = _workers.redis_server(root / f"redis-{name}")
            project = baseline if name == "today" else current
            process = start(
                project, server, root, name, WORKER_POOL=pool, WORKER_CONCURRENCY="8", **extra
            )
            running[name] = (server, process, redis.Redis.from_url(server.url), queue, actor)
        pids = {
            name: [*_tools.group_pids([process.pid]), server.process.pid]
            for name, (server, process, _, _, _) in running.items()
        }
        for name, (_, _, client, queue, actor) in running.items():
            batch(client, queue, actor, f"warm-{name}", min(jobs, 500), pids[name])
        spans: dict[str, list[float]] = {name: [] for name in running}
        cpus: dict[str, list[float]] = {name: [] for name in running}
        names = list(running)
        for index in range(rounds):
            for name in names[index % len(names) :] + names[: index % len(names)]:
                _, _, client, queue, actor = running[name]
                span, cpu = batch(client, queue, actor, f"r{index}-{name}", jobs, pids[name])
                spans[name].append(span)
                cpus[name].append(cpu)
        calls: dict[str, float] = {}
        for name, (_, _, client, queue, actor) in running.items():
            client.config_resetstat()
            batch(client, queue, actor, f"calls-{name}", jobs, pids[name])
            stats = idle_cost.commandstats(client)
            calls[name] = (sum(stats.values()) - sum(idle_cost.OURS.values())) / jobs
    finally:
        for server, process, client, _, _ in running.values():
            _workers.stop(process)
            client.close()
            server.stop()
    median = {name: statistics.median(values) for name, values in spans.items()}
    rate = {name: jobs / span for name, span in median.items()}
    cpu = {name: statistics.median(values) / jobs * 1e6 for name, values in cpus.items()}
    return {
        "jobs": jobs,
        "rounds": rounds,
        "spans_s": spans,
        "cpu_s": cpus,
        "jobs_per_s": {name: round(value, 1) for name, value in rate.items()},
        "cpu_us_per_job": {name: round(value, 1) for name, value in cpu.items()},
        "best_cpu_us_per_job": {name: round(min(v) / jobs * 1e6, 1) for name, v in cpus.items()},
        "redis_commands_per_job": {name: round(value, 2) for name, value in calls.items()},
        "on_vs_off_cost": round(rate["off"] / rate["on"] - 1, 4),
        "off_vs_today": round(rate["off"] / rate["today"], 4),
        "on_vs_off_cpu_cost": round(cpu["on"] / cpu["off"] - 1, 4),
        "on_vs_off_best_cpu_cost": round(min(cpus["on"]) / min(cpus["off"]) - 1, 4),
        "off_vs_today_best_cpu": round(min(cpus["off"]) / min(cpus["today"]), 4),
        "off_vs_today_cpu": round(cpu["off"] / cpu["today"], 4),
    }


#: (name, lanes the jobs spread over, bake) of the lanes' cost configurations.
LANE_CONFIGS = [("one", ("normal",), "current"), ("two", ("high", "low"), "current")]
LANE_CONFIGS += [("before", ("normal",), "baseline")]


def lanes_cost(root: Path, projects: dict[str, Path], rounds: int, jobs: int) -> dict[str, Any]:
    """No-op throughput with lanes (one busy, two busy) against the build before them."""
    running: dict[str, tuple[Any, Any, redis.Redis, tuple[str, ...]]] = {}
    try:
        for name, lanes, bake in LANE_CONFIGS:
            server = _workers.redis_server(root / f"redis-lanes-{name}")
            process = start(projects[bake], server, root, f"lanes-{name}", WORKER_CONCURRENCY="8")
            running[name] = (server, process, redis.Redis.from_url(server.url), lanes)
        pids = {
            name: [*_tools.group_pids([process.pid]), server.process.pid]
            for name, (server, process, _, _) in running.items()
        }
        for name, (_, _, client, lanes) in running.items():
            batch(client, "notifications", "flow_noop", f"lw-{name}", 500, pids[name], lanes)
        spans: dict[str, list[float]] = {name: [] for name in running}
        cpus: dict[str, list[float]] = {name: [] for name in running}
        names = list(running)
        for index in range(rounds):
            for name in names[index % len(names) :] + names[: index % len(names)]:
                _, _, client, lanes = running[name]
                run = f"l{index}-{name}"
                span, cpu = batch(
                    client, "notifications", "flow_noop", run, jobs, pids[name], lanes
                )
                spans[name].append(span)
                cpus[name].append(cpu)
    finally:
        for server, process, client, _ in running.values():
            _workers.stop(process)
            client.close()
            server.stop()
    rate = {name: jobs / statistics.median(values) for name, values in spans.items()}
    cpu = {name: statistics.median(values) / jobs * 1e6 for name, values in cpus.items()}
    return {
        "jobs": jobs,
        "rounds": rounds,
        "spans_s": spans,
        "cpu_s": cpus,
        "jobs_per_s": {name: round(value, 1) for name, value in rate.items()},
        "cpu_us_per_job": {name: round(value, 1) for name, value in cpu.items()},
        "one_vs_before_cost": round(rate["before"] / rate["one"] - 1, 4),
        "two_vs_one_cost": round(rate["one"] / rate["two"] - 1, 4),
        "one_vs_before_cpu_cost": round(cpu["one"] / cpu["before"] - 1, 4),
        "two_vs_one_cpu_cost": round(cpu["two"] / cpu["one"] - 1, 4),
    }


def fairness(root: Path, project: Path, backlog: int, sent: int = 10) -> dict[str, Any]:
    """B's worst wait behind A's backlog against B alone (see the module docstring)."""
    from worker_runtime import layout
    from worker_runtime.redisbroker import SettlingRedisBroker
    from worker_runtime.typed import JobArguments
    from worker_runtime.typed import actor as typed_actor

    class TenantJob(JobArguments):
        tenant_id: str
        job_id: str

    server = _workers.redis_server(root / "redis-fair")
    client = redis.Redis.from_url(server.url)
    broker = SettlingRedisBroker(url=server.url, middleware=[])

    def tenant(job: Any) -> None: ...

    tenant.__annotations__ = {"job": TenantJob, "return": None}  # a local model
    flow_tenant = typed_actor(
        tenant,
        broker=broker,
        queue_name="notifications",
        fair_key="tenant_id",
        actor_name="flow_tenant",
    )

    process = start(project, server, root, "fair", WORKER_CONCURRENCY="8")

    def send_b(run: str) -> float:
        sent_at = {}
        for i in range(sent):
            sent_at[f"{run}{i}"] = time.time()
            flow_tenant.send(tenant_id="B", job_id=f"{run}{i}")
        _workers.wait_for(lambda: client.hlen("fair:start") >= sent, 600, f"B's jobs ({run})")
        starts = {k.decode(): float(v) for k, v in client.hgetall("fair:start").items()}
        client.delete("fair:start")
        return max(starts[job] - sent_at[job] for job in sent_at)

    try:
        alone = send_b("alone")
        done_before = int(client.get("fair:done") or 0)
        # A's backlog is staged while the queue is paused: sent one by one (about 6 s for
        # 20,000), it would otherwise be run as fast as it is sent, and never wait.
        layout.pause(client, "notifications")
        for i in range(backlog):
            flow_tenant.send(tenant_id="A", job_id=f"a{i}")
        layout.resume(client, "notifications", layout.WAKE_CHANNEL)
        _workers.wait_for(
            lambda: int(client.get("fair:done") or 0) >= done_before + 100, 600, "A's first"
        )
        a_done = int(client.get("fair:done") or 0)
        behind = send_b("behind")
        a_between = int(client.get("fair:done") or 0) - a_done - sent
        a_left = backlog - (a_done - done_before)
    finally:
        _workers.stop(process)
        broker.close()
        client.close()
        server.stop()
    return {
        "key_a_backlog": backlog,
        "key_b_sent": sent,
        "threads": 8,
        "b_alone_worst_wait_s": round(alone, 4),
        "b_behind_a_worst_wait_s": round(behind, 4),
        "worst_wait_ratio": round(behind / alone, 2),
        "a_jobs_done_by_bs_last_start": a_between,
        "a_backlog_left_at_bs_send": a_left,
    }


def accuracy(root: Path, project: Path, window_s: float) -> dict[str, Any]:
    server = _workers.redis_server(root / "redis-accuracy")
    client = redis.Redis.from_url(server.url)
    jobs = int(ACCURACY_RATE * (window_s + 15) * 1.2)
    _workers.push(
        client,
        (_workers.message("flow_call", f"a{i}", ACCURACY_MS, queue="partner") for i in range(jobs)),
    )
    process = start(
        project,
        server,
        root,
        "accuracy",
        WORKER_POOL="external",
        WORKER_PROCESSES="4",
        WORKER_CONCURRENCY="8",
        DOWNSTREAM_PARTNER_API_CAPACITY=str(ACCURACY_BUDGET + 4),
        DOWNSTREAM_PARTNER_API_RESERVED="4",
        DOWNSTREAM_PARTNER_API_RATE=f"{ACCURACY_RATE:g}/s",
    )
    try:
        time.sleep(5)  # the burst and the processes' starts are behind us
        first = time.time()
        time.sleep(window_s)
        last = time.time()
    finally:
        _workers.stop(process)
    starts = [float(raw) for raw in client.lrange("fake:starts", 0, -1)]
    runs = [int(count) for count in client.hvals("fake:runs")]
    within = sum(first <= stamp < last for stamp in starts)
    found = {
        "processes": 4,
        "threads": 8,
        "budget": ACCURACY_BUDGET,
        "rate_per_s": ACCURACY_RATE,
        "window_s": round(last - first, 2),
        "peak_in_flight": int(client.get("fake:peak") or 0),
        "starts_per_s": round(within / (last - first), 2),
        "rate_ratio": round(within / (last - first) / ACCURACY_RATE, 4),
        "jobs_started_twice": sum(count > 1 for count in runs),
        "dead_letters": int(client.zcard(f"{_workers.NS}:partner.XQ")),
        "retried": int(client.llen(f"{_workers.NS}:partner.DQ")),
    }
    client.close()
    server.stop()
    return found


def idle_round_trips(root: Path, project: Path, case: str, window_s: float) -> dict[str, Any]:
    server = _workers.redis_server(root / f"redis-idle-{case}")
    client = redis.Redis.from_url(server.url)
    settings: dict[str, str] = {"WORKER_POOL": "external", "WORKER_CONCURRENCY": "8"}
    if case == "throttled":
        settings.update(DOWNSTREAM_PARTNER_API_CAPACITY="5", DOWNSTREAM_PARTNER_API_RESERVED="4")
        _workers.push(client, [_workers.message("flow_call", "long", 600_000, queue="partner")])
    if case == "paused":
        client.hset(f"{_workers.NS}:__paused__", "partner", 0)
    process = start(project, server, root, f"idle-{case}", **settings)
    monitor = idle_cost.Monitor(server.url)
    try:
        if case == "throttled":
            _workers.wait_for(lambda: client.get("fake:inflight") == b"1", 60, "the long call")
        if case != "idle":
            _workers.push(
                client,
                (_workers.message("flow_call", f"w{i}", 0, queue="partner") for i in range(50)),
            )
        time.sleep(3)
        _, commands, round_trips, elapsed = idle_cost.count_window(client, monitor, window_s)
        waiting = int(client.llen(f"{_workers.NS}:partner"))
    finally:
        monitor.stopped.set()
        _workers.stop(process)
        client.close()
        server.stop()
    return {
        "case": case,
        "waiting": waiting,
        "round_trips_per_s": round(round_trips / elapsed, 2),
        "commands_per_s": round(commands / elapsed, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--idle-window", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="1,000 jobs, 3 rounds, 20 s")
    parser.add_argument("--baseline", help="the template revision of `today`")
    parser.add_argument("--lanes-baseline", help="the template revision before lanes")
    parser.add_argument("--fair-backlog", type=int, default=20_000)
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["cost", "lanes", "fairness", "accuracy", "idle"]
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.jobs, args.window, args.idle_window = 3, 1000, 20.0, 5.0
    baseline_rev = args.baseline or default_baseline()
    load_before = list(os.getloadavg())
    results: dict[str, Any] = {"baseline": baseline_rev, "head": git("rev-parse", "HEAD")}
    with tempfile.TemporaryDirectory(prefix="flow-bench-") as tmp:
        root = Path(tmp)
        current = _workers.add_actors(
            bake_project(root / "current", database="none"),
            flow_bench=ACTORS,
            flow_fair=FAIR_ACTORS,
        )
        if "cost" not in args.skip:
            baseline = bake_at(baseline_rev, root / "baseline")
            results["cost"] = cost(root, current, baseline, args.rounds, args.jobs)
            summary = {k: v for k, v in results["cost"].items() if not k.endswith("_s")}
            print("cost", summary, flush=True)
        if "lanes" not in args.skip:
            before = args.lanes_baseline or default_baseline("queuelanes")
            results["lanes_baseline"] = before
            projects = {"current": current, "baseline": bake_at(before, root / "before-lanes")}
            results["lanes"] = lanes_cost(root, projects, args.rounds, args.jobs)
            shown = {k: v for k, v in results["lanes"].items() if not k.endswith("_s")}
            print("lanes", shown, flush=True)
        if "fairness" not in args.skip:
            results["fairness"] = fairness(root, current, args.fair_backlog)
            print("fairness", results["fairness"], flush=True)
        if "accuracy" not in args.skip:
            results["accuracy"] = accuracy(root, current, args.window)
            print("accuracy", results["accuracy"], flush=True)
        if "idle" not in args.skip:
            results["idle"] = [
                idle_round_trips(root, current, case, args.idle_window)
                for case in ("idle", "throttled", "paused")
            ]
            print("idle", results["idle"], flush=True)
    _results.write(
        "flow_bench",
        results,
        loadavg_before=load_before,
        partial=bool(args.quick or args.skip),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
