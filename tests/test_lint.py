"""The template's own Python passes the lint of its root `make lint`: worker_runtime (its
config in runtime/pyproject.toml: ruff, mypy --strict, import contracts), worker_infra (its
config in infra/pyproject.toml) and the benchmarks (bench/ruff.toml), ruff check and ruff
format --check. A bake's own lint runs in test_template.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from bakery import TEMPLATE

#: What the root Makefile's `lint` gives ruff.
LINTED = ("runtime", "infra/worker_infra", "bench")


def ruff(*args: str, cwd: Path = TEMPLATE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize("command", [("check",), ("format", "--check")], ids=" ".join)
def test_the_templates_python_passes_ruff(command: tuple[str, ...]) -> None:
    makefile = (TEMPLATE / "Makefile").read_text()
    assert f"ruff {' '.join(command)} {' '.join(LINTED)}" in makefile
    done = ruff(*command, *LINTED)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_a_planted_problem_in_a_benchmark_fails_it(tmp_path: Path) -> None:
    copy = tmp_path / "bench"
    copy.mkdir()
    (copy / "ruff.toml").write_text((TEMPLATE / "bench" / "ruff.toml").read_text())
    (copy / "planted.py").write_text("import os\n")
    done = ruff("check", "bench", cwd=tmp_path)
    assert done.returncode == 1 and "F401" in done.stdout, done.stdout


@pytest.mark.parametrize("library", ["runtime", "infra"])
def test_the_libraries_pass_mypy_strict(library: str) -> None:
    makefile = (TEMPLATE / "Makefile").read_text()
    (line,) = [x for x in makefile.splitlines() if x.startswith(f"\tcd {library} && ")
               and x.endswith("$(abspath $(BIN))/python -m mypy")]
    assert "strict = true" in (TEMPLATE / library / "pyproject.toml").read_text()
    if "templateservice.py" in line:  # the runtime's tests import the rendered test service
        subprocess.run([sys.executable, "tests/templateservice.py"], cwd=TEMPLATE / library,
                       check=True, capture_output=True, timeout=60)
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=TEMPLATE / library,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
