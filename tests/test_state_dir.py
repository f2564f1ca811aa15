"""WORKER_STATE_DIR faults with real processes on a real small file system: a tmpfs of 2 MiB
mounted for each test (the tests run as root; CI does) and unmounted at teardown, whatever
the test did.

* read-only or full at boot: the supervisor, and a worker process started alone, exit 78
  with one line naming WORKER_STATE_DIR, no traceback;
* filled while the worker runs: the worker process keeps running its jobs (no SIGBUS on its
  memory-mapped metric files or progress board: their space was reserved), metrics of new
  label sets still reach /metrics, the supervisor stays up, and liveness names the full
  folder (``healthcheck live`` and /livez);
* a second supervisor (another pool) pointed at the folder a running one uses refuses to
  boot instead of wiping its boards and metrics (issue #28).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _lifecycle import Jobs, Worker, get, jobs, lc_project, make_test_project, wait_for, \
    wait_ready, workers
from bakery import PYTHON, package_of, project_env

pytestmark = pytest.mark.slow
__all__ = ["jobs", "lc_project", "workers"]

#: Actors with long names: each (queue, actor) label set of the duration histogram takes
#: about 2.5 KB of the process's histogram file, many pages for twelve of them.
MANY_LABELS = '''\
"""Twelve actors, so their metrics need new pages of the metric files."""

import dramatiq

for _index in range(12):
    def _noop() -> None:
        pass

    _noop.__name__ = f"label_set_number_{_index:02d}_with_a_rather_long_actor_name"
    dramatiq.actor(queue_name="notifications")(_noop)
'''


def _mount(target: Path, *options: str) -> None:
    subprocess.run(["mount", *options, target], check=True, capture_output=True, timeout=30)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs at ``tmp_path/fs``; unmounted (lazily, so it always goes) at teardown,
    after the processes that use it are killed (fixtures requested later end first)."""
    target = tmp_path / "fs"
    target.mkdir()
    try:
        _mount(target, "-t", "tmpfs", "-o", "size=2m", "tmpfs")
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot mount a tmpfs here (not root?): {error}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "--lazy", target], check=False, timeout=30)


def fill(folder: Path) -> int:
    """Write ``folder/filler-*`` until the file system says ENOSPC; return bytes written."""
    written = 0
    path = folder / f"filler-{time.monotonic_ns()}"
    with path.open("wb", buffering=0) as file:
        chunk = b"\0" * 4096
        while True:
            try:
                written += file.write(chunk)
            except OSError:
                return written


def free_bytes(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def assert_one_line_78(output: str, code: int, *reasons: str) -> None:
    assert code == 78, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    refusals = [line for line in output.splitlines() if line.startswith("config error:")]
    assert len(refusals) == 1, refusals
    for reason in reasons:
        assert reason in refusals[0], refusals


def worker_process(project: Path, redis_url: str, state_dir: Path, timeout: float = 60,
                   ) -> subprocess.CompletedProcess[str]:
    """A worker process started alone (``worker --process``, as the supervisor starts it)."""
    env = project_env(project, WORKER_POOL="interactive", REDIS_URL=redis_url,
                      WORKER_STATE_DIR=str(state_dir), WORKER_PROCESSES="1",
                      WORKER_CONCURRENCY="2")
    return subprocess.run(
        [PYTHON, "-m", package_of(project), "worker", "--process"], cwd=project, env=env,
        capture_output=True, text=True, timeout=timeout, check=False)


def test_a_read_only_state_dir_is_one_line_and_78_for_the_supervisor_and_a_process(
        small_fs: Path, workers: Callable[..., Worker], lc_project: Path,
        redis_url: str) -> None:
    state = small_fs / "state"
    state.mkdir()
    _mount(small_fs, "-o", "remount,ro")
    worker = workers(WORKER_STATE_DIR=str(state))
    code = worker.wait(timeout=30)
    assert_one_line_78(worker.log(), code, f"WORKER_STATE_DIR={state}", "Read-only")
    alone = worker_process(lc_project, redis_url, state)
    assert_one_line_78(alone.stderr, alone.returncode, f"WORKER_STATE_DIR={state}",
                       "Read-only")


def test_a_full_state_dir_is_one_line_and_78_for_the_supervisor_and_a_process(
        small_fs: Path, workers: Callable[..., Worker], lc_project: Path,
        redis_url: str) -> None:
    state = small_fs / "state"
    state.mkdir()
    fill(small_fs)
    worker = workers(WORKER_STATE_DIR=str(state))
    code = worker.wait(timeout=30)
    assert_one_line_78(worker.log(), code, f"WORKER_STATE_DIR={state}", "full")
    alone = worker_process(lc_project, redis_url, state)
    assert_one_line_78(alone.stderr, alone.returncode, f"WORKER_STATE_DIR={state}",
                       "No space left on device")


@pytest.fixture
def labels_project(lc_project: Path, tmp_path: Path) -> Path:
    return make_test_project(lc_project, tmp_path / "project" / lc_project.name,
                             many_labels=MANY_LABELS)


def test_a_state_dir_filled_while_running_kills_nothing_and_liveness_names_it(
        small_fs: Path, labels_project: Path, redis_url: str, jobs: Jobs, tmp_path: Path,
        ) -> None:
    state = small_fs / "state"
    worker = Worker(labels_project, redis_url, tmp_path / "w", WORKER_STATE_DIR=str(state),
                    WORKER_CONCURRENCY="2").start()
    try:
        wait_ready(jobs)
        (child,) = worker.children()
        jobs.enqueue("lc_quick", "warm")  # the metric files exist, 64 KiB each
        wait_for(lambda: jobs.dones("warm"), 20, "the first job")
        wait_for(lambda: 'actor="lc_quick"' in worker.metrics(), 10, "its metrics")
        assert worker.healthcheck("live").returncode == 0
        fill(small_fs)
        assert free_bytes(small_fs) < 4096

        names = [f"label_set_number_{i:02d}_with_a_rather_long_actor_name" for i in range(12)]
        for name in names:
            jobs.enqueue(name)
        jobs.enqueue("lc_quick", "after")
        wait_for(lambda: jobs.dones("after"), 20, "a job after the disk filled")
        wait_for(lambda: all(f'actor="{name}"' in worker.metrics() for name in names), 10,
                 "the new label sets on /metrics (their pages were reserved)")
        assert worker.children() == [child], worker.log()[-3000:]
        assert not worker.records("process_died"), worker.log()[-3000:]
        assert worker.process is not None and worker.process.poll() is None

        live = worker.healthcheck("live")
        assert live.returncode == 1, live.stderr
        assert f"WORKER_STATE_DIR={state} is full" in live.stderr, live.stderr
        status, text = get(f"http://127.0.0.1:{worker.port}/livez")
        assert status == 503 and f"WORKER_STATE_DIR={state} is full" in text, text

        # The supervisor's own writes fail now: it goes on, says so once, and drains.
        os.kill(child, signal.SIGKILL)
        wait_for(lambda: worker.records("process_died"), 10, "the death seen")
        time.sleep(1.0)  # the replacement boots, or refuses, within this
        log = worker.log()
        assert "Traceback" not in log, log[-3000:]
        if worker.process.poll() is None:
            worker.signal(signal.SIGTERM)
        code = worker.wait(timeout=60)
        log = worker.log()
        assert "Traceback" not in log, log[-3000:]
        assert code in (0, 1, 78), log[-3000:]
        if code == 78:  # the replacement could not reserve its board: one line says why
            assert_one_line_78(log, code, f"WORKER_STATE_DIR={state}")
    finally:
        worker.kill()


def test_a_second_supervisor_on_a_used_state_dir_refuses_and_wipes_nothing(
        workers: Callable[..., Worker], jobs: Jobs, tmp_path: Path) -> None:
    state = tmp_path / "shared-state"
    first = workers(WORKER_STATE_DIR=str(state))
    wait_ready(jobs)
    jobs.enqueue("lc_quick", "one")
    wait_for(lambda: jobs.dones("one"), 20, "a job of the first pool")
    wait_for(lambda: "jobs_processed_total{" in first.metrics(), 10, "the first pool's count")
    before = sorted(p.relative_to(state) for p in state.rglob("*"))

    second = workers(WORKER_STATE_DIR=str(state), WORKER_POOL="bulk")
    code = second.wait(timeout=30)
    assert_one_line_78(second.log(), code, f"WORKER_STATE_DIR={state} is in use",
                       "pool interactive", f"pid {first.pid}")
    assert sorted(p.relative_to(state) for p in state.rglob("*")) == before
    assert "jobs_processed_total{" in first.metrics()
    assert first.healthcheck("live").returncode == 0

    first.stop(timeout=30)  # the folder is free again: the next supervisor takes it
    third = workers(WORKER_STATE_DIR=str(state), WORKER_POOL="bulk")

    def third_runs_all() -> bool:
        try:
            status = json.loads((state / "supervisor.json").read_text())
        except (OSError, ValueError):
            return False
        return bool(status["pid"] == third.pid and status["live"] == status["expected"])

    wait_for(third_runs_all, 60, "the bulk pool's supervisor to take the folder")
    assert third.stop(timeout=30) == 0, third.log()[-3000:]


def test_the_baked_make_run_gives_each_pool_its_own_state_dir(lc_project: Path) -> None:
    make = shutil.which("make")
    assert make
    dry = {pool: subprocess.run([make, "-n", "run", f"POOL={pool}"], cwd=lc_project,
                                capture_output=True, text=True, check=True,
                                env={k: v for k, v in os.environ.items()
                                     if k != "WORKER_STATE_DIR"}).stdout
           for pool in ("interactive", "bulk")}
    assert f"WORKER_STATE_DIR=/tmp/{lc_project.name}/interactive" in dry["interactive"]
    assert f"WORKER_STATE_DIR=/tmp/{lc_project.name}/bulk" in dry["bulk"]
