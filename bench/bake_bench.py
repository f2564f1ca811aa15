"""Bake time and the baked suite's time: what a new service costs before its first commit.

    python bench/bake_bench.py [--bakes 5]

Bakes the template with its defaults (median of ``--bakes`` cookiecutter runs, no lint),
then runs the baked project's own suite once as ``make test`` does (``pytest``, in this
venv; ``DATABASE_URL`` from ``TEST_DATABASE_URL`` when set, else test_db.py skips).
Writes ``bench/results/bake_bench-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cookiecutter.main import cookiecutter

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results

TEMPLATE = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bakes", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bake-bench-") as tmp:
        times = []
        for index in range(args.bakes):
            started = time.perf_counter()
            project = Path(
                cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(Path(tmp) / str(index)))
            )
            times.append(time.perf_counter() - started)
        env = {**os.environ, "PYTHONPATH": str(project / "src")}
        if "TEST_DATABASE_URL" in os.environ:
            env["DATABASE_URL"] = os.environ["TEST_DATABASE_URL"]
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:cloudcoil"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        suite_s = time.perf_counter() - started
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    bake_s = statistics.median(times)
    print(
        f"bake (median of {args.bakes}): {bake_s:.2f} s;  baked suite: {suite_s:.1f} s ({summary})"
    )
    _results.write(
        "bake_bench",
        {
            "bake_s": bake_s,
            "bakes_s": times,
            "suite_s": suite_s,
            "suite_exit": done.returncode,
            "suite_summary": summary,
        },
    )


if __name__ == "__main__":
    main()
