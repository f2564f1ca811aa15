"""Idle cost: Redis round trips and commands per idle worker process, the service against bare
Dramatiq 2.2.1, at 1 and 10 processes and 1 and 20 queues, side by side in one run.

    python bench/idle_cost.py [--window S] [--settle S] [--shape PROCESSES:QUEUES ...]

Each case starts the worker (the service's supervisor with ``WORKER_PROCESSES``, or
``dramatiq --processes`` with its defaults: 8 threads, 1 s fetch timeout) on a fresh
redis-server with every queue empty, lets it settle, then resets Redis's statistics and
counts over ``--window`` seconds (default 20):

* commands: every command Redis ran (``INFO commandstats``, so those a Lua script runs
  are counted one by one);
* round trips: the calls clients sent (``INFO commandstats`` minus what the scripts ran
  inside, which ``MONITOR`` tags ``lua``; the monitor's own connection is not counted).

Both are per second and per idle process. The ratio is the service's over bare
Dramatiq's; the issue's goal is at most 1.5 x and no faster growth with queues.
Writes ``bench/results/idle_cost-<UTC>.json`` (``bench/report.py`` reads it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results
import _workers

SHAPES = [(1, 1), (1, 20), (10, 1), (10, 20)]
POOL = "idle"


def queues(count: int) -> list[str]:
    return [f"idle{index:02d}" for index in range(count)]


#: One actor per queue: a worker consumes the queues its actors declare.
ACTORS = """
import dramatiq

for _index in range(20):
    def _job() -> None:
        pass

    _job.__name__ = f"idle_job_{_index:02d}"
    dramatiq.actor(queue_name=f"idle{_index:02d}")(_job)
"""
BARE_MODULE = (
    """
import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker

dramatiq.set_broker(RedisBroker(url=os.environ["REDIS_URL"]))
"""
    + ACTORS
)
POOL_TABLE = f"""
[pools.{POOL}]
queues = {queues(20)!r}
processes = 1
concurrency = 8
job_timeout_ms = 30000
shutdown_timeout_ms = 40000
memory = "640Mi"
cpu = "250m"
handler_memory = "32Mi"
min_replicas = 1
max_replicas = 1
backlog_age_target_s = 5
"""


class Monitor(threading.Thread):
    """Counts what ``MONITOR`` shows: commands sent by clients and commands run by scripts."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.lua = 0
        self.sent = 0
        self.counting = False
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            with self.client.monitor() as monitor:
                for command in monitor.listen():
                    if self.stopped.is_set():
                        return
                    if self.counting:
                        if command.get("client_type") == "lua":
                            self.lua += 1
                        else:
                            self.sent += 1
        except redis.ConnectionError:  # the server stopped after the window
            return


def commandstats(client: redis.Redis) -> dict[str, int]:
    info: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(stat["calls"]) for name, stat in info.items()}


#: Redis's own calls in a counted window: our INFO, the CONFIG RESETSTAT; MONITOR itself is
#: not counted in commandstats once attached.
OURS = {"info": 1, "config|resetstat": 1}


def count_window(
    client: redis.Redis, monitor: Monitor, window_s: float
) -> tuple[dict[str, int], int, int, float]:
    """Attach ``monitor`` and count over ``window_s`` seconds: (the commandstats of the
    window, the commands run, the round trips sent (commands less those scripts ran), the
    seconds counted)."""
    monitor.start()
    time.sleep(0.5)  # the monitor is attached
    client.config_resetstat()
    monitor.counting = True
    started = time.monotonic()
    time.sleep(window_s)
    stats = commandstats(client)
    monitor.counting = False
    elapsed = time.monotonic() - started
    commands = sum(stats.values()) - sum(OURS.values())
    return stats, commands, commands - monitor.lua, elapsed


def measure(
    root: Path,
    system: str,
    processes: int,
    queue_count: int,
    window_s: float,
    settle_s: float,
    project: Path,
    bare_dir: Path,
    pools_file: Path,
) -> dict[str, Any]:
    server = _workers.redis_server(root / f"redis-{system}-{processes}-{queue_count}")
    client = redis.Redis.from_url(server.url)
    served = queues(queue_count)
    log = root / f"{system}-{processes}-{queue_count}.log"
    if system == "service":
        env = _workers.worker_env(
            project,
            server.url,
            root / f"state-{processes}-{queue_count}",
            WORKER_POOL=POOL,
            WORKER_POOLS_FILE=str(pools_file),
            WORKER_QUEUES=",".join(served),
            WORKER_PROCESSES=str(processes),
        )
        process = _workers.start_worker(project, env, log)
    else:
        env = _workers.foreign_free_env(_workers.project_env(bare_dir))
        env.update(PYTHONPATH=str(bare_dir), REDIS_URL=server.url)
        command = [
            _workers.PYTHON,
            "-m",
            "dramatiq",
            "bare_idle",
            "--processes",
            str(processes),
            "--queues",
            *served,
        ]
        process = _workers.start(command, bare_dir, env, log)
    monitor = Monitor(server.url)
    try:
        _workers.wait_for(
            lambda: (
                client.zcard(f"{_workers.NS}:__heartbeats__") >= processes
                or process.poll() is not None
            ),
            120,
            "every process's heartbeat",
        )
        if process.poll() is not None:
            raise SystemExit(f"{system} exited {process.returncode}: see {log}")
        time.sleep(settle_s)
        stats, commands, round_trips, elapsed = count_window(client, monitor, window_s)
    finally:
        monitor.stopped.set()
        _workers.stop(process)
        client.close()
        server.stop()
    per = elapsed * processes
    top = sorted(
        ((calls, name) for name, calls in stats.items() if name not in OURS), reverse=True
    )[:6]
    return {
        "system": system,
        "processes": processes,
        "queues": queue_count,
        "window_s": round(elapsed, 2),
        "commands_per_s_per_process": round(commands / per, 2),
        "round_trips_per_s_per_process": round(round_trips / per, 2),
        "top_commands_per_s_per_process": {name: round(calls / per, 2) for calls, name in top},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=20.0, metavar="S")
    parser.add_argument("--settle", type=float, default=5.0, metavar="S")
    parser.add_argument(
        "--shape",
        action="append",
        metavar="PROCESSES:QUEUES",
        help="only these shapes (a partial run, not reported)",
    )
    args = parser.parse_args()
    shapes = [tuple(int(n) for n in s.split(":")) for s in args.shape] if args.shape else SHAPES
    rows = []
    with tempfile.TemporaryDirectory(prefix="idle-cost-") as tmp:
        root = Path(tmp)
        project = _workers.bake(root / "bake", {"idle_jobs": ACTORS}, database="none")
        pools_file = root / "pools.toml"
        pools_file.write_text((project / "pools.toml").read_text() + POOL_TABLE)
        bare_dir = root / "bare"
        bare_dir.mkdir()
        (bare_dir / "bare_idle.py").write_text(BARE_MODULE)
        for processes, queue_count in shapes:
            pair = {}
            for system in ("service", "bare"):
                pair[system] = measure(
                    root,
                    system,
                    processes,
                    queue_count,
                    args.window,
                    args.settle,
                    project,
                    bare_dir,
                    pools_file,
                )
                print(pair[system], flush=True)
            service, bare = pair["service"], pair["bare"]
            rows.append(
                {
                    "processes": processes,
                    "queues": queue_count,
                    "service": service,
                    "bare": bare,
                    "round_trips_vs_bare": round(
                        service["round_trips_per_s_per_process"]
                        / bare["round_trips_per_s_per_process"],
                        2,
                    ),
                    "commands_vs_bare": round(
                        service["commands_per_s_per_process"] / bare["commands_per_s_per_process"],
                        2,
                    ),
                }
            )
    print(
        "| processes | queues | bare round trips/s | service round trips/s | ratio "
        "| bare commands/s | service commands/s | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, s = r["bare"], r["service"]
        print(
            f"| {r['processes']} | {r['queues']} | {b['round_trips_per_s_per_process']} "
            f"| {s['round_trips_per_s_per_process']} | {r['round_trips_vs_bare']} "
            f"| {b['commands_per_s_per_process']} | {s['commands_per_s_per_process']} "
            f"| {r['commands_vs_bare']} |"
        )
    _results.write(
        "idle_cost",
        {"rows": rows},
        window_s=args.window,
        **({"partial": True} if args.shape else {}),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
