"""One table from the latest results of every benchmark (``make bench`` prints it last).

    python bench/report.py [--markdown]

Reads the newest ``bench/results/<script>-<UTC>.json`` of each script (written through
``bench/_results.py``); a script that never ran shows as such. Ratios were measured side
by side within one run of their script; the core count of each run is in the last column.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import latest

Row = tuple[str, str, str, str]


def _f(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}"


def throughput(results: dict[str, Any]) -> Iterator[Row]:
    rows = [r for r in results["rows"] if r.get("prefetch") == "defaults"]
    law = sorted((r for r in rows if r["shape"] == "48x100ms"), key=lambda r: r["threads"])
    if law:
        yield (
            "scaling law: 48 jobs x 100 ms at " + "/".join(str(r["threads"]) for r in law)
            + " threads (slices of 100 ms)",
            "/".join(_f(r["service"]["slices"], 1) for r in law),
            "ideal " + "/".join(f"{r['ideal_slices']:g}" for r in law),
            "/".join(_f(r["service_vs_ideal"]) for r in law),
        )
    prefetches = {"defaults": "both tools' defaults", "equal": "equal prefetch"}
    for shape, label in (("3000xnoop", "no-op jobs"), ("1000x10ms", "10 ms jobs")):
        for prefetch, setting in prefetches.items():
            for r in results["rows"]:
                if r["shape"] == shape and r.get("prefetch") == prefetch:
                    yield (
                        f"{label}: {r['jobs']} at {r['threads']} threads, {setting}",
                        f"{_f(r['service']['span_s'])} s",
                        f"bare Dramatiq {_f(r['bare']['span_s'])} s",
                        f"{_f(r['throughput_vs_bare'])} x bare throughput",
                    )


def lifecycle(results: dict[str, Any]) -> Iterator[Row]:
    for shape in results["drain"]:
        over_ms = (shape["drain_s"] - shape["ideal_s"]) * 1000
        yield (f"drain after SIGTERM: {shape['shape']}", f"{_f(shape['drain_s'], 3)} s",
               f"ideal {_f(shape['ideal_s'], 3)} s", f"+{over_ms:.0f} ms")
    yield ("liveness probe: exec `healthcheck live` vs GET /livez",
           f"{_f(results['probe_exec_ms'], 1)} ms", f"{_f(results['probe_http_ms'])} ms",
           f"{results['probe_exec_ms'] / results['probe_http_ms']:.0f} x")


def metrics(results: dict[str, Any]) -> Iterator[Row]:
    scrape = {int(k): v for k, v in results.get("scrape_ms", {}).items()}
    if scrape:
        empty, big = scrape[min(scrape)], max(scrape)
        yield (f"scrape GET /metrics with {big:,} messages waiting", f"{_f(scrape[big])} ms",
               f"empty {_f(empty)} ms", f"{_f(scrape[big] / empty)} x")
    if "throughput" in results:
        t = results["throughput"]
        yield ("no-op throughput, full stack vs bare Dramatiq (prefetch = threads)",
               f"{t['ours']:.0f} msg/s", f"{t['bare']:.0f} msg/s", f"{_f(t['ours'] / t['bare'])} x")


def sandbox(results: dict[str, Any]) -> Iterator[Row]:
    yield ("sandbox: trivial run_untrusted vs a plain child process (python -I -c pass)",
           f"{_f(results['sandbox_ms'], 1)} ms", f"{_f(results['plain_ms'], 1)} ms",
           f"{_f(results['ratio'])} x")
    if "bare_ms" in results:
        yield ("sandbox: trivial run_untrusted vs python -I -S -c pass (no site)",
               f"{_f(results['sandbox_ms'], 1)} ms", f"{_f(results['bare_ms'], 1)} ms",
               f"{_f(results['ratio_to_bare'])} x")


def calls(results: dict[str, Any]) -> Iterator[Row]:
    per_job = results["calls_per_job"]
    yield ("Python and C calls per no-op job (1 thread, setprofile)", f"{per_job['service']:.0f}",
           f"bare Dramatiq {per_job['bare']:.0f}", f"{_f(per_job['service'] / per_job['bare'])} x")


def idle(results: dict[str, Any]) -> Iterator[Row]:
    for r in results["rows"]:
        service, bare = r["service"], r["bare"]
        yield (f"idle Redis round trips/s per process: {r['processes']} process(es), "
               f"{r['queues']} queue(s) (commands/s)",
               f"{_f(service['round_trips_per_s_per_process'], 1)} "
               f"({_f(service['commands_per_s_per_process'], 1)})",
               f"bare Dramatiq {_f(bare['round_trips_per_s_per_process'], 1)} "
               f"({_f(bare['commands_per_s_per_process'], 1)})",
               f"{_f(r['round_trips_vs_bare'])} x ({_f(r['commands_vs_bare'])} x)")


def bake(results: dict[str, Any]) -> Iterator[Row]:
    yield ("bake the defaults (cookiecutter, median)", f"{_f(results['bake_s'])} s", "", "")
    yield ("the baked suite (`pytest` as `make test` runs it)", f"{results['suite_s']:.0f} s",
           results["suite_summary"], "")


def capacity(results: dict[str, Any]) -> Iterator[Row]:
    def gain(report: dict[str, Any]) -> float:
        levels = report["levels"]
        return float(levels[-1]["jobs_per_s"] / levels[0]["jobs_per_s"])

    cpu, io = results["cpu_bound"], results["io_bound"]
    yield ("`capacity` verdict: CPU-bound handler stops rising at (I/O-bound beside it)",
           f"{cpu['stops_rising_at']}", f"I/O-bound: {io['stops_rising_at'] or 'still rising'}",
           f"4 vs 1 thread: {_f(gain(cpu))} x / {_f(gain(io))} x")


def console(results: dict[str, Any]) -> Iterator[Row]:
    scale = f"{results['messages']:,} waiting + dead, {results['processes']} processes"
    read = results["status_read"]
    status = results["status"]
    yield (f"`status` with {scale}: read (command, interpreter start included)",
           f"{read['median_s'] * 1000:.0f} ms", f"command {_f(status['wall_s'])} s, "
           f"{status['peak_rss_mb']:.0f} MB peak", "")
    listing = results["dlq_list"]
    row = (f"`dlq list` of {results['messages']:,} dead letters (oldest 100, summary)",
           f"{listing['wall_s']:.1f} s, {listing['peak_rss_mb']:.0f} MB peak")
    base = results.get("baseline_dlq_list")
    if base:
        now = results["dlq_list_at_baseline"]
        letters = f"{results['baseline_letters']:,}"
        yield (*row, f"before #27 at {letters}: {base['wall_s']:.1f} s, "
               f"{base['peak_rss_mb']:.0f} MB", f"at {letters}: {now['wall_s']:.1f} s, "
               f"{now['peak_rss_mb']:.0f} MB")
    else:
        yield (*row, "", "")


SUMMARIES: dict[str, Callable[[dict[str, Any]], Iterator[Row]]] = {
    "throughput_bench": throughput,
    "call_count": calls,
    "lifecycle_bench": lifecycle,
    "metrics_bench": metrics,
    "sandbox_overhead": sandbox,
    "idle_cost": idle,
    "bake_bench": bake,
    "capacity_bench": capacity,
    "console_bench": console,
}


def table() -> str:
    lines = ["| measure | result | baseline | ratio | run |", "|---|---|---|---|---|"]
    for script, summarize in SUMMARIES.items():
        document = latest(script)
        if document is None:
            lines.append(f"| {script} | not run: `python bench/{script}.py` | | | |")
            continue
        load = document.get("loadavg") or document.get("loadavg_before") or ["?"]
        load_1m = f"{load[0]:.1f}" if isinstance(load[0], int | float) else "?"
        run = f"{script} {document.get('utc', '?')}, {document.get('cores', '?')} cores, load {load_1m}"
        try:
            rows = list(summarize(document["results"]))
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
            rows = [(script, f"unreadable results ({error!r})", "", "")]
        lines += [f"| {' | '.join(row)} | {run} |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
