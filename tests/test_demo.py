"""``make demo`` reports what its own run did: run twice against the same Redis, each run
processes and reports its own 28 jobs and side effects (an earlier run's keys neither hide
nor count for them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from bakery import TEMPLATE

pytestmark = pytest.mark.slow


def demo(redis_url: str, directory: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEMO_REDIS_URL": redis_url, "DEMO_DIR": str(directory)}
    return subprocess.run([sys.executable, str(TEMPLATE / "scripts" / "demo.py")], env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_each_demo_run_reports_only_its_own_jobs(redis_url: str, tmp_path: Path) -> None:
    for attempt in range(2):
        done = demo(redis_url, tmp_path / f"demo{attempt}")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out = done.stdout
        assert "this run's 28 jobs" in out
        assert "capture_payment      success      6" in out
        assert "send_notification    success      20" in out
        assert ("side effects: 20 of 20 notifications sent, 5 of 5 payments captured from 6 "
                "deliveries") in out
        assert out.rstrip().endswith("demo OK")
        assert "drained: finished=0" not in out
    client = redis.Redis.from_url(redis_url)
    assert len(list(client.scan_iter("idempotency:payment:*"))) == 10, "two runs, 5 each"
