"""Liveness and readiness probes, proved against running workers.

``healthcheck live`` reads only the local progress boards: a handler holding a
job without progress for longer than ``--stalled-after`` or a dead worker process
fails it; an idle worker, a long handler that calls ``checkpoint()`` and a worker
whose Redis is down pass. ``healthcheck ready`` follows Redis (and the database).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _lifecycle import Jobs, Worker, free_port, jobs, lc_project, wait_for, wait_ready, workers
from bakery import PYTHON, RedisServer, package_of, project_env

pytestmark = pytest.mark.slow
__all__ = ["jobs", "lc_project", "workers"]
STALLED_AFTER = 2.0


def live(worker: Worker) -> int:
    return worker.healthcheck("live", "--stalled-after", str(STALLED_AFTER)).returncode


def test_handler_blocked_without_checkpoint_fails_liveness_in_time(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    worker = workers()
    wait_ready(jobs)
    assert live(worker) == 0
    jobs.enqueue("lc_long", "stuck", 60.0)
    wait_for(lambda: jobs.starts("stuck"), 10, "the job to start")
    started = jobs.starts("stuck")[0][1]
    wait_for(lambda: live(worker) == 1, STALLED_AFTER + 3, "liveness to fail", step=0)
    assert time.time() - started <= STALLED_AFTER + 1.0
    result = worker.healthcheck("live", "--stalled-after", str(STALLED_AFTER))
    assert "made no progress" in result.stderr and "checkpoint()" in result.stderr


def test_long_handler_calling_checkpoint_stays_live(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    worker = workers()
    jobs.enqueue("lc_checkpoint", "long", 60.0)
    wait_for(lambda: jobs.starts("long"), 20, "the job to start")
    deadline = time.monotonic() + 2 * STALLED_AFTER + 0.5
    while time.monotonic() < deadline:
        result = worker.healthcheck("live", "--stalled-after", str(STALLED_AFTER))
        assert result.returncode == 0, result.stderr


def test_idle_worker_stays_live(workers: Callable[..., Worker], jobs: Jobs) -> None:
    worker = workers()
    wait_ready(jobs)
    deadline = time.monotonic() + 2 * STALLED_AFTER
    while time.monotonic() < deadline:
        result = worker.healthcheck("live", "--stalled-after", str(STALLED_AFTER))
        assert result.returncode == 0, result.stderr


def test_dead_worker_process_fails_liveness_until_replaced(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    worker = workers()
    wait_ready(jobs)
    (child,) = worker.children()
    os.kill(worker.pid, signal.SIGSTOP)  # the supervisor can neither reap nor replace it now
    try:
        os.kill(child, signal.SIGKILL)
        wait_for(lambda: live(worker) == 1, 5, "liveness to see the dead process", step=0)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    wait_for(lambda: worker.children() and worker.children() != [child], 10, "a replacement")
    wait_for(lambda: live(worker) == 0, 10, "liveness to recover", step=0.1)


def test_redis_outage_keeps_liveness_and_flips_readiness(
        workers: Callable[..., Worker], jobs: Jobs, redis_server: RedisServer) -> None:
    worker = workers()
    wait_ready(jobs)
    assert worker.healthcheck("ready").returncode == 0
    redis_server.stop()
    try:
        started = time.monotonic()
        ready = worker.healthcheck("ready")
        assert ready.returncode == 1 and "redis" in ready.stderr
        assert time.monotonic() - started < 5
        deadline = time.monotonic() + 2 * STALLED_AFTER
        while time.monotonic() < deadline:
            result = worker.healthcheck("live", "--stalled-after", str(STALLED_AFTER))
            assert result.returncode == 0, result.stderr
        assert worker.process is not None and worker.process.poll() is None
    finally:
        redis_server.start()
    wait_for(lambda: worker.healthcheck("ready").returncode == 0, 10, "readiness to return")
    assert live(worker) == 0
    jobs.enqueue("lc_quick", "after")
    wait_for(lambda: jobs.dones("after"), 20, "a job after the outage")


def test_live_probe_is_fast_and_imports_neither_dramatiq_nor_actors(
        lc_project: Path, tmp_path: Path) -> None:
    package = package_of(lc_project)
    code = (f"import sys; from {package}.__main__ import main; code = main(['healthcheck', "
            "'live']); bad = [m for m in sys.modules if m.startswith('dramatiq') or "
            f"m.startswith('{package}.actors') or m in ('redis', 'psycopg')]; "
            "print(bad); sys.exit(code)")
    env = project_env(lc_project, WORKER_STATE_DIR=str(tmp_path / "state"))
    result = subprocess.run([PYTHON, "-c", code], cwd=lc_project, env=env, capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    started = time.monotonic()
    subprocess.run([PYTHON, "-m", package, "healthcheck", "live"], cwd=lc_project, env=env,
                   check=True, timeout=30)
    assert time.monotonic() - started < 1.0


def test_readiness_follows_the_database(default_project: Path, redis_url: str,
                                        tmp_path: Path) -> None:
    def ready(database_url: str) -> subprocess.CompletedProcess[str]:
        env = project_env(default_project, WORKER_POOL="interactive", REDIS_URL=redis_url,
                          DATABASE_URL=database_url, WORKER_STATE_DIR=str(tmp_path))
        return subprocess.run([PYTHON, "-m", package_of(default_project), "healthcheck", "ready"],
                              cwd=default_project, env=env, capture_output=True, text=True,
                              timeout=30, check=False)

    up = ready("postgresql://localhost:5432/postgres")
    if up.returncode and "database" in up.stderr and "refused" in up.stderr:
        pytest.skip("no PostgreSQL on 127.0.0.1:5432")
    assert up.returncode == 0, up.stderr
    started = time.monotonic()
    down = ready(f"postgresql://127.0.0.1:{free_port()}/postgres")
    assert down.returncode == 1 and "database" in down.stderr, down.stderr
    assert time.monotonic() - started < 5
