"""``worker --watch`` (``make run``, ``make dev``) with real processes: a stand-in worker
that reads its fate from a watched file, and the watcher in a process of its own.

What is attacked: a refusal at the first start (it must end the watch at once, not wait for
an edit no one will make), a crash or a refusal after a reload (it must wait for the next
save), the drain before each restart, and the watcher killed by SIGKILL or by its terminal
closing (the worker must not outlive it: it runs in a process group of its own, which the
terminal's signals do not reach).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from worker_runtime.exitcodes import EX_CONFIG

#: The stand-in worker: logs its start, then exits with the code written in fate.py, or
#: (``run``) runs until SIGTERM, which it logs as its drain.
WORKER = """
import os, signal, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
def log(word):
    with (folder / "events.log").open("a") as out:
        out.write(f"{word} {os.getpid()}\\n")
log("start")
fate = (folder / "src" / "fate.py").read_text().strip()
if fate != "run":
    sys.exit(int(fate))
def drain(signum, frame):
    log("drained")
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
while True:
    time.sleep(0.05)
"""
#: The watcher, looking every 50 ms.
WATCHER = """
import sys
from pathlib import Path
from worker_runtime.watch import Watcher
folder = Path(sys.argv[1])
command = [sys.executable, str(folder / "worker.py"), str(folder)]
sys.exit(Watcher(command, [folder / "src"], interval_s=0.05).run())
"""


class Watched:
    """A folder with the stand-in worker, its watched ``src/`` and the events it logs."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / "src").mkdir()
        (folder / "worker.py").write_text(WORKER)
        self.process: subprocess.Popen[str] | None = None

    def fate(self, fate: str) -> None:
        """The next start's fate: an edit of a watched file."""
        path = self.folder / "src" / "fate.py"
        before = path.stat().st_mtime_ns if path.exists() else 0
        path.write_text(f"{fate}\n")
        while path.stat().st_mtime_ns == before:  # a coarse clock: the edit must be seen
            time.sleep(0.01)
            path.write_text(f"{fate}\n")

    def start(self) -> subprocess.Popen[str]:
        self.process = subprocess.Popen(
            [sys.executable, "-c", WATCHER, str(self.folder)],
            stderr=subprocess.PIPE,
            text=True,
        )
        return self.process

    def events(self) -> list[tuple[str, int]]:
        path = self.folder / "events.log"
        if not path.exists():
            return []
        rows = [line.split() for line in path.read_text().splitlines()]
        return [(word, int(pid)) for word, pid in rows]

    def starts(self) -> list[int]:
        return [pid for word, pid in self.events() if word == "start"]


def wait_for(what: str, predicate: Callable[[], object], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, or a process gone meanwhile, does not)."""
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return False


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[Watched]:
    watched = Watched(tmp_path)
    yield watched
    if watched.process is not None and watched.process.poll() is None:
        watched.process.kill()
        watched.process.wait(timeout=10)
    for pid in watched.starts():  # nothing the test started outlives it
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_refusal_at_the_first_start_ends_the_watch_with_its_code(watched: Watched) -> None:
    """A busy METRICS_PORT, a state folder in use, a bad setting: exit 78 at the first start
    is not waited on (no edit of src/ changes the command line): the watcher exits 78 at
    once, and the worker's own line is the only one on stderr."""
    watched.fate(str(EX_CONFIG))
    process = watched.start()
    try:
        _, stderr = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError("the watcher waited for a change after a refusal") from None
    assert process.returncode == EX_CONFIG
    assert len(watched.starts()) == 1
    assert stderr == "", stderr


def test_after_a_reload_a_failure_waits_for_the_next_save(watched: Watched) -> None:
    """A crash at the first start, and a refusal after a reload, wait for the next edit;
    every restart comes after the running worker's drain; a stop drains the last one."""
    watched.fate("1")  # a crash at the first start: the edit in progress is not finished
    process = watched.start()
    wait_for("the first start", lambda: len(watched.starts()) == 1)
    time.sleep(0.5)  # ten looks of the watcher: it must neither restart nor exit
    assert process.poll() is None and len(watched.starts()) == 1
    watched.fate("run")
    wait_for("the start after the fix", lambda: len(watched.starts()) == 2)
    running = watched.starts()[1]
    watched.fate(str(EX_CONFIG))  # an edit that breaks it, after a reload
    wait_for("the broken start", lambda: len(watched.starts()) == 3)
    assert ("drained", running) in watched.events()
    time.sleep(0.5)
    assert process.poll() is None, "a refusal after a reload ended the watch"
    watched.fate("run")
    wait_for("the start after the second fix", lambda: len(watched.starts()) == 4)
    last = watched.starts()[3]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    events = watched.events()
    assert events[-1] == ("drained", last), events
    # Each restart of a running worker began after its drain, never beside it.
    assert events.index(("drained", running)) < events.index(("start", watched.starts()[2]))


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_the_worker_does_not_outlive_its_watcher(watched: Watched, signum: int) -> None:
    """The worker runs in its own process group (Ctrl-C reaches the watcher only), so the
    terminal's SIGHUP and a SIGKILL of the watcher do not reach it: it is sent SIGTERM
    all the same (the kernel's parent-death signal, or the watcher's own stop), drains and
    exits."""
    watched.fate("run")
    process = watched.start()
    wait_for("the start", lambda: len(watched.starts()) == 1)
    (worker,) = watched.starts()
    assert os.getpgid(worker) != os.getpgid(process.pid)
    process.send_signal(signum)
    process.wait(timeout=30)
    wait_for("the worker's drain", lambda: ("drained", worker) in watched.events())
    wait_for("the worker's exit", lambda: not alive(worker))
