"""The supervisor's restart pause: doubling, capped, reset after a stable run; a stop
signal that lands while a replacement is being started."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from worker_runtime.settings import WorkerSettings
from worker_runtime.supervisor import (
    RESTART_BACKOFF_S,
    STABLE_AFTER_S,
    Child,
    ChildState,
    Supervisor,
    next_backoff,
)


def test_restart_pause_doubles_up_to_its_cap() -> None:
    backoff, pauses = RESTART_BACKOFF_S[0], []
    for _ in range(12):
        pause, backoff = next_backoff(backoff, ran_for_s=1.0)
        pauses.append(pause)
    assert pauses[:5] == [0.2, 0.4, 0.8, 1.6, 3.2]
    assert max(pauses) == RESTART_BACKOFF_S[1] == 30.0
    assert pauses[-3:] == [30.0, 30.0, 30.0]


def test_restart_pause_starts_over_after_a_stable_run() -> None:
    pause, backoff = next_backoff(30.0, ran_for_s=STABLE_AFTER_S + 1)
    assert (pause, backoff) == (0.2, 0.4)


def test_a_stop_signal_during_a_respawn_reaches_the_new_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM handled while a replacement process starts (the handler runs between two
    bytecodes of the spawn): the replacement is told to drain too, or the supervisor
    would wait for it forever."""
    monkeypatch.setenv("WORKER_POOL", "external")  # a pool without the database
    monkeypatch.setenv("WORKER_STATE_DIR", str(tmp_path))
    supervisor = Supervisor(WorkerSettings())  # type: ignore[call-arg]
    dead = subprocess.Popen(["true"])
    dead.wait()
    slot = Child(0, dead, tmp_path / "0.txt", state=ChildState.WAITING)
    supervisor.children = [slot]
    started: list[subprocess.Popen[bytes]] = []

    def spawn(report: Path) -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen(["sleep", "30"]))
        supervisor._on_signal(signal.SIGTERM, None)  # lands before the slot holds it
        return started[0]

    monkeypatch.setattr(supervisor, "_spawn", spawn)
    try:
        supervisor._watch()
        assert slot.process is started[0]
        assert started[0].wait(timeout=5) == -signal.SIGTERM
    finally:
        for process in started:
            process.kill()
            process.wait()
