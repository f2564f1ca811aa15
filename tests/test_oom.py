"""A handler past the container's memory limit, under a real memory cgroup: the kernel's
OOM killer kills the worker process (not the container), the supervisor says so, counts it
in ``worker_oom_kills_total``, replaces the process, and the job, charged an attempt per
kill, ends in the dead letters; the pool goes on running other jobs.

The worker (its supervisor and every process it starts) runs in a cgroup v1 memory group
of its own, limited as a pod's container is. Kubernetes' own OOMKilled (the container's
last state) is not what happens here, nor in a cluster whose kubelet does not kill the
container's cgroup as a group: the alert on kube-state-metrics stays silent, and
``WorkerProcessOOMKilled`` (``worker_oom_kills_total``) is what fires.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Self

import pytest
from _lifecycle import Jobs, Worker, get, jobs, make_test_project, wait_for, wait_ready
from bakery import PYTHON, package_of

pytestmark = pytest.mark.slow
__all__ = ["jobs"]
MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
LIMIT_MB = 400

OOM_ACTORS = '''\
"""Actors of the OOM test: one that grows past any limit."""

from __future__ import annotations

import os
import time

import dramatiq
import redis

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


@dramatiq.actor(queue_name="notifications", max_retries=0)
def oom_grow(job_id: str) -> None:
    """Holds 20 MiB more every 10 ms, each page written, until the kernel kills it."""
    _client.rpush(f"test:start:{job_id}", f"{os.getpid()} {time.time()}")
    held = []
    while True:
        held.append(b"x" * (20 * 1024 * 1024))
        time.sleep(0.01)
'''


@pytest.fixture(scope="module")
def oom_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = bake(database="none")
    return make_test_project(base, tmp_path_factory.mktemp("oom") / base.name, oom_test=OOM_ACTORS)


@pytest.fixture
def memory_group() -> Iterator[Path]:
    """A memory cgroup limited to ``LIMIT_MB`` (no swap here), removed after the test."""
    group = MEMORY_ROOT / f"wt-oom-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(LIMIT_MB * 1024 * 1024))
    except OSError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"cannot make a memory cgroup here ({error}): run as root on cgroup v1")
    yield group
    for pid in (group / "cgroup.procs").read_text().split():
        os.kill(int(pid), 9)
    wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), 10, "the group to empty")
    group.rmdir()


class GroupedWorker(Worker):
    """The worker started inside ``group`` (its processes are born there)."""

    group: Path

    def start(self) -> Self:
        procs = self.group / "cgroup.procs"
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [PYTHON, "-m", package_of(self.project), self.subcommand], cwd=self.project,
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda: procs.write_text(str(os.getpid())))  # noqa: PLW1509
        return self


def oom_kills(worker: Worker) -> float:
    found = re.search(r"^worker_oom_kills_total (\S+)$", worker.metrics(), re.MULTILINE)
    assert found, "no worker_oom_kills_total in /metrics"
    return float(found.group(1))


def test_a_handler_past_the_memory_limit_is_oom_killed_counted_and_dead_lettered(
        oom_project: Path, redis_url: str, tmp_path: Path, jobs: Jobs,
        memory_group: Path) -> None:
    worker = GroupedWorker(oom_project, redis_url, tmp_path / "w", WORKER_MAX_ATTEMPTS="2",
                           WORKER_CONCURRENCY="2")
    worker.group = memory_group
    worker.start()
    try:
        wait_ready(jobs)
        assert oom_kills(worker) == 0
        supervisor = worker.pid
        jobs.enqueue("oom_grow", "big")
        wait_for(lambda: jobs.dead_letters(), 90, "the job to be dead-lettered after 2 kills")
        (dead,) = jobs.dead_letters()
        assert dead.args == ("big",)
        assert len(jobs.starts("big")) == 2, "one start per attempt"
        # The supervisor logs a death after recovering its messages: wait for the line.
        wait_for(lambda: len(worker.records("process_oom_killed")) >= 2, 10, "2 OOM kill lines")
        killed = worker.records("process_oom_killed")
        assert len(killed) == 2, worker.log()[-3000:]
        assert all(r["exit_code"] == -9 and r["level"] == "error" for r in killed)
        assert killed[-1]["dead_lettered"] == 1
        assert not worker.records("process_died"), "an OOM kill is named as one"
        assert oom_kills(worker) == 2
        oom_control = (memory_group / "memory.oom_control").read_text()
        assert re.search(r"^oom_kill 2$", oom_control, re.MULTILINE), oom_control
        # The container lived on (its supervisor is the same process) and still works.
        assert worker.process is not None and worker.process.poll() is None
        assert worker.pid == supervisor
        jobs.enqueue("lc_quick", "after")
        wait_for(lambda: jobs.dones("after"), 20, "an ordinary job after the kills")
        ready = f"http://127.0.0.1:{worker.port}/readyz"
        wait_for(lambda: get(ready)[0] == 200, 20, f"readiness ({get(ready)[1].strip()})")
    finally:
        worker.kill()
