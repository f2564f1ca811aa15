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
* A retry's ``eta`` is on Redis's clock: a worker 300 s ahead (or behind) fails a job that
  asks for a 12 s retry and stops; the worker on time that takes the delayed copy runs it
  12 s after the failure, by Redis's clock. Judged by the hosts' clocks it waited 312 s
  (ahead) or ran it at once (behind).
* A producer 300 s ahead (or behind) sends with ``delay_ms=8000``: it runs 8 s later, and the
  message's ``message_timestamp`` is Redis's time of sending.
* An actor's ``max_age`` (60 s) is judged by Redis's clock: a worker 300 s ahead runs a
  fresh message (Dramatiq's AgeLimit dead-lettered it), one 300 s behind dead-letters a
  message sent 120 s ago (Dramatiq's ran it).
* ``dlq replay`` from a host 300 s off stamps the replayed message with Redis's time.
* The backlog's age (``queue_oldest_message_seconds``) is judged by Redis's clock: an
  exporter 300 s ahead (or behind) reports a message sent 60 s ago as 60 s old, not 360 s
  (or 0).
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import dramatiq
import dramatiq.brokers.redis
import pytest
import redis
from _lifecycle import (  # noqa: F401  (fixtures)
    NS,
    QUEUE,
    Jobs,
    Worker,
    jobs,
    lc_project,
    make_test_project,
    wait_ready,
)
from bakery import PYTHON, package_of, project_env, run_cli, wait_for
from test_scheduler import Cluster, Scheduler, cluster, every_second, sched_project  # noqa: F401

pytestmark = pytest.mark.slow

SHIFT_S = 300
SITECUSTOMIZE = '''\
"""Shift this process's wall clock by TEST_CLOCK_SHIFT_S seconds, and what redis-py's
TIME returns by the seconds written in the file TEST_REDIS_TIME_SHIFT_FILE, read at each
call (tests only)."""

import os
import time

_shift = float(os.environ.get("TEST_CLOCK_SHIFT_S") or 0)
if _shift:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _shift
    time.time_ns = lambda: _time_ns() + int(_shift * 1e9)

_shift_file = os.environ.get("TEST_REDIS_TIME_SHIFT_FILE")
if _shift_file:
    import redis.commands.core

    _redis_time = redis.commands.core.ManagementCommands.time

    def _shifted_time(self, **kwargs):
        seconds, micros = _redis_time(self, **kwargs)
        try:
            with open(_shift_file) as file:
                shift = float(file.read() or 0)
        except (OSError, ValueError):
            shift = 0.0
        return divmod(int(seconds) * 1_000_000 + int(micros) + int(shift * 1e6), 1_000_000)

    redis.commands.core.ManagementCommands.time = _shifted_time
'''

#: Actors of the clock tests: each run records its attempt and Redis's TIME (the one clock
#: the test reads), never the skewed host's.
SKEW_ACTORS = '''\
"""Actors of the clock tests."""

from __future__ import annotations

import os

import dramatiq
import redis
from dramatiq.middleware import CurrentMessage

_client = redis.Redis.from_url(os.environ["REDIS_URL"])
RETRY_DELAY_MS = 12_000


def _record(job_id: str, attempt: int) -> None:
    seconds, micros = _client.time()
    _client.rpush(f"test:skew:{job_id}", f"{attempt} {os.getpid()} {seconds + micros / 1e6}")


@dramatiq.actor(queue_name="notifications", max_retries=3)
def skew_retry(job_id: str) -> None:
    """Fails its first attempt asking for a retry in exactly RETRY_DELAY_MS."""
    message = CurrentMessage.get_current_message()
    attempt = int(message.options.get("retries", 0)) if message else 0
    _record(job_id, attempt)
    if attempt == 0:
        raise dramatiq.Retry(delay=RETRY_DELAY_MS)


@dramatiq.actor(queue_name="notifications", max_retries=0)
def skew_record(job_id: str) -> None:
    _record(job_id, 0)


@dramatiq.actor(queue_name="notifications", max_retries=0, max_age=60_000)
def skew_max_age(job_id: str) -> None:
    _record(job_id, 0)
'''
RETRY_DELAY_S = 12.0


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


@pytest.fixture(scope="session")
def skew_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``database="none"`` bake with the lifecycle and clock test actors."""
    base = bake(database="none")
    return make_test_project(base, tmp_path_factory.mktemp("skew") / base.name,
                             skew_test=SKEW_ACTORS)


def runs(client: redis.Redis, job_id: str) -> list[tuple[int, int, float]]:
    """(attempt, pid, Redis time) of each run of ``job_id``."""
    found = []
    for raw in client.lrange(f"test:skew:{job_id}", 0, -1):
        attempt, pid, stamp = raw.decode().split()
        found.append((int(attempt), int(pid), float(stamp)))
    return found


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1e6


@pytest.mark.parametrize("shift", [SHIFT_S, -SHIFT_S], ids=["ahead", "behind"])
def test_a_retry_waits_its_delay_by_redis_clock_whoever_wrote_it(
        skew_project: Path, redis_url: str, jobs: Jobs, tmp_path: Path, shift: int,
        skewed: Callable[[Path, int], dict[str, str]]) -> None:
    """The skewed worker fails the job and stores its retry; it stops, and the worker on
    time releases the delayed copy, by the eta the skewed one wrote."""
    failing = Worker(skew_project, redis_url, tmp_path / "skewed",
                     **skewed(skew_project, shift)).start()
    on_time: Worker | None = None
    try:
        wait_ready(jobs, 1)
        jobs.enqueue("skew_retry", "r1")
        first = wait_for(lambda: runs(jobs.client, "r1"), 30, "the first attempt")
        failed_at = first[0][2]
        wait_for(lambda: jobs.client.hlen(f"{NS}:{QUEUE}.DQ.msgs") >= 1, 10,
                 "the retry on the delay queue")
        on_time = Worker(skew_project, redis_url, tmp_path / "on-time").start()
        wait_ready(jobs, 2)
        assert failing.stop(timeout=30) == 0, failing.log()[-3000:]  # hands the copy back
        assert redis_now(jobs.client) - failed_at < RETRY_DELAY_S - 2, "the handover was slow"
        retried = wait_for(lambda: runs(jobs.client, "r1")[1:], RETRY_DELAY_S + 40,
                           "the retry to run")
        attempt, pid, started = retried[0]
        waited = started - failed_at
        assert attempt == 1 and pid in on_time.children(), retried
        assert RETRY_DELAY_S - 0.5 <= waited <= RETRY_DELAY_S + 10, (
            f"the retry ran {waited:.1f} s after the failure, asked for {RETRY_DELAY_S} s")
        assert on_time.stop(timeout=30) == 0, on_time.log()[-3000:]
    finally:
        failing.kill()
        if on_time is not None:
            on_time.kill()


DELAYED_SEND = """
import sys
from {package}.producer import enqueue
message = enqueue("skew_record", sys.argv[1], delay_ms=8000)
print(message.message_timestamp, message.options["eta"])
"""


@pytest.mark.parametrize("shift", [SHIFT_S, -SHIFT_S], ids=["ahead", "behind"])
def test_a_skewed_producer_delays_by_redis_clock(
        skew_project: Path, redis_url: str, jobs: Jobs, tmp_path: Path, shift: int,
        skewed: Callable[[Path, int], dict[str, str]]) -> None:
    worker = Worker(skew_project, redis_url, tmp_path / "w").start()
    try:
        wait_ready(jobs, 1)
        before = redis_now(jobs.client)
        env = {k: v for k, v in worker.env.items() if k != "WORKER_POOL"}
        env.update(skewed(skew_project, shift))
        sent = subprocess.run(
            [PYTHON, "-c", DELAYED_SEND.format(package=package_of(skew_project)), "d1"],
            cwd=skew_project, env=env, capture_output=True, text=True, timeout=60, check=False)
        assert sent.returncode == 0, sent.stderr[-3000:]
        after = redis_now(jobs.client)
        stamp_ms, eta_ms = (int(value) for value in sent.stdout.split())
        assert before - 1 <= stamp_ms / 1000 <= after + 1, (
            f"message_timestamp {stamp_ms / 1000 - after:+.1f} s from Redis's time")
        assert eta_ms - stamp_ms == 8000
        ran = wait_for(lambda: runs(jobs.client, "d1"), 60, "the delayed job")
        assert before + 8 - 0.5 <= ran[0][2] <= after + 8 + 10, (
            f"ran {ran[0][2] - before:.1f} s after the send began, asked for 8 s")
        assert worker.stop(timeout=30) == 0, worker.log()[-3000:]
    finally:
        worker.kill()


@pytest.mark.parametrize("shift", [SHIFT_S, -SHIFT_S], ids=["ahead", "behind"])
def test_the_backlog_age_is_judged_by_redis_clock(
        cluster: Cluster, skewed: Callable[[Path, int], dict[str, str]], shift: int) -> None:
    """The scheduler's exporter publishes every pool's backlog; no worker runs here."""
    cluster.use("")
    client: redis.Redis = cluster.client
    sent_ms = int(redis_now(client) * 1000) - 60_000
    message: dramatiq.Message[object] = dramatiq.Message(
        queue_name=QUEUE, actor_name="sched_job", args=(0.0,), kwargs={}, options={},
        message_timestamp=sent_ms)
    broker = dramatiq.brokers.redis.RedisBroker(url=cluster.redis_url)
    try:
        broker.enqueue(message)
    finally:
        broker.close()
    scheduler = Scheduler(cluster.project, {**cluster.env(), **skewed(cluster.project, shift)},
                          cluster.directory / "s")
    cluster.started.append(scheduler)
    scheduler.start()
    pattern = re.compile(r'^queue_oldest_message_seconds\{queue="notifications",'
                         r'worker_template_pool="[^"]+"\} (\S+)$', re.M)

    def age() -> str | None:
        try:
            found = pattern.search(scheduler.metrics())
        except OSError:
            return None
        return None if found is None else found.group(1)

    reported = float(wait_for(age, 30, "the backlog on the scheduler's /metrics"))
    expected = redis_now(client) - sent_ms / 1000
    assert abs(reported - expected) < 5, (
        f"queue_oldest_message_seconds {reported:.1f}, the message waited {expected:.1f} s")


@pytest.mark.parametrize(("shift", "sent_ago_s", "runs_it"),
                         [(SHIFT_S, 0, True), (-SHIFT_S, 120, False)], ids=["ahead", "behind"])
def test_max_age_is_judged_by_redis_clock(
        skew_project: Path, redis_url: str, jobs: Jobs, tmp_path: Path, shift: int,
        sent_ago_s: int, runs_it: bool, skewed: Callable[[Path, int], dict[str, str]]) -> None:
    worker = Worker(skew_project, redis_url, tmp_path / "w", **skewed(skew_project, shift)).start()
    try:
        wait_ready(jobs, 1)
        sent_ms = int((redis_now(jobs.client) - sent_ago_s) * 1000)
        jobs.broker.enqueue(dramatiq.Message(
            queue_name=QUEUE, actor_name="skew_max_age", args=("a1",), kwargs={}, options={},
            message_timestamp=sent_ms))
        if runs_it:
            wait_for(lambda: runs(jobs.client, "a1"), 30, "the fresh message to run")
            assert not jobs.dead_letters()
        else:
            wait_for(lambda: jobs.dead_letters(), 30, "the stale message to be dead-lettered")
            assert not runs(jobs.client, "a1")
        assert worker.stop(timeout=30) == 0, worker.log()[-3000:]
    finally:
        worker.kill()


@pytest.mark.parametrize("shift", [SHIFT_S, -SHIFT_S], ids=["ahead", "behind"])
def test_dlq_replay_stamps_the_message_with_redis_clock(
        lc_project: Path, redis_url: str, jobs: Jobs, shift: int,
        skewed: Callable[[Path, int], dict[str, str]]) -> None:
    from test_dlq import kill_letter

    dead = kill_letter(redis_url, QUEUE, "lc_quick", "x1", reason="boom")
    env = project_env(lc_project, WORKER_POOL="interactive", REDIS_URL=redis_url,
                      **skewed(lc_project, shift))
    before = redis_now(jobs.client)
    done = run_cli(lc_project, "dlq", "replay", dead.options["redis_message_id"], env=env)
    after = redis_now(jobs.client)
    assert done.returncode == 0, done.stderr
    [replayed] = jobs.queued()
    assert before - 1 <= replayed.message_timestamp / 1000 <= after + 1, (
        f"message_timestamp {replayed.message_timestamp / 1000 - after:+.1f} s from Redis's time")
