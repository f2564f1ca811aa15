"""Liveness and readiness probes, proved against running workers.

``healthcheck live`` reads only the local progress boards: a handler holding a
job without progress for longer than ``--stalled-after`` or a dead worker process
fails it; an idle worker, a long handler that calls ``checkpoint()`` and a worker
whose Redis is down pass. ``healthcheck ready`` follows Redis (and the database).
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _lifecycle import Jobs, Worker, jobs, lc_project, wait_for, wait_ready, workers
from bakery import DATABASE_POOL, PYTHON, RedisServer, package_of, project_env
from worker_runtime import probe

pytestmark = pytest.mark.slow
__all__ = ["jobs", "lc_project", "workers"]
STALLED_AFTER = 2.0
#: How far apart the handler's and the test's reading of the wall clock may be.
CLOCK_SLACK_S = 0.05


def live(worker: Worker) -> int:
    return worker.healthcheck("live", "--stalled-after", str(STALLED_AFTER)).returncode


def test_handler_blocked_without_checkpoint_fails_liveness_in_time(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    worker = workers()
    wait_ready(jobs)
    assert live(worker) == 0
    jobs.enqueue("lc_long", "stuck", 60.0)
    wait_for(lambda: jobs.starts("stuck"), 10, "the job to start")
    started = jobs.starts("stuck")[0][1]  # the handler's wall clock, after its last progress
    # Each probe is judged by the instant it read the boards, which lies between the call's
    # start and its end (an exec takes 0.7 s on a loaded machine): one that still says live
    # must have started within the limit of the handler's start, whatever the load.
    probes = []
    while not probes or probes[-1][2] == 0:
        before = time.time()
        code = live(worker)
        probes.append((before, time.time(), code))
        assert probes[-1][1] - started < STALLED_AFTER + 30, probes[-3:]
    late = [(before - started, code) for before, _, code in probes
            if code == 0 and before - started > STALLED_AFTER + CLOCK_SLACK_S]
    assert not late, f"still live when probed this long after the handler started: {late}"
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
    # Fast in CPU time, which a busy machine does not inflate as it does the wall clock
    # (an exec of it took 1.5 s of wall time at load 20).
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([PYTHON, "-m", package, "healthcheck", "live"], cwd=lc_project, env=env,
                   check=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert cpu_s < 0.6, f"healthcheck live used {cpu_s:.2f} s of CPU"


def test_readiness_follows_the_database(default_project: Path, redis_url: str,
                                        database_url: str, tmp_path: Path) -> None:
    def ready(url: str) -> tuple[subprocess.CompletedProcess[str], float]:
        env = project_env(default_project, WORKER_POOL=DATABASE_POOL, REDIS_URL=redis_url,
                          DATABASE_URL=url, WORKER_STATE_DIR=str(tmp_path))
        started = time.monotonic()
        result = subprocess.run([PYTHON, "-m", package_of(default_project), "healthcheck",
                                 "ready"], cwd=default_project, env=env, capture_output=True,
                                text=True, timeout=30, check=False)
        return result, time.monotonic() - started

    up, baseline = ready(database_url)
    assert up.returncode == 0, up.stderr
    # A database that never answers (a listener that accepts nothing) costs the probe its
    # own timeout over what a probe that succeeds costs on this machine right now.
    timeout_s = probe.READY_TIMEOUT_S
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        down, took = ready(f"postgresql://127.0.0.1:{silent.getsockname()[1]}/postgres")
    assert down.returncode == 1 and "database" in down.stderr, down.stderr
    assert took < 2 * baseline + timeout_s + 1, (took, baseline)
    # A PostgreSQL that answers but refuses the credentials (a role it does not know: peer
    # authentication on the socket, a password over TCP) is not ready, and says why in one
    # line naming the database, never a traceback.
    refused, _ = ready(with_user(database_url, "no_such_role_for_readiness"))
    assert refused.returncode == 1, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    database_lines = [line for line in lines if "database:" in line]
    assert len(database_lines) == 1, refused.stderr
    assert "authentication failed" in database_lines[0], refused.stderr
    assert "Traceback" not in refused.stderr


def with_user(url: str, user: str) -> str:
    """``url`` logging in as ``user`` (the query's ``user`` wins over any in the netloc)."""
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}user={user}"
