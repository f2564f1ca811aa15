"""A refused render ends with its one line: no traceback of Pulumi's leftover event loops.

Pulumi's mocks register each resource in an executor thread that makes an event loop and
never closes it; garbage-collected socket first, such a loop printed "Exception ignored in
BaseEventLoop.__del__ ... Invalid file descriptor: -1" (in 12 of 30 refused renders of a
default bake). Each run here is a fresh interpreter: the render, then the refusal, then exit.
"""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import pulumi_kubernetes as k8s
from worker_infra.errors import GuardError
from worker_infra.render import render

def program():
    for i in range(40):
        k8s.core.v1.ConfigMap(f"c{i}", metadata={"name": f"c{i}"}, data={"k": "v"})
    raise GuardError("planted refusal")

try:
    render(program, project="p", stack="s")
except GuardError as error:
    print(f"refused: {error}", file=sys.stderr)
    sys.exit(1)
"""


def test_a_refused_render_exits_with_one_line_and_no_traceback() -> None:
    for _ in range(6):
        done = subprocess.run(
            [sys.executable, "-c", "import sys\n" + PROGRAM],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 1, done.stderr[-2000:]
        assert done.stderr.strip().splitlines() == ["refused: planted refusal"], done.stderr
