"""Start-up cost of one sandboxed run, against a plain ``python -I -c pass``.

Run it from the template repo:

    python bench/sandbox_overhead.py                  # bakes a throw-away project first
    python bench/sandbox_overhead.py /path/to/baked   # uses a baked project's src/<package>
    python bench/sandbox_overhead.py --runs 50

It runs a trivial snippet through ``run_untrusted``, a plain ``python -I -c pass`` and a
bare ``python -I -S -c pass`` (no ``site``: how the launcher itself starts) subprocess
alternately in the same process (same interpreter, same load), then prints the median of
each in milliseconds and the ratios, and the median time the worker spends building the
child's seccomp allowlist (done while the child starts). The target (issue #25) is a
ratio to ``python -I -c pass`` of at most 1.5; the ratio to the bare start says what the
sandbox adds to an interpreter start of its own kind. The numbers are also written to
``bench/results/sandbox_overhead-<UTC timestamp>.json`` (with the core count and the
load). It is a measurement, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write

TEMPLATE = Path(__file__).resolve().parents[1]
TRIVIAL = "def main(payload):\n    return payload\n"
TARGET_RATIO = 1.5
PLAIN = [sys.executable, "-I", "-c", "pass"]
BARE = [sys.executable, "-I", "-S", "-c", "pass"]


def bake(into: Path) -> Path:
    """Bake the template with its defaults (sandbox pool on) and return the project dir."""
    from cookiecutter.main import cookiecutter

    return Path(
        cookiecutter(
            str(TEMPLATE),
            no_input=True,
            output_dir=str(into),
            extra_context={"project": "bench-worker", "sandbox_pool": "yes"},
        )
    )


def load_sandbox(project: Path) -> ModuleType:
    """The sandbox the baked project runs: ``worker_runtime.sandbox`` (the bake must have the
    sandbox pool: its ``src/<package>/sandbox.py``)."""
    if not list((project / "src").glob("*/sandbox.py")):
        raise SystemExit(f"no src/<package>/sandbox.py under {project}")
    return importlib.import_module("worker_runtime.sandbox")


def measure(sandbox: ModuleType, runs: int) -> dict[str, Any]:
    """Median milliseconds of a sandboxed trivial run and of a plain interpreter start."""
    plain: list[float] = []
    bare: list[float] = []
    sandboxed: list[float] = []
    layers: tuple[str, ...] = ()
    for _ in range(3):  # warm the page cache and the imports (and the worker's one walk)
        sandbox.run_untrusted(TRIVIAL, 1)
        subprocess.run(PLAIN, check=True)
        subprocess.run(BARE, check=True)
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(PLAIN, check=True)
        plain.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        subprocess.run(BARE, check=True)
        bare.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        result = sandbox.run_untrusted(TRIVIAL, 1)
        sandboxed.append((time.perf_counter() - started) * 1000)
        if result.status != "ok":
            raise SystemExit(f"trivial snippet did not run: {result.status} {result.error}")
        layers = result.layers
    plain_ms = statistics.median(plain)
    bare_ms = statistics.median(bare)
    sandbox_ms = statistics.median(sandboxed)
    build_filter = importlib.import_module(sandbox.__name__ + "._seccomp").build_filter
    builds = []
    for _ in range(runs):
        started = time.perf_counter()
        build_filter(os.getpid(), 1)
        builds.append((time.perf_counter() - started) * 1000)
    return {
        "runs": runs,
        "plain_ms": plain_ms,
        "sandbox_ms": sandbox_ms,
        "overhead_ms": sandbox_ms - plain_ms,
        "ratio": sandbox_ms / plain_ms,
        "bare_ms": bare_ms,
        "ratio_to_bare": sandbox_ms / bare_ms,
        "target_ratio": TARGET_RATIO,
        "seccomp_build_ms": statistics.median(builds),
        "layers": list(layers),
        "euid": os.geteuid(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("project", nargs="?", type=Path, help="a baked project directory")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        project = args.project or bake(Path(scratch))
        numbers = measure(load_sandbox(project), args.runs)
    print(f"sandbox start-up, median of {numbers['runs']} runs side by side")
    print(f"  python -I -c pass          {numbers['plain_ms']:8.1f} ms")
    print(f"  python -I -S -c pass       {numbers['bare_ms']:8.1f} ms")
    print(f"  run_untrusted(trivial)     {numbers['sandbox_ms']:8.1f} ms")
    print(f"  overhead                   {numbers['overhead_ms']:8.1f} ms")
    print(f"  ratio sandbox/plain        {numbers['ratio']:8.2f}x (target {TARGET_RATIO})")
    print(f"  ratio sandbox/bare         {numbers['ratio_to_bare']:8.2f}x")
    print(f"  seccomp filter build       {numbers['seccomp_build_ms']:8.1f} ms (during start-up)")
    print(f"  layers: {', '.join(numbers['layers'])}")
    write("sandbox_overhead", numbers)


if __name__ == "__main__":
    main()
