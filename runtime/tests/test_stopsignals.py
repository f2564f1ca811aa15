"""StopSignals in real processes: a signal at any moment of the main loop stops it.

A handler that set a ``threading.Event`` deadlocked about one time in two when its
signal came while the main thread waited on that Event in a tight loop (the window
where ``Event.wait`` holds its lock): the worker then neither drained nor heard a
later signal. These tests send their signals into exactly that kind of loop.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

LOOP = """
import sys
from worker_runtime.stopsignals import StopSignals

signals = StopSignals(debounce_s=float(sys.argv[1]))
signals.install()
print("ready", flush=True)
while not signals.wait(0):  # the tightest loop: always just entering or leaving a wait
    pass
print("stopping", flush=True)
line = sys.stdin.readline()  # the test sends its later signals, then a line
print("hurried" if signals.hurried else "not hurried", flush=True)
"""


SRC = str(Path(__file__).resolve().parent)


def start(debounce_s: float = 1.0) -> subprocess.Popen[str]:
    """The loop above in its own process, once it has installed its handlers."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-c", LOOP, str(debounce_s)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert line(process) == "ready\n"
    return process


def line(process: subprocess.Popen[str], timeout_s: float = 10.0) -> str:
    """The next line the process prints ('' if none comes within ``timeout_s``)."""
    assert process.stdout is not None
    readable, _, _ = select.select([process.stdout], [], [], timeout_s)
    return process.stdout.readline() if readable else ""


def finish(process: subprocess.Popen[str]) -> str:
    try:
        out, _ = process.communicate("\n", timeout=10)
    finally:
        process.kill()
    return out


def test_a_signal_at_any_moment_of_a_tight_wait_loop_stops_it() -> None:
    for attempt in range(20):
        process = start()
        time.sleep(0.002 * (attempt % 5))  # land at different moments of the loop
        process.send_signal(signal.SIGTERM if attempt % 2 else signal.SIGINT)
        try:
            assert line(process) == "stopping\n", f"attempt {attempt}: no stop in 10 s"
        finally:
            finish(process)


def test_a_second_signal_hurries_only_after_the_debounce() -> None:
    quick = start(debounce_s=30.0)
    quick.send_signal(signal.SIGTERM)
    assert line(quick) == "stopping\n"
    quick.send_signal(signal.SIGTERM)  # the group's signal and the forwarded one
    assert finish(quick) == "not hurried\n"

    later = start(debounce_s=0.2)
    later.send_signal(signal.SIGINT)
    assert line(later) == "stopping\n"
    time.sleep(0.3)
    later.send_signal(signal.SIGINT)  # a second Ctrl-C
    time.sleep(0.1)
    assert finish(later) == "hurried\n"
