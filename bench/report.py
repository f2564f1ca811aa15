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


LABELS = {
    "bare": "bare Dramatiq",
    "celery_threads": "Celery threads",
    "celery_threads_late": "Celery threads, acks_late + prefetch 1",
    "celery_prefork": "Celery prefork",
    "celery_prefork_late": "Celery prefork, acks_late + prefetch 1",
}
TOOLS = ("service", *LABELS)


def _label(tool: str) -> str:
    return LABELS.get(tool, tool)


def throughput(results: dict[str, Any]) -> Iterator[Row]:
    rows = [r for r in results["rows"] if r.get("prefetch") == "defaults"]
    law = sorted((r for r in rows if r["shape"] == "48x100ms"), key=lambda r: r["threads"])
    if law:
        threads = "/".join(str(r["threads"]) for r in law)
        yield (
            f"scaling law: 48 jobs x 100 ms at {threads} threads (slices of 100 ms)",
            "/".join(_f(r["service"]["slices"], 1) for r in law),
            "ideal " + "/".join(f"{r['ideal_slices']:g}" for r in law),
            "/".join(_f(r["service"]["slices"] / r["ideal_slices"]) for r in law),
        )
        for tool in LABELS:
            if all(tool in r for r in law):
                yield (
                    f"scaling law, {_label(tool)}: the same at {threads} threads (prefork: "
                    "children)"
                    if "prefork" in tool
                    else f"scaling law, {_label(tool)}: the same at {threads} threads",
                    "/".join(_f(r[tool]["slices"], 1) for r in law),
                    "ideal " + "/".join(f"{r['ideal_slices']:g}" for r in law),
                    "/".join(_f(r[tool]["slices"] / r["ideal_slices"]) for r in law),
                )
    prefetches = {"defaults": "both tools' defaults", "equal": "equal prefetch"}
    for shape, label in (("3000xnoop", "no-op jobs"), ("1000x10ms", "10 ms jobs")):
        for prefetch, setting in prefetches.items():
            for r in results["rows"]:
                if r["shape"] == shape and r.get("prefetch") == prefetch and "bare" in r:
                    yield (
                        f"{label}: {r['jobs']} at {r['threads']} threads, {setting}",
                        f"{_f(r['service']['span_s'])} s",
                        f"bare Dramatiq {_f(r['bare']['span_s'])} s",
                        f"{_f(r['throughput_vs_bare'])} x bare throughput",
                    )
                if r["shape"] == shape and r.get("prefetch") == prefetch == "defaults":
                    for tool in LABELS:
                        if tool in r and tool != "bare":
                            yield (
                                (
                                    f"{label}: {r['jobs']} at {r['threads']} threads, each "
                                    f"tool's defaults, vs {_label(tool)}"
                                ),
                                f"{_f(r['service']['span_s'])} s",
                                f"{_label(tool)} {_f(r[tool]['span_s'])} s",
                                f"{_f(r['throughput_vs'][tool])} x its throughput",
                            )


def compare(results: dict[str, Any]) -> Iterator[Row]:
    if "scaling" in results:
        scale = results["scaling"]
        for tool in TOOLS:
            if tool in scale:
                one, two = scale[tool]["1p"], scale[tool]["2p"]
                yield (
                    (
                        f"no-op throughput, 2 processes vs 1 ({scale['jobs']} jobs, "
                        f"{scale['threads']} threads; Celery: nodes): {_label(tool)}"
                    ),
                    f"{two['jobs_per_s']:.0f} jobs/s",
                    f"1 process {one['jobs_per_s']:.0f} jobs/s",
                    f"{_f(scale[tool]['two_vs_one'])} x",
                )
    if "ceiling" in results:
        top = results["ceiling"]
        bench = top["redis_benchmark"]
        yield (
            (
                "Redis ceiling: the service's settle-and-fetch script, redis-benchmark "
                f"({bench['connections']} connections, pipeline {bench['pipeline']})"
            ),
            f"{bench['jobs_per_s']:.0f} calls/s",
            (
                f"Python loop {top['python_loop_jobs_per_s']:.0f}/s, with the job body's "
                f"writes {top['python_loop_with_body_jobs_per_s']:.0f}/s"
            ),
            f"redis-server CPU {_f(bench['redis_cpu_us_per_job'], 1)} us per call",
        )
    if "ceiling_fraction" in results and "scaling" in results:
        part, service = results["ceiling_fraction"], results["scaling"]["service"]
        yield (
            "service no-op throughput as a fraction of the Redis ceiling: 1 / 2 processes",
            f"{service['1p']['jobs_per_s']:.0f} / {service['2p']['jobs_per_s']:.0f} jobs/s",
            (
                "of the Python loop with the body: "
                f"{_f(part['1p']['of_python_loop_with_body'])} / "
                f"{_f(part['2p']['of_python_loop_with_body'])}"
            ),
            f"{_f(part['1p']['of_ceiling'], 3)} / {_f(part['2p']['of_ceiling'], 3)}",
        )
    if "profile" in results and "self_share" in results["profile"]:
        prof = results["profile"]
        top3 = ", ".join(
            f"{name} {share:.0%}" for name, share in list(prof["self_share"].items())[:4]
        )
        yield (
            (
                f"profile: one service process, {prof['jobs']:,} no-op jobs (py-spy --gil, "
                "self time)"
            ),
            f"{prof['worker_cpu_us_per_job']:.0f} us CPU per job",
            (
                f"wall {prof['wall_us_per_job']:.0f} us, redis-server "
                f"{prof['redis_cpu_us_per_job']:.0f} us per job"
            ),
            top3,
        )
        if "phase_share" in prof:
            yield (
                "profile: the same samples by phase (a stack in it)",
                ", ".join(f"{k} {v:.0%}" for k, v in prof["phase_share"].items()),
                "",
                "",
            )
    if "head_of_line" in results:
        hol = results["head_of_line"]
        for tool in TOOLS:
            if tool in hol:
                r = hol[tool]
                yield (
                    (
                        f"head-of-line: {hol['short_jobs']} no-op jobs behind one "
                        f"{hol['long_ms'] / 1000:g} s job, 2 processes x 1 thread: {_label(tool)}"
                    ),
                    f"max wait {_f(r['max_wait_s'])} s",
                    f"{r['behind_long']} of {hol['short_jobs']} waited behind the long job",
                    f"{_f(r['max_wait_s'] / (hol['long_ms'] / 1000))} of the long job",
                )
    if "redelivery" in results:
        red = results["redelivery"]
        for tool in TOOLS:
            if tool in red:
                r = red[tool]
                after = r["all_done_after_s"]
                yield (
                    (
                        f"redelivery after SIGKILL, {r['held']} of {red['jobs']} jobs of "
                        f"{red['job_ms'] / 1000:g} s held: {_label(tool)}"
                    ),
                    f"all done {after:.1f} s after the kill"
                    if after is not None
                    else f"not redelivered within {red['bound_s']:g} s",
                    f"{r['done']} of {red['jobs']} done",
                    f"{r['in_unacked']} in Celery's unacked hash (visibility timeout 1 h), "
                    f"{r['lost']} lost (acked before they ran)"
                    if "lost" in r
                    else "",
                )
    if "footprint" in results:
        foot = results["footprint"]
        for tool in TOOLS:
            if tool in foot:
                r = foot[tool]
                yield (
                    (
                        f"footprint, {foot['threads']} threads, {r['processes']} process(es): "
                        f"{_label(tool)} (RSS idle / after {foot['jobs']:,} jobs (PSS); Redis "
                        "round trips (commands))"
                    ),
                    (
                        f"{r['idle_rss_mb']:.0f} / {r['rss_after_jobs_mb']:.0f} MB "
                        f"({r.get('pss_after_jobs_mb', 0):.0f} MB)"
                    ),
                    f"{_f(r['round_trips_per_job'])} ({_f(r['commands_per_job'])}) per job",
                    (
                        f"{_f(r['idle_round_trips_per_s'], 1)} ({_f(r['idle_commands_per_s'], 1)})"
                        " per idle s"
                    ),
                )


def lifecycle(results: dict[str, Any]) -> Iterator[Row]:
    for shape in results["drain"]:
        over_ms = (shape["drain_s"] - shape["ideal_s"]) * 1000
        yield (
            f"drain after SIGTERM: {shape['shape']}",
            f"{_f(shape['drain_s'], 3)} s",
            f"ideal {_f(shape['ideal_s'], 3)} s",
            f"+{over_ms:.0f} ms",
        )
    yield (
        "liveness probe: exec `healthcheck live` vs GET /livez",
        f"{_f(results['probe_exec_ms'], 1)} ms",
        f"{_f(results['probe_http_ms'])} ms",
        f"{results['probe_exec_ms'] / results['probe_http_ms']:.0f} x",
    )


def metrics(results: dict[str, Any]) -> Iterator[Row]:
    scrape = {int(k): v for k, v in results.get("scrape_ms", {}).items()}
    if scrape:
        empty, big = scrape[min(scrape)], max(scrape)
        yield (
            f"scrape GET /metrics with {big:,} messages waiting",
            f"{_f(scrape[big])} ms",
            f"empty {_f(empty)} ms",
            f"{_f(scrape[big] / empty)} x",
        )
    if "throughput" in results:
        t = results["throughput"]
        yield (
            "no-op throughput, full stack vs bare Dramatiq (prefetch = threads)",
            f"{t['ours']:.0f} msg/s",
            f"{t['bare']:.0f} msg/s",
            f"{_f(t['ours'] / t['bare'])} x",
        )


def sandbox(results: dict[str, Any]) -> Iterator[Row]:
    yield (
        "sandbox: trivial run_untrusted vs a plain child process (python -I -c pass)",
        f"{_f(results['sandbox_ms'], 1)} ms",
        f"{_f(results['plain_ms'], 1)} ms",
        f"{_f(results['ratio'])} x",
    )
    if "bare_ms" in results:
        yield (
            "sandbox: trivial run_untrusted vs python -I -S -c pass (no site)",
            f"{_f(results['sandbox_ms'], 1)} ms",
            f"{_f(results['bare_ms'], 1)} ms",
            f"{_f(results['ratio_to_bare'])} x",
        )


def calls(results: dict[str, Any]) -> Iterator[Row]:
    per_job = results["calls_per_job"]
    yield (
        "Python and C calls per no-op job (1 thread, setprofile)",
        f"{per_job['service']:.0f}",
        f"bare Dramatiq {per_job['bare']:.0f}",
        f"{_f(per_job['service'] / per_job['bare'])} x",
    )


def idle(results: dict[str, Any]) -> Iterator[Row]:
    for r in results["rows"]:
        service, bare = r["service"], r["bare"]
        yield (
            (
                f"idle Redis round trips/s per process: {r['processes']} process(es), "
                f"{r['queues']} queue(s) (commands/s)"
            ),
            (
                f"{_f(service['round_trips_per_s_per_process'], 1)} "
                f"({_f(service['commands_per_s_per_process'], 1)})"
            ),
            (
                f"bare Dramatiq {_f(bare['round_trips_per_s_per_process'], 1)} "
                f"({_f(bare['commands_per_s_per_process'], 1)})"
            ),
            f"{_f(r['round_trips_vs_bare'])} x ({_f(r['commands_vs_bare'])} x)",
        )


def bake(results: dict[str, Any]) -> Iterator[Row]:
    yield ("bake the defaults (cookiecutter, median)", f"{_f(results['bake_s'])} s", "", "")
    yield (
        "the baked suite (`pytest` as `make test` runs it)",
        f"{results['suite_s']:.0f} s",
        results["suite_summary"],
        "",
    )


def capacity(results: dict[str, Any]) -> Iterator[Row]:
    def gain(report: dict[str, Any]) -> float:
        levels = report["levels"]
        return float(levels[-1]["jobs_per_s"] / levels[0]["jobs_per_s"])

    cpu, io = results["cpu_bound"], results["io_bound"]
    yield (
        "`capacity` verdict: CPU-bound handler stops rising at (I/O-bound beside it)",
        f"{cpu['stops_rising_at']}",
        f"I/O-bound: {io['stops_rising_at'] or 'still rising'}",
        f"4 vs 1 thread: {_f(gain(cpu))} x / {_f(gain(io))} x",
    )


def console(results: dict[str, Any]) -> Iterator[Row]:
    scale = f"{results['messages']:,} waiting + dead, {results['processes']} processes"
    read = results["status_read"]
    status = results["status"]
    yield (
        f"`status` with {scale}: read (command, interpreter start included)",
        f"{read['median_s'] * 1000:.0f} ms",
        (f"command {_f(status['wall_s'])} s, {status['peak_rss_mb']:.0f} MB peak"),
        "",
    )
    listing = results["dlq_list"]
    row = (
        f"`dlq list` of {results['messages']:,} dead letters (oldest 100, summary)",
        f"{listing['wall_s']:.1f} s, {listing['peak_rss_mb']:.0f} MB peak",
    )
    base = results.get("baseline_dlq_list")
    if base:
        now = results["dlq_list_at_baseline"]
        letters = f"{results['baseline_letters']:,}"
        yield (
            *row,
            (f"before #27 at {letters}: {base['wall_s']:.1f} s, {base['peak_rss_mb']:.0f} MB"),
            (f"at {letters}: {now['wall_s']:.1f} s, {now['peak_rss_mb']:.0f} MB"),
        )
    else:
        yield (*row, "", "")


def flow(results: dict[str, Any]) -> Iterator[Row]:
    cost = results["cost"]
    rate, cpu, calls = cost["jobs_per_s"], cost["cpu_us_per_job"], cost["redis_commands_per_job"]
    yield (
        (
            "flow control on vs off: no-op jobs/s (CPU us/job, Redis commands/job), "
            f"{cost['jobs']:,} x {cost['rounds']} rounds"
        ),
        f"{rate['on']:.0f} ({cpu['on']:.0f}, {calls['on']:.1f})",
        f"off {rate['off']:.0f} ({cpu['off']:.0f}, {calls['off']:.1f})",
        f"{_f(cost['on_vs_off_cost'] * 100, 1)}% ({_f(cost['on_vs_off_cpu_cost'] * 100, 1)}% CPU)",
    )
    yield (
        (
            f"flow control off vs before it (today, {str(results['baseline'])[:7]}): no-op "
            "jobs/s (CPU us/job, Redis commands/job)"
        ),
        f"{rate['off']:.0f} ({cpu['off']:.0f}, {calls['off']:.1f})",
        f"today {rate['today']:.0f} ({cpu['today']:.0f}, {calls['today']:.1f})",
        f"{_f(cost['off_vs_today'])} x ({_f(cost['off_vs_today_cpu'])} x CPU)",
    )
    accuracy = results["accuracy"]
    yield (
        (
            f"admission: {accuracy['processes']} x {accuracy['threads']} threads, budget "
            f"{accuracy['budget']}, rate {accuracy['rate_per_s']:g}/s, {accuracy['window_s']:.0f} s"
        ),
        f"peak {accuracy['peak_in_flight']}, {accuracy['starts_per_s']:.1f} starts/s",
        f"attempts spent waiting: {accuracy['jobs_started_twice'] + accuracy['retried']}",
        f"{_f(accuracy['rate_ratio'], 3)} x rate",
    )
    idle_rows = {row["case"]: row for row in results["idle"]}
    base = idle_rows["idle"]["round_trips_per_s"]
    for case in ("throttled", "paused"):
        row = idle_rows[case]
        yield (
            f"idle Redis round trips/s of a {case} queue ({row['waiting']} waiting), one process",
            _f(row["round_trips_per_s"], 1),
            f"empty queue {_f(base, 1)}",
            f"{_f(row['round_trips_per_s'] / base)} x",
        )
    yield from lanes(results)


def lanes(results: dict[str, Any]) -> Iterator[Row]:
    """The lanes' rows of a flow_bench run that measured them (issue #42 items 4 and 2)."""
    if "lanes" in results:
        cost = results["lanes"]
        rate, cpu = cost["jobs_per_s"], cost["cpu_us_per_job"]
        yield (
            (
                "lanes (priorities, fair lane) vs before them: no-op jobs/s (CPU us/job), "
                f"{cost['jobs']:,} x {cost['rounds']} rounds"
            ),
            (
                f"one lane {rate['one']:.0f} ({cpu['one']:.0f}); high+low {rate['two']:.0f} "
                f"({cpu['two']:.0f})"
            ),
            f"before {rate['before']:.0f} ({cpu['before']:.0f})",
            (
                f"{_f(cost['one_vs_before_cost'] * 100, 1)}% "
                f"({_f(cost['one_vs_before_cpu_cost'] * 100, 1)}% CPU)"
            ),
        )
    if "fairness" in results:
        fair = results["fairness"]
        yield (
            (
                f"fairness: key B's {fair['key_b_sent']} sent behind key A's "
                f"{fair['key_a_backlog']:,}, worst wait ({fair['threads']} threads)"
            ),
            (
                f"{fair['b_behind_a_worst_wait_s'] * 1000:.0f} ms, "
                f"{fair['a_jobs_done_by_bs_last_start']} A jobs by B's last start"
            ),
            (
                f"B alone {fair['b_alone_worst_wait_s'] * 1000:.0f} ms; FIFO: "
                f"{fair['a_backlog_left_at_bs_send']:,} A jobs first"
            ),
            f"{_f(fair['worst_wait_ratio'])} x",
        )


def unique(results: dict[str, Any]) -> Iterator[Row]:
    us = results["us_per_send"]
    yield (
        (
            "unique send vs plain send: us per send, one producer, "
            f"{results['sends_per_round']:,} x {results['rounds']} rounds"
        ),
        f"{us['unique']:.0f} (skipped: {us['skipped']:.0f})",
        f"plain {us['plain']:.0f}",
        f"{_f(results['unique_over_plain'])} x (skipped {_f(results['skipped_over_plain'])} x)",
    )


SUMMARIES: dict[str, Callable[[dict[str, Any]], Iterator[Row]]] = {
    "throughput_bench": throughput,
    "compare_bench": compare,
    "call_count": calls,
    "lifecycle_bench": lifecycle,
    "metrics_bench": metrics,
    "sandbox_overhead": sandbox,
    "idle_cost": idle,
    "bake_bench": bake,
    "capacity_bench": capacity,
    "console_bench": console,
    "flow_bench": flow,
    "unique_bench": unique,
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
