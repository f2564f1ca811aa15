"""`make e2e`: the Pulumi scenarios on real pods (scripts/e2e/pods.py): the bake's own image
on the real node of scripts/e2e/node.py, every step's ``ok`` line, and nothing left running.

Needs what tests/test_e2e_node.py needs, plus the Pulumi engines of `make e2e-build` and this
machine's PostgreSQL (the pools that use the database are Ready only when it answers).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from bakery import TEMPLATE
from test_e2e_cluster import run_steps
from test_e2e_node import host_state, require_node

E2E = TEMPLATE / "scripts" / "e2e"
sys.path.insert(0, str(E2E))
import pods

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(2400)
def test_the_scenarios_pass_on_real_pods(tmp_path: Path) -> None:
    require_node()
    subprocess.run([sys.executable, str(E2E / "cluster.py"), "--sweep"], check=True)
    before = host_state()
    run_steps(E2E / "pods.py", tmp_path, pods.SCENARIOS)
    assert host_state() == before
