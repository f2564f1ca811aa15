"""Throughput: the service's own worker against bare Dramatiq 2.2.1 and Celery 5.6, side by
side in one run.

    python bench/throughput_bench.py [--rounds 3] [--quick] [--shape NAME ...] [--tool T ...]
                                     [--scale F]

Every runtime (``bench/_tools.py``: the service, bare Dramatiq, Celery's threads and prefork
pools at its defaults and with ``acks_late`` + prefetch multiplier 1) runs the same job body
(the job's sleep between two timestamps and a counter written to Redis) on the same
redis-server, one worker process each, started once per configuration (process start is not
measured). Rounds alternate between them (each round starts with the next runtime) and each
figure is the median of the rounds. A round releases a staged batch in one round trip and
measures

* ``span``: from the first job's start to the last job's end (the jobs record both
  in Redis), the figure the table and the goals use: it is what throughput and the
  scaling law are about; and
* ``total``: from the release to the last job's end, which adds the idle poll of an
  empty queue at the batch's start (service: none, its producer's wake-up; Dramatiq: its
  ``worker_timeout``, 1 s by default; Celery: none, it blocks in ``BRPOP``).

Work shapes (issue #11): 48 jobs of 100 ms at 1, 2, 4 and 8 threads (reported in
slices of 100 ms against the ideal 48/threads; Celery's prefork pool: child processes),
3,000 near-no-op jobs at 8 threads, 1,000 jobs of 10 ms at 8 threads. Each shape runs at
each tool's defaults (service: ``WORKER_PREFETCH`` = concurrency; Dramatiq: prefetch twice
the threads; Celery: prefetch multiplier 4, early acks), and the service and Dramatiq once
more at equal prefetch (Dramatiq's ``dramatiq_queue_prefetch`` = the threads, the
service's default). Writes ``bench/results/throughput_bench-<UTC>.json`` (marked
``partial`` with ``--quick``, ``--shape``, ``--tool`` or ``--scale``: ``bench/report.py``
reports whole runs).

The figures depend on the machine's load: the core count and the load averages before and
after are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results
import _tools

TOOLS = _tools.TOOLS
#: The tools of the equal-prefetch rows (Celery has no such setting: its rows are its defaults).
EQUAL_TOOLS = ("service", "bare")

#: (name, jobs, ms per job, threads)
SHAPES = [
    ("48x100ms", 48, 100.0, 1),
    ("48x100ms", 48, 100.0, 2),
    ("48x100ms", 48, 100.0, 4),
    ("48x100ms", 48, 100.0, 8),
    ("3000xnoop", 3000, 0.0, 8),
    ("1000x10ms", 1000, 10.0, 8),
]


def measure(
    bench: _tools.Bench,
    shape: tuple[str, int, float, int],
    equal_prefetch: bool,
    rounds: int,
    tools: list[str],
    scale: float = 1.0,
) -> dict[str, Any]:
    name, jobs, ms, threads = shape
    jobs = max(1, round(jobs * scale))
    workers = []
    try:
        for tool in tools:
            prefetch = threads if equal_prefetch and tool == "bare" else None
            workers.append(bench.start(tool, threads, prefetch=prefetch))
        samples: dict[str, list[dict[str, float]]] = {w.tool: [] for w in workers}
        for index in range(rounds):
            for worker in _tools.rotate(workers, index):
                samples[worker.tool].append(bench.round(worker, jobs, ms))
    finally:
        for worker in workers:
            bench.stop(worker)
    result: dict[str, Any] = {
        "shape": name,
        "jobs": jobs,
        "ms": ms,
        "threads": threads,
        "prefetch": "equal" if equal_prefetch else "defaults",
    }
    for tool, rows in samples.items():
        span = statistics.median(row["span_s"] for row in rows)
        total = statistics.median(row["total_s"] for row in rows)
        result[tool] = {
            "span_s": round(span, 4),
            "total_s": round(total, 4),
            "spans_s": [round(row["span_s"], 4) for row in rows],
            "jobs_per_s": round(jobs / span, 1) if span else None,
        }
        if ms >= 100:
            result[tool]["slices"] = round(span / (ms / 1000), 2)
            result[f"{tool}_vs_ideal"] = round(result[tool]["slices"] / (jobs / threads), 3)
    if ms >= 100:
        result["ideal_slices"] = jobs / threads
    # Throughput ratios: > 1 means the service finished the batch faster than the other.
    result["throughput_vs"] = {
        tool: round(result[tool]["span_s"] / result["service"]["span_s"], 3)
        for tool in samples
        if tool != "service"
    }
    if "bare" in samples:
        result["throughput_vs_bare"] = result["throughput_vs"]["bare"]
    return result


def table(results: list[dict[str, Any]]) -> str:
    tools = [t for t in TOOLS if any(t in row for row in results)]
    lines = [
        "| work | threads | prefetch | "
        + " | ".join(_tools.LABELS[t] for t in tools)
        + " | ideal | service/bare thr. | service/Celery threads thr. |",
        "|---|---|---|" + "---|" * len(tools) + "---|---|---|",
    ]
    for row in results:
        cells = []
        for tool in tools:
            if tool not in row:
                cells.append("")
            elif "ideal_slices" in row:
                cells.append(f"{row[tool]['slices']} slices")
            else:
                cells.append(f"{row[tool]['span_s']:.2f} s")
        ideal = f"{row['ideal_slices']:g}" if "ideal_slices" in row else ""
        vs = row["throughput_vs"]
        lines.append(
            f"| {row['shape']} | {row['threads']} | {row['prefetch']} | "
            + " | ".join(cells)
            + f" | {ideal} | {vs.get('bare', '')} "
            f"| {vs.get('celery_threads', '')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="defaults only, 1 round")
    parser.add_argument(
        "--shape",
        action="append",
        choices=sorted({s[0] for s in SHAPES}),
        help="only this work shape (repeatable; default: all)",
    )
    parser.add_argument(
        "--tool",
        action="append",
        choices=[t for t in TOOLS if t != "service"],
        help="only the service and this tool (repeatable; default: all)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply each shape's job count (a smoke run: 0.02)",
    )
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    modes = [False] if args.quick else [False, True]
    tools = ["service", *(args.tool or TOOLS[1:])]
    root = Path(tempfile.mkdtemp(prefix="throughput-bench-"))
    load_before = os.getloadavg()
    bench = _tools.Bench(root)
    results = []
    try:
        for equal in modes:
            for shape in SHAPES:
                if args.shape and shape[0] not in args.shape:
                    continue
                chosen = [t for t in tools if t in EQUAL_TOOLS] if equal else tools
                row = measure(bench, shape, equal, rounds, chosen, args.scale)
                print(json.dumps(row), flush=True)
                results.append(row)
    finally:
        bench.close()
        shutil.rmtree(root, ignore_errors=True)
    print(table(results))
    partial = bool(args.quick or args.shape or args.tool or args.scale != 1.0)
    _results.write(
        "throughput_bench",
        {"rows": results, "table": table(results)},
        rounds=rounds,
        partial=partial,
        loadavg_before=list(load_before),
        versions=_tools.versions(),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
