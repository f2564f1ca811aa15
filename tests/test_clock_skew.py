"""One clock: heartbeats, recovery and the scheduler judge time by Redis's ``TIME``.

A ``sitecustomize.py`` on ``PYTHONPATH`` shifts ``time.time`` (and ``time_ns``) of a
process by ``TEST_CLOCK_SHIFT_S`` seconds (``faketime`` would break Python's sleeps; the
monotonic clock is left alone, as a wrong wall clock leaves it).

* Three workers, one on time, one 300 s ahead, one 300 s behind, each holding two 3 s
  jobs with a 2 s heartbeat timeout: no worker judges another dead, every job starts
  once. Judged by each host's clock, the one ahead took the others' jobs within a
  second and the one behind had its own taken.
* Three scheduler replicas lead in turn (on time, 300 s ahead, 300 s behind) with a
  per-second ``catch_up`` schedule: no tick counted missed, none in the future, and the
  last leader fires. Judged by the hosts' clocks the second counted 300 ticks missed
  and the third fired nothing for five minutes.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from _lifecycle import Jobs, Worker, jobs, lc_project, wait_ready  # noqa: F401  (fixtures)
from bakery import wait_for
from test_scheduler import Cluster, Scheduler, cluster, every_second, sched_project  # noqa: F401

pytestmark = pytest.mark.slow

SHIFT_S = 300
SITECUSTOMIZE = '''\
"""Shift this process's wall clock by TEST_CLOCK_SHIFT_S seconds (tests only)."""

import os
import time

_shift = float(os.environ.get("TEST_CLOCK_SHIFT_S") or 0)
if _shift:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _shift
    time.time_ns = lambda: _time_ns() + int(_shift * 1e9)
'''


@pytest.fixture
def skewed(tmp_path: Path) -> Callable[[Path, int], dict[str, str]]:
    """``skewed(project, shift)``: the env overrides that shift a process's clock."""
    shim = tmp_path / "clockshift"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def env(project: Path, shift: int) -> dict[str, str]:
        return {"PYTHONPATH": f"{shim}:{project / 'src'}", "TEST_CLOCK_SHIFT_S": str(shift)}

    return env


def test_the_shim_shifts_the_wall_clock_only(skewed: Callable[[Path, int], dict[str, str]],
                                             lc_project: Path) -> None:
    import subprocess
    import sys

    env = {**skewed(lc_project, SHIFT_S), "PATH": "/usr/bin:/bin"}
    probe = "import time; print(time.time()); time.sleep(0.2); print(time.time())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         check=True, timeout=30).stdout.split()
    assert float(out[0]) - time.time() > SHIFT_S - 5 and float(out[1]) > float(out[0])


def test_workers_with_skewed_clocks_steal_nothing(
        lc_project: Path, redis_url: str, jobs: Jobs, tmp_path: Path,
        skewed: Callable[[Path, int], dict[str, str]]) -> None:
    started: list[Worker] = []
    try:
        for index, shift in enumerate((0, SHIFT_S, -SHIFT_S)):
            started.append(Worker(
                lc_project, redis_url, tmp_path / f"w{index}", WORKER_CONCURRENCY="2",
                WORKER_HEARTBEAT_TIMEOUT_MS="2000", **skewed(lc_project, shift)).start())
        wait_ready(jobs, 3)
        ids = jobs.many("lc_sleep", 6, 3.0)
        wait_for(lambda: all(jobs.dones(job_id) for job_id in ids), 60, "every job to finish")
        time.sleep(1.0)  # a recovery pass or two after the last job
        runs = {job_id: len(jobs.starts(job_id)) for job_id in ids}
        assert runs == dict.fromkeys(ids, 1), runs
        pids = {pid for job_id in ids for pid, _ in jobs.starts(job_id)}
        assert len(pids) == 3, "each worker ran two of the jobs"
        for worker in started:
            recovered = [r for r in worker.records() if "recovered" in r.get("msg", "")]
            assert not recovered, worker.log()[-3000:]
        for worker in started:
            assert worker.stop(timeout=30) == 0, worker.log()[-3000:]
    finally:
        for worker in started:
            worker.kill()


def test_scheduler_leaders_with_skewed_clocks_count_no_tick_missed(
        cluster: Cluster, skewed: Callable[[Path, int], dict[str, str]]) -> None:
    cluster.use(every_second(missed="catch_up"))
    client: redis.Redis = cluster.client
    leaders: list[Scheduler] = []
    for index, shift in enumerate((0, SHIFT_S, -SHIFT_S)):
        scheduler = Scheduler(cluster.project, {**cluster.env(), **skewed(cluster.project, shift)},
                              cluster.directory / f"s{index}")
        cluster.started.append(scheduler)
        scheduler.start()
        if leaders:
            leaders[-1].signal(signal.SIGTERM)  # hands over at once (releases the lock)
            assert leaders[-1].wait(timeout=20) == 0
        wait_for(lambda s=scheduler: s.records("leading"), 30, f"scheduler {index} to lead")
        fired_before = len(cluster.queued_ticks())
        wait_for(lambda n=fired_before: len(cluster.queued_ticks()) >= n + 3, 30,
                 f"scheduler {index} to fire")
        leaders.append(scheduler)
    leaders[-1].signal(signal.SIGTERM)
    assert leaders[-1].wait(timeout=20) == 0
    seconds, _ = client.time()
    state = cluster.state()
    assert int(state.get("runs:missed", 0)) == 0, state
    ticks = cluster.queued_ticks()
    assert len(ticks) == len(set(ticks)), "a tick fired twice"
    assert max(ticks) <= int(seconds), f"a tick in the future: {max(ticks)} > {seconds}"
    assert ticks == sorted(ticks) and ticks[-1] - ticks[0] + 1 == len(ticks), (
        f"ticks lost across the handovers: {ticks}")
