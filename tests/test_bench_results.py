"""bench/report.py reports a benchmark's newest whole run, never a run of part of it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _results


def test_the_report_skips_a_newer_partial_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_results, "RESULTS", tmp_path)
    assert _results.latest("throughput_bench") is None
    whole = {"results": {"rows": ["whole"]}}
    (tmp_path / "throughput_bench-20261130T100000Z.json").write_text(json.dumps(whole))
    part = {"partial": True, "results": {"rows": ["one shape"]}}
    (tmp_path / "throughput_bench-20261130T110000Z.json").write_text(json.dumps(part))
    found = _results.latest("throughput_bench")
    assert found is not None
    assert found["results"] == whole["results"] and found["utc"] == "20261130T100000Z"
    (tmp_path / "throughput_bench-20261130T120000Z.json").write_text(json.dumps(whole))
    newest = _results.latest("throughput_bench")
    assert newest is not None and newest["utc"] == "20261130T120000Z"


def test_the_readme_quotes_the_reports_table() -> None:
    """The README's bench table is what ``bench/report.py`` prints from the committed
    results (after a benchmark run, paste it between the markers)."""
    import report

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start, end = "<!-- bench table -->\n", "\n<!-- end bench table -->"
    quoted = readme[readme.index(start) + len(start):readme.index(end)]
    assert quoted == report.table()
