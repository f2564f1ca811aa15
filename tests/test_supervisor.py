"""The supervisor with real processes: boot failures are final, crash loops back off and fail
liveness, SIGTERM with Redis down drains cleanly, a process that cannot drain is killed after
its drain window and its messages recovered, a busy METRICS_PORT is one line.

A worker process that exits 78 (EX_CONFIG) cannot boot and never will: the supervisor exits
78 at once with the child's reason instead of replacing it forever while the probes say OK.
A worker process that keeps crashing is replaced after a doubling pause, and a container
with fewer live processes than ``WORKER_PROCESSES`` for longer than
``HEALTH_STALLED_AFTER_S`` is not live (and not ready).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _lifecycle import (
    Jobs, Worker, get, jobs, lc_project, started, wait_for, wait_ready, workers)
from bakery import RedisServer, package_of
from worker_runtime import pools

pytestmark = pytest.mark.slow
__all__ = ["jobs", "lc_project", "workers"]

CRASH_AT_IMPORT = '''\
"""Kills its worker process at import while the file named by CRASH_FLAG exists."""

import os

if os.path.exists(os.environ.get("CRASH_FLAG", "/nonexistent")):
    os._exit(3)
'''


@pytest.fixture
def project_copy(lc_project: Path, tmp_path: Path) -> Callable[[str, str], Path]:
    """``project_copy(name, source)``: the test project plus ``actors/<name>.py``."""

    def _copy(name: str, source: str) -> Path:
        target = tmp_path / "project" / lc_project.name
        shutil.copytree(lc_project, target, ignore=shutil.ignore_patterns("__pycache__"))
        (target / "src" / package_of(target) / "actors" / f"{name}.py").write_text(source)
        return target

    return _copy


@pytest.fixture
def run_worker(redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """``run_worker(project, **env)`` starts a worker of ``project``; killed at teardown."""
    count = iter(range(1_000))
    yield from started(
        lambda project, **env: Worker(project, redis_url, tmp_path / f"w{next(count)}", **env))


def assert_boot_refused(worker: Worker, reason: str) -> None:
    started = time.monotonic()
    code = worker.wait(timeout=20)
    log = worker.log()
    assert code == 78, log[-3000:]
    assert time.monotonic() - started < 15, "at once, not after retries"
    assert "Traceback" not in log, log[-3000:]
    (failed,) = worker.records("boot_failed")
    assert reason in str(failed["reason"]), failed
    refusals = [line for line in log.splitlines() if line.startswith("config error:")]
    assert len(refusals) == 1 and reason in refusals[0], refusals  # once, not per process
    deaths = worker.records("process_died")
    assert not deaths, "a process that cannot boot is not replaced"


def test_actor_module_with_a_syntax_error_makes_the_supervisor_exit_78(
        project_copy: Callable[[str, str], Path], run_worker: Callable[..., Worker]) -> None:
    project = project_copy("broken", "def oops(:\n    pass\n")
    worker = run_worker(project, WORKER_PROCESSES="2")
    assert_boot_refused(
        worker, f"actor module {package_of(project)}.actors.broken cannot be imported: "
        "SyntaxError")


def test_actor_on_a_queue_no_pool_serves_makes_the_supervisor_exit_78(
        project_copy: Callable[[str, str], Path], run_worker: Callable[..., Worker]) -> None:
    project = project_copy("orphan", "import dramatiq\n\n\n@dramatiq.actor(queue_name='nowhere')"
                                     "\ndef lost() -> None:\n    pass\n")
    worker = run_worker(project, WORKER_PROCESSES="2")
    assert_boot_refused(
        worker, "actor 'lost' uses queue 'nowhere', which no pool in pools.toml serves")


def test_crash_loop_backs_off_and_fails_liveness_until_processes_boot(
        project_copy: Callable[[str, str], Path], run_worker: Callable[..., Worker],
        tmp_path: Path) -> None:
    flag = tmp_path / "crash"
    flag.touch()
    project = project_copy("crash_at_import", CRASH_AT_IMPORT)
    stalled_after = 2.0
    worker = run_worker(project, WORKER_PROCESSES="2", CRASH_FLAG=str(flag),
                        HEALTH_STALLED_AFTER_S=str(stalled_after))
    port = worker.env["METRICS_PORT"]

    def deaths(slot: int) -> list[dict[str, object]]:
        return [r for r in worker.records("process_died") if r.get("slot") == slot]

    try:
        wait_for(lambda: len(deaths(0)) >= 5 and len(deaths(1)) >= 5, 40, "five crashes a slot")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{worker.log()[-4000:]}") from None
    assert worker.process is not None and worker.process.poll() is None, "it keeps trying"
    for slot in (0, 1):
        crashes = deaths(slot)[:5]
        pauses = [r["restart_in_s"] for r in crashes]
        assert pauses[:4] == [0.2, 0.4, 0.8, 1.6], pauses
        stamps = [float(r["ts"]) for r in crashes]  # type: ignore[arg-type]
        for pause, before, after in zip(pauses, stamps, stamps[1:], strict=False):
            assert after - before >= float(pause), (pauses, stamps)  # type: ignore[arg-type]
        assert all(r["exit_code"] == 3 for r in crashes)

    live = worker.healthcheck("live")
    assert live.returncode == 1
    assert "0 of 2 worker processes live" in live.stderr, live.stderr
    status, text = get(f"http://127.0.0.1:{port}/livez")
    assert status == 503 and "0 of 2 worker processes live" in text, text
    status, text = get(f"http://127.0.0.1:{port}/readyz")
    assert status == 503 and "0 of 2 worker processes live" in text, text
    assert worker.healthcheck("ready").returncode == 1

    flag.unlink()  # the cause is fixed: the next restarts boot
    wait_for(lambda: worker.healthcheck("live").returncode == 0, 30, "liveness to return")
    assert get(f"http://127.0.0.1:{port}/livez") == (200, "ok\n")
    wait_for(lambda: get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 10, "readiness")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, worker.log()[-3000:]


def test_one_missing_process_fails_liveness_only_after_the_stall_limit(
        project_copy: Callable[[str, str], Path], run_worker: Callable[..., Worker],
        jobs: Jobs, tmp_path: Path) -> None:
    flag = tmp_path / "crash"
    project = project_copy("crash_at_import", CRASH_AT_IMPORT)
    stalled_after = 3.0
    worker = run_worker(project, WORKER_PROCESSES="2", CRASH_FLAG=str(flag),
                        HEALTH_STALLED_AFTER_S=str(stalled_after))
    wait_ready(jobs, 2)
    # The time counts from the supervisor's last look at a whole container: readiness
    # passes once it saw both processes live. Killing one before that (both booted
    # between two looks) would count from the container's start.
    wait_for(lambda: worker.healthcheck("ready").returncode == 0, 10, "readiness")
    wait_for(lambda: worker.healthcheck("live").returncode == 0, 10, "liveness")
    flag.touch()
    victim = worker.children()[0]
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: worker.healthcheck("ready").returncode == 1, 5, "readiness to fail")
    # The supervisor counts the time from a look after the kill, so a probe may fail only
    # if it read the state (between its call's start and end) the limit after the kill: a
    # failure whose call ended sooner is a failure too early, however slow the exec was.
    while True:
        result = worker.healthcheck("live")
        ended = time.monotonic() - killed
        if result.returncode:
            break
        assert ended < stalled_after + 30, "liveness never failed"
    assert ended >= stalled_after, f"liveness failed {ended:.2f} s after the kill"
    assert "1 of 2 worker processes live" in result.stderr, result.stderr


def test_sigterm_while_redis_is_down_drains_and_exits_zero_with_json_logs_only(
        workers: Callable[..., Worker], jobs: Jobs, redis_server: RedisServer) -> None:
    worker = workers(WORKER_PROCESSES="2", WORKER_CONCURRENCY="2")
    jobs.many("lc_sleep", 12, 1.0)
    wait_for(lambda: jobs.started_count() >= 4, 20, "four jobs to start")
    redis_server.stop()
    try:
        worker.signal(signal.SIGTERM)
        code = worker.wait(timeout=60)
    finally:
        redis_server.start()
    log = worker.log()
    assert code == 0, log[-3000:]
    lines = [line for line in log.splitlines() if line.strip()]
    not_json = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            not_json.append(line)
    assert not not_json, "\n".join(not_json[:20])
    assert any(r.get("msg") == "drained" for r in worker.records())
    assert worker.records("stop")


def test_a_process_that_cannot_drain_is_killed_after_its_window_and_loses_nothing(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    """A worker process stopped (SIGSTOP) with a job in hand never hears SIGTERM: the
    supervisor kills it KILL_AFTER_DRAIN_S past WORKER_SHUTDOWN_TIMEOUT_MS, recovers its
    job (a crash counted), and exits non-zero with its stop line."""
    worker = workers(WORKER_JOB_TIMEOUT_MS="500", WORKER_SHUTDOWN_TIMEOUT_MS="1000")
    kill_after = pools.KILL_AFTER_DRAIN_S
    jobs.enqueue("lc_long", "held", 60.0)
    wait_for(lambda: jobs.starts("held"), 20, "the job to start")
    (child,) = worker.children()
    os.kill(child, signal.SIGSTOP)
    started = worker.signal(signal.SIGTERM)
    code = worker.wait(timeout=60)
    elapsed = time.monotonic() - started
    log = worker.log()
    assert code == 1, log[-3000:]
    assert 1.0 + kill_after - 1 <= elapsed <= 1.0 + kill_after + 5, elapsed
    (overrun,) = worker.records("drain_overrun")
    assert overrun["pid"] == child
    (died,) = worker.records("process_died")
    assert died["exit_code"] == -signal.SIGKILL and died["requeued"] == 1, died
    assert jobs.queued_ids() == ["held"] and jobs.stranded() == {}
    (stop,) = worker.records("stop")
    assert stop["exit_code"] == 1, stop


def test_busy_metrics_port_is_one_line_and_exit_78(
        workers: Callable[..., Worker]) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))  # noqa: S104  (the exporter binds every interface)
        taken.listen()
        port = taken.getsockname()[1]
        worker = workers(METRICS_PORT=str(port))
        code = worker.wait(timeout=20)
    log = worker.log()
    assert code == 78, log
    assert log.strip().splitlines() == [
        f"config error: METRICS_PORT={port}: cannot listen: Address already in use"], log
    assert not worker.children()
