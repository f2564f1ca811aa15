"""Where every benchmark writes its numbers: one JSON file per run.

``write("metrics_bench", {...})`` writes ``bench/results/metrics_bench-<UTC timestamp>.json``
as ``{"script", "utc", "cores", "loadavg", "results"}``; :func:`latest` reads a script's
newest file back (``bench/report.py``, ``make bench``). The core count and the load are
recorded with every run: the figures are ratios measured side by side in one run, and
they depend on the machine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

#: Where the results go (``BENCH_RESULTS`` overrides it: the smoke test writes elsewhere).
RESULTS = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def write(script: str, results: dict[str, Any], **extra: Any) -> Path:
    """Write ``results`` of ``script`` (its file name without .py); return the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = RESULTS / f"{script}-{stamp}.json"
    document = {
        "script": script,
        "utc": stamp,
        "cores": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        **extra,
        "results": results,
    }
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path


def latest(script: str) -> dict[str, Any] | None:
    """The newest complete results file of ``script``, parsed, or None when it never ran
    whole. A run of part of a benchmark (its document says ``"partial": true``, e.g.
    ``throughput_bench.py --shape``) is kept in the results but not reported."""
    for path in sorted(RESULTS.glob(f"{script}-*.json"), reverse=True):
        document: dict[str, Any] = json.loads(path.read_text())
        if document.get("partial"):
            continue
        document.setdefault("utc", path.stem.rsplit("-", 1)[-1])
        return document
    return None
