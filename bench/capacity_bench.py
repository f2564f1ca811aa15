"""The ``capacity`` command's verdict on real handlers: where throughput stops rising.

    python bench/capacity_bench.py [--jobs 60] [--rounds 3]

Runs the baked ``capacity --json`` (its real worker processes, real redis-server) on two
handlers side by side in one run, at concurrency 1, 2 and 4:

- CPU-bound: a loop of ~20 ms under the GIL; the expected verdict is 1 (threads do not
  help: scale it with processes or replicas);
- I/O-bound: a 20 ms sleep; the expected verdict is "still rising".

Each level's throughput, its rounds, the verdict and the levels the probe reported as
noisy (its rounds differ by more than 25 %: something else ran) are written to JSON.
This measurement depends on the machine's load, so it lives here, not in the tests:
the tests prove the decision on measurements fed to it (the baked tests/test_capacity.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results
import _workers

ACTORS = """
import time

import dramatiq


@dramatiq.actor(queue_name="notifications", max_retries=0)
def bench_compute(loops):
    total = 0
    for number in range(loops):
        total += number * number


@dramatiq.actor(queue_name="notifications", max_retries=0)
def bench_wait(seconds):
    time.sleep(seconds)
"""

#: The handlers measured: name -> (actor, its arguments, the --min-gain a flat curve stays under).
HANDLERS = {
    "cpu_bound": ("bench_compute", [300_000], 0.3),
    "io_bound": ("bench_wait", [0.02], 0.1),
}


def probe(
    project: Path,
    redis_url: str,
    actor: str,
    args: list[Any],
    min_gain: float,
    jobs: int,
    rounds: int,
) -> dict[str, Any]:
    env = _workers.worker_env(project, redis_url, project / "state")
    # A pool that prefetches ahead, so a thread never waits for the fetcher between jobs.
    pools = project / "bench-pools.toml"
    pools.write_text(
        (project / "pools.toml")
        .read_text()
        .replace('queues = ["notifications"]', 'queues = ["notifications"]\nprefetch = 16', 1)
    )
    env["WORKER_POOLS_FILE"] = str(pools)
    command = [
        _workers.PYTHON,
        "-m",
        _workers.package_of(project),
        "capacity",
        "--actor",
        actor,
        "--args",
        json.dumps(args),
        "--jobs",
        str(jobs),
        "--concurrency",
        "1,2,4",
        "--rounds",
        str(rounds),
        "--min-gain",
        str(min_gain),
        "--json",
    ]
    done = subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode:
        raise SystemExit(f"capacity_bench: capacity failed for {actor}: {done.stderr.strip()}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="capacity-bench-") as scratch:
        root = Path(scratch)
        project = _workers.bake(root / "bake", {"bench_capacity": ACTORS}, database="none")
        server = _workers.redis_server(root / "redis")
        try:
            results = {
                name: probe(
                    project, server.url, actor, args, min_gain, options.jobs, options.rounds
                )
                for name, (actor, args, min_gain) in HANDLERS.items()
            }
        finally:
            server.stop()
    for name, report in results.items():
        rates = "/".join(f"{level['jobs_per_s']:.1f}" for level in report["levels"])
        print(
            f"{name}: {rates} jobs/s at 1/2/4 threads, stops rising at "
            f"{report['stops_rising_at']}, noisy levels {report['noisy']}"
        )
    _results.write("capacity_bench", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
