"""`make e2e`: the real control plane of scripts/e2e/cluster.py and its promise to stop
every process it started; then the Pulumi scenarios of #33 (scripts/e2e/run.py): a fresh
bake's dev stack through the real Pulumi engine and Kubernetes provider against it.

These need the engines of `make e2e-build` (scripts/e2e/build.py) and Debian's etcd. In CI
(``CI`` set) a missing engine fails the test; on a desk it skips, naming the command.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from bakery import TEMPLATE

E2E = TEMPLATE / "scripts" / "e2e"
sys.path.insert(0, str(E2E))
import build  # noqa: E402
import run  # noqa: E402

pytestmark = pytest.mark.e2e

def require_engines(*names: str) -> None:
    """Fail in CI, skip on a desk, when an engine (or etcd) is missing."""
    cache = build.cache_dir()
    missing = [
        build.ENGINES[n].key for n in names
        if not (cache / "bin" / build.ENGINES[n].key / ".ok").exists()
    ]
    if shutil.which("etcd") is None:
        missing.append("etcd (apt-get install etcd-server)")
    if not missing:
        return
    message = (f"e2e engines missing in {cache}: {', '.join(missing)}; build them with "
               "`make e2e-build` (cold: about 50 min on 2 cores)")
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def children(pid: int) -> set[int]:
    """The direct children of ``pid`` (from /proc)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out.update(int(c) for c in text)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def start_harness(tmp_path: Path) -> tuple[subprocess.Popen[str], set[int]]:
    """scripts/e2e/cluster.py running (its kubeconfig printed); its child processes."""
    proc = subprocess.Popen(
        [sys.executable, str(E2E / "cluster.py")],
        stdout=subprocess.PIPE, stderr=(tmp_path / "harness.log").open("w"), text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    log = (tmp_path / "harness.log").read_text()
    assert line.strip().endswith("admin.kubeconfig"), f"{line!r}\n{log[-3000:]}"
    kids = children(proc.pid)
    assert len(kids) == 5, (kids, log[-2000:])  # etcd, apiserver, kcm, scheduler, kwok
    return proc, kids


@pytest.mark.timeout(300)
def test_the_harness_stops_every_process_on_ctrl_c(tmp_path: Path) -> None:
    require_engines("k8s", "kwok")
    proc, kids = start_harness(tmp_path)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    assert not [pid for pid in kids if alive(pid)]
    assert not list(tmp_path.glob("e2e-cluster-*")), "the work folder was left behind"


@pytest.mark.timeout(300)
def test_a_killed_harness_leaves_nothing_running(tmp_path: Path) -> None:
    """SIGKILL gives the harness no chance to clean up: the kernel kills its children
    (PR_SET_PDEATHSIG)."""
    require_engines("k8s", "kwok")
    proc, kids = start_harness(tmp_path)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    while [pid for pid in kids if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in kids if alive(pid)]


def started_under(folder: Path) -> list[str]:
    """Command lines of the live processes that name ``folder`` (the cluster's work dir is
    below it: etcd, kube-apiserver & co, kwok)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or not alive(int(proc.name)):
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if str(folder) in cmdline:
            out.append(cmdline[:200])
    return out


@pytest.mark.timeout(900)
def test_the_pulumi_scenarios_pass_on_the_real_engines(tmp_path: Path) -> None:
    """scripts/e2e/run.py end to end (its docstring lists the steps and assertions): every
    step reports ok, and no process it started is left."""
    require_engines("k8s", "kwok", "pulumi", "provider")
    run_steps(E2E / "run.py", tmp_path, (run.PREFLIGHT, *run.SCENARIOS))
    assert not started_under(tmp_path), started_under(tmp_path)


def run_steps(script: Path, tmp_path: Path, steps: Iterable[str]) -> None:
    """``script`` (run.py, pods.py) to its end, its step lines printed as they come (make
    e2e runs pytest -s): it succeeds, and says ``ok`` for each of ``steps``."""
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("e2e:"):
                print(line, end="", flush=True)
    finally:  # a timeout or Ctrl-C here: the script stops its cluster on SIGTERM
        if proc.poll() is None:
            proc.terminate()
            proc.wait(120)
    text = "".join(lines)
    assert proc.wait() == 0, text[-8000:]
    for name in steps:
        assert f"e2e: {name} ok in" in text, name
