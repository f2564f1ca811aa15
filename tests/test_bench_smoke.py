"""The comparison benchmarks run end to end at small sizes and write what ``bench/report.py``
reads: ``throughput_bench.py`` (one shape, the service beside Celery's threads pool) and
every part of ``compare_bench.py`` (the service beside Celery's threads pool). Nothing here judges a figure: the figures live in the benchmarks' JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import report

pytestmark = pytest.mark.slow


def _run(script: str, results: Path, *args: str) -> dict:
    env = {**os.environ, "BENCH_RESULTS": str(results)}
    done = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), *args], env=env,
                          capture_output=True, text=True, timeout=500, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (written,) = results.glob(f"{script}-*.json")
    document = json.loads(written.read_text())
    assert document["partial"] is True  # a smoke run is never reported as the table
    assert document["cores"] == os.cpu_count() and len(document["loadavg"]) == 3
    assert {"dramatiq", "celery", "redis-server"} <= set(document["versions"])
    return document


def test_the_comparison_benchmarks_write_what_the_report_reads(tmp_path: Path) -> None:
    throughput = _run("throughput_bench", tmp_path, "--quick", "--shape", "3000xnoop",
                      "--scale", "0.02", "--tool", "celery_threads")
    (row,) = throughput["results"]["rows"]
    assert row["jobs"] == 60 and set(row["throughput_vs"]) == {"celery_threads"}
    rows = list(report.throughput(throughput["results"]))
    assert any("vs Celery threads" in measure for measure, *_ in rows), rows

    compare = _run("compare_bench", tmp_path, "--quick", "--tool", "celery_threads", "--noop",
                   "100", "--jobs", "200", "--bound", "2", "--long", "1000")
    results = compare["results"]
    assert set(results) >= {"scaling", "ceiling", "profile", "head_of_line", "redelivery",
                            "footprint", "ceiling_fraction"}
    assert results["ceiling"]["redis_benchmark"]["left_in_queue"] == 0
    # py-spy attached and wrote its samples (a few hundred jobs may give none on a busy core)
    assert "samples" in results["profile"], results["profile"]
    for tool in ("service", "celery_threads"):
        assert results["head_of_line"][tool]["max_wait_s"] >= 0
        assert results["footprint"][tool]["idle_rss_mb"] > 0
    rendered = list(report.compare(results))
    measures = " ".join(measure for measure, *_ in rendered)
    for part in ("2 processes vs 1", "Redis ceiling", "fraction of the Redis ceiling",
                 "profile", "head-of-line", "redelivery", "footprint"):
        assert part in measures, part
