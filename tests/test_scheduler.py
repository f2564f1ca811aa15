"""Schedules, proved with real scheduler and worker processes and a real redis-server.

Two schedulers and a worker never run two runs of a schedule at once nor a tick twice;
SIGKILL of the leader hands over within the lock's TTL + 1 s without a tick fired twice;
after downtime ``skip`` fires only the latest tick and ``catch_up`` each missed one once;
bad schedules refuse to boot with exit 78 and a line naming the schedule and the key.

Each test writes its own pools file (the bake's pools.toml plus its schedules) and points
every process at it with ``WORKER_POOLS_FILE``. The test actor records each run's tick,
start and end in Redis. Leader TTLs are short (1.5 s) to keep the tests brief.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis
from _lifecycle import ServiceProcess, Worker, free_port, make_test_project, wait_for
from bakery import PYTHON, package_of, project_env

pytestmark = pytest.mark.slow

TTL_MS = 1500
SCHED_ACTORS = '''\
"""Actors of the scheduler tests: each run records its tick, start and end in Redis."""

from __future__ import annotations

import os
import time

import dramatiq
import redis
from dramatiq.middleware import CurrentMessage

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


@dramatiq.actor(queue_name="notifications", max_retries=0)
def sched_job(seconds: float) -> None:
    message = CurrentMessage.get_current_message()
    tick = message.options.get("schedule_tick") if message else None
    _client.rpush("test:sched:start", f"{tick} {os.getpid()} {time.time()}")
    time.sleep(seconds)
    _client.rpush("test:sched:end", f"{tick} {os.getpid()} {time.time()}")

'''


@pytest.fixture(scope="session")
def sched_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``database="none"`` bake with the scheduler test actor."""
    base = bake(database="none")
    return make_test_project(base, tmp_path_factory.mktemp("sched") / base.name,
                             sched_test=SCHED_ACTORS)


def pools_file(project: Path, directory: Path, schedules: str) -> Path:
    """The bake's pools.toml without its schedules, plus ``schedules``."""
    text = (project / "pools.toml").read_text()
    text = text.split("\n# [schedules.<name>]")[0]
    path = directory / "pools.toml"
    path.write_text(text + "\n" + schedules)
    return path


def every_second(missed: str = "skip", seconds: float = 0.0, extra: str = "") -> str:
    return f"""
[schedules.every_second]
actor = "sched_job"
cron = "* * * * * *"
missed = "{missed}"
max_runtime_s = 1
args = [{seconds}]
{extra}
"""


class Scheduler(ServiceProcess):
    """``python -m <package> scheduler`` with ``env``, its own metrics port and state dir."""

    def __init__(self, project: Path, env: dict[str, str], directory: Path) -> None:
        super().__init__(project, "scheduler", directory, {
            **env, "METRICS_PORT": str(free_port()), "WORKER_STATE_DIR": str(directory / "state")})

class Cluster:
    """Schedulers and workers of one test, all on the test's pools file; killed at teardown."""

    def __init__(self, project: Path, redis_url: str, directory: Path) -> None:
        self.project, self.redis_url, self.directory = project, redis_url, directory
        self.client = redis.Redis.from_url(redis_url)
        self.pools: Path | None = None
        self.started: list[Scheduler | Worker] = []

    def use(self, schedules: str) -> Path:
        self.pools = pools_file(self.project, self.directory, schedules)
        return self.pools

    def env(self, **extra: str) -> dict[str, str]:
        assert self.pools is not None
        # No WORKER_POOL: the scheduler's environment is what its Deployment sets.
        return project_env(
            self.project, REDIS_URL=self.redis_url, WORKER_POOLS_FILE=str(self.pools),
            SCHEDULER_LEADER_TTL_MS=str(TTL_MS), **extra)

    def scheduler(self) -> Scheduler:
        scheduler = Scheduler(self.project, self.env(), self.directory / f"s{len(self.started)}")
        self.started.append(scheduler)
        return scheduler.start()

    def worker(self) -> Worker:
        worker = Worker(self.project, self.redis_url, self.directory / f"w{len(self.started)}",
                        WORKER_POOLS_FILE=str(self.pools), WORKER_CONCURRENCY="4")
        self.started.append(worker)
        return worker.start()

    def state(self, schedule: str = "every_second") -> dict[str, str]:
        raw = self.client.hgetall(f"dramatiq:schedules:{schedule}")
        return {k.decode(): v.decode() for k, v in raw.items()}

    def runs(self, kind: str) -> list[tuple[int, float]]:
        """(tick, time) of each recorded run start or end."""
        entries = []
        for raw in self.client.lrange(f"test:sched:{kind}", 0, -1):
            tick, _, stamp = raw.decode().split()
            entries.append((int(tick), float(stamp)))
        return entries

    def queued_ticks(self, queue: str = "notifications") -> list[int]:
        """The ticks of the scheduled messages waiting in ``queue``, in queue order."""
        ticks = []
        for redis_id in self.client.lrange(f"dramatiq:{queue}", 0, -1):
            body = self.client.hget(f"dramatiq:{queue}.msgs", redis_id)
            assert body is not None
            ticks.append(int(dramatiq.Message.decode(body).options["schedule_tick"]))
        return ticks


@pytest.fixture
def cluster(sched_project: Path, redis_url: str, tmp_path: Path) -> Iterator[Cluster]:
    helper = Cluster(sched_project, redis_url, tmp_path)
    yield helper
    for process in helper.started:
        process.kill()
    helper.client.close()


def fired_ticks(schedulers: list[Scheduler]) -> list[int]:
    """Every tick any scheduler logged as enqueued (fired or caught up)."""
    ticks = []
    for scheduler in schedulers:
        for record in scheduler.records():
            if record.get("event") in {"schedule_fired", "schedule_caught_up"}:
                ticks.append(_tick_of(record["tick"]))
    return ticks


def _tick_of(iso: str) -> int:
    import calendar

    return calendar.timegm(time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ"))


def counter(text: str, outcome: str, schedule: str = "every_second") -> float:
    match = re.search(
        rf'^schedule_runs_total\{{outcome="{outcome}",schedule="{schedule}"\}} (\S+)$', text, re.M)
    assert match, f"no schedule_runs_total for {outcome} in:\n{text}"
    return float(match.group(1))


def test_two_schedulers_and_a_worker_never_overlap_nor_fire_a_tick_twice(
        cluster: Cluster) -> None:
    cluster.use(every_second(seconds=2.5))
    worker = cluster.worker()
    first, second = cluster.scheduler(), cluster.scheduler()
    wait_for(lambda: cluster.runs("start"), 30, "the first scheduled run")
    began = time.time()
    time.sleep(20)
    assert sum(1 for s in (first, second) if s.records("leading")) == 1
    assert not first.records("step_down") and not second.records("step_down")
    leader = first if first.records("leading") else second
    exported = leader.metrics()
    assert "scheduler_leader 1.0" in exported
    assert "scheduler_leader 0.0" in (second if leader is first else first).metrics()
    assert first.stop() == 0 and second.stop() == 0
    wait_for(lambda: len(cluster.runs("end")) == len(cluster.runs("start")), 10,
             "the last run to end")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0

    starts, ends = cluster.runs("start"), dict(cluster.runs("end"))
    assert len(starts) >= 5, starts
    ticks = [tick for tick, _ in starts]
    assert len(ticks) == len(set(ticks)), f"a tick ran twice: {ticks}"
    runs = sorted((stamp, ends[tick]) for tick, stamp in starts)
    for (_, end), (start, _) in zip(runs, runs[1:], strict=False):
        assert start >= end, f"a run started at {start} before the previous ended at {end}"

    fired = fired_ticks([first, second])
    assert len(fired) == len(set(fired)), f"a tick was enqueued twice: {sorted(fired)}"
    state = cluster.state()
    skipped = int(state["runs:skipped_overlap"])
    # ~1 run every 3 s: of the ~20 ticks in the window, most were skipped and counted.
    ticks_in_window = sum(1 for tick in fired if tick >= began) + skipped
    print(f"20 s: {len(starts)} runs, {skipped} ticks skipped for overlap, state {state}")
    assert skipped >= 10, state
    assert counter(exported, "skipped_overlap") >= skipped - 2
    assert counter(exported, "fired") >= int(state["runs:fired"]) - 1
    assert int(state["runs:fired"]) == len(fired)
    assert ticks_in_window >= 15
    assert not cluster.client.exists("dramatiq:schedules:every_second:lock")
    assert float(state["success_at"]) >= max(ends.values()) - 0.5


def test_the_worker_skips_a_run_while_the_previous_one_holds_the_renewed_lock(
        cluster: Cluster) -> None:
    """Two runs queued back to back (as after a slow worker start): the second starts while
    the first, longer than the lock's 1 s lease, still holds it (renewed): skipped, counted."""
    cluster.use(every_second(seconds=2.5))
    client = cluster.client
    worker = cluster.worker()

    def enqueue(tick: int) -> None:
        message: dramatiq.Message[Any] = dramatiq.Message(
            queue_name="notifications", actor_name="sched_job", args=(2.5,), kwargs={},
            options={"schedule": "every_second", "schedule_tick": tick,
                     "schedule_lease_ms": 1000, "redis_message_id": f"r{tick}"},
            message_id=f"m{tick}")
        client.hset("dramatiq:notifications.msgs", f"r{tick}", message.encode())
        client.rpush("dramatiq:notifications", f"r{tick}")

    enqueue(1)
    (_, started), = wait_for(lambda: cluster.runs("start"), 30, "the first run to start")
    # Past the 1 s lease: only renewal keeps the lock held now.
    wait_for(lambda: time.time() >= started + 1.6, 5, "1.6 s into the first run")
    enqueue(2)
    wait_for(lambda: cluster.runs("end"), 20, "the first run to end")
    time.sleep(0.5)
    assert [tick for tick, _ in cluster.runs("start")] == [1]
    assert cluster.state()["runs:skipped_overlap"] == "1"
    log = worker.log()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any(line.get("outcome") == "skipped" for line in lines), log[-3000:]
    assert "schedule_skipped_overlap" in log


def test_sigkill_of_the_leader_hands_over_within_the_ttl_without_a_double_fire(
        cluster: Cluster) -> None:
    cluster.use(every_second())
    first, second = cluster.scheduler(), cluster.scheduler()
    wait_for(lambda: int(cluster.state().get("runs:fired", 0)) >= 3, 30, "three fired ticks")
    holder = cluster.client.get("dramatiq:scheduler:leader").decode()
    leader, follower = (first, second) if f":{first.pid}:" in holder else (second, first)
    killed_at = time.time()
    os.killpg(leader.pid, signal.SIGKILL)
    leader.process.wait(timeout=5)  # type: ignore[union-attr]

    def fired_after_kill() -> float | None:
        state = cluster.state()
        return float(state["fired_at"]) if int(state["fired"]) > killed_at else None

    handed_at = wait_for(fired_after_kill, 10, "the follower to fire a tick")
    print(f"handover: first tick fired {handed_at - killed_at:.2f} s after SIGKILL")
    assert handed_at - killed_at <= TTL_MS / 1000 + 1.0, (
        f"the follower fired {handed_at - killed_at:.2f} s after the kill")
    assert follower.records("leading")
    time.sleep(2.5)
    follower.stop()
    queued = cluster.queued_ticks()
    assert len(queued) == len(set(queued)), f"a tick was enqueued twice: {queued}"
    assert queued == sorted(queued)
    state = cluster.state()
    assert int(state["runs:fired"]) == len(queued)
    # skip: the ticks between the kill and the takeover are counted as missed, not lost.
    assert int(state["runs:fired"]) + int(state.get("runs:missed", 0)) == (
        queued[-1] - queued[0] + 1)


@pytest.mark.parametrize("policy", ["skip", "catch_up"])
def test_after_downtime_skip_fires_once_and_catch_up_fires_each_missed_tick_once(
        cluster: Cluster, policy: str) -> None:
    cluster.use(every_second(policy))
    scheduler = cluster.scheduler()
    wait_for(lambda: int(cluster.state().get("runs:fired", 0)) >= 2, 30, "two fired ticks")
    assert scheduler.stop() == 0
    last = int(cluster.state()["tick"])
    before = cluster.queued_ticks()
    assert before[-1] == last
    wait_for(lambda: time.time() >= last + 5.5, 10, "five ticks of downtime")
    restarted = cluster.scheduler()
    restarted_at = time.time()
    wait_for(lambda: int(cluster.state()["tick"]) >= restarted_at + 2, 30, "ticks after restart")
    assert restarted.stop() == 0
    after = cluster.queued_ticks()[len(before):]
    assert len(after) == len(set(after)) and after == sorted(after), after
    state = cluster.state()
    if policy == "skip":
        first = after[0]
        # The restart came at least 5.5 s after the last tick: the ticks of the downtime
        # (last + 1 to last + 4) are missed; last + 5 fires only if the new leader was up
        # within its grace (then it is the latest due tick, on time), else a later one.
        assert first - last >= 5, "the ticks of the downtime fired"
        assert int(state["runs:missed"]) == first - last - 1
        assert after == list(range(first, first + len(after))), "a tick after the restart was lost"
        assert int(state.get("runs:caught_up", 0)) == 0
    else:
        assert after == list(range(last + 1, after[-1] + 1)), "each missed tick once, in order"
        assert int(state["runs:caught_up"]) >= 3
        assert int(state.get("runs:missed", 0)) == 0
        assert restarted.records("schedule_caught_up")


BAD = [
    ("bad_cron", 'actor = "sched_job"\ncron = "61 * * * *"\nmissed = "skip"', "cron"),
    ("no_policy", 'actor = "sched_job"\ncron = "* * * * *"', "missed"),
    ("bad_policy", 'actor = "sched_job"\ncron = "* * * * *"\nmissed = "later"', "missed"),
    ("bad_zone", 'actor = "sched_job"\ncron = "* * * * *"\nmissed = "skip"\ntimezone = "Mars/Base"',
     "timezone"),
    ("unknown", 'actor = "no_such_actor"\ncron = "* * * * *"\nmissed = "skip"', "actor"),
    ("bad_args", 'actor = "sched_job"\ncron = "* * * * *"\nmissed = "skip"\nargs = [1, 2, 3]',
     "args"),
]


#: Errors the pools-file model catches alone: `schedules` (which imports no actor) refuses
#: them too; the worker and the scheduler refuse every case.
MODEL_ERRORS = {"bad_cron", "no_policy", "bad_policy", "bad_zone"}


@pytest.mark.parametrize(("name", "table", "key"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_schedule_refuses_to_boot_naming_the_schedule_and_key(
        cluster: Cluster, name: str, table: str, key: str) -> None:
    cluster.use(f"\n[schedules.{name}]\n{table}\n")
    commands = ["scheduler", "worker"] + (["schedules"] if name in MODEL_ERRORS else [])
    for command in commands:
        pool = {"WORKER_POOL": "interactive"} if command == "worker" else {}
        result = subprocess.run(
            [PYTHON, "-m", package_of(cluster.project), command], cwd=cluster.project,
            env=cluster.env(METRICS_PORT=str(free_port()), **pool), capture_output=True,
            text=True, timeout=60)
        assert result.returncode == 78, (command, result.stdout, result.stderr)
        lines = [line for line in result.stderr.splitlines() if f"schedules.{name}.{key}" in line]
        # The worker's supervisor repeats its process's reason when it stops the container.
        assert len(lines) == 1 or (command == "worker" and lines), (command, result.stderr)
        assert "Traceback" not in result.stderr


def test_an_actor_on_a_queue_no_pool_serves_refuses_to_boot(
        cluster: Cluster, tmp_path: Path) -> None:
    project = cluster.project
    orphan = project / "src" / package_of(project) / "actors" / "sched_orphan.py"
    orphan.write_text(
        "import dramatiq\n\n\n@dramatiq.actor(queue_name=\"orphans\")\n"
        "def orphan() -> None:\n    pass\n")
    try:
        cluster.use('\n[schedules.lost]\nactor = "orphan"\ncron = "* * * * *"\nmissed = "skip"\n')
        result = subprocess.run(
            [PYTHON, "-m", package_of(project), "scheduler"], cwd=project, env=cluster.env(),
            capture_output=True, text=True, timeout=60)
    finally:
        orphan.unlink()
    assert result.returncode == 78, result.stderr
    assert any("schedules.lost.actor" in line and "'orphans'" in line
               for line in result.stderr.splitlines()), result.stderr


def test_schedules_lists_next_fire_times_and_last_runs(cluster: Cluster) -> None:
    cluster.use(every_second() + """
[schedules.paris_morning]
actor = "sched_job"
cron = "0 30 6 * * 1-5"
timezone = "Europe/Paris"
missed = "catch_up"
args = [0]
""")
    scheduler = cluster.scheduler()
    wait_for(lambda: int(cluster.state().get("runs:fired", 0)) >= 1, 30, "a fired tick")
    # The worker's conventions: /livez, /readyz and `healthcheck live` on its own state dir.
    for path in ("/livez", "/readyz"):
        url = f"http://127.0.0.1:{scheduler.port}{path}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert reply.status == 200, path
    live = subprocess.run(
        [PYTHON, "-m", package_of(cluster.project), "healthcheck", "live"], cwd=cluster.project,
        env=scheduler.env, capture_output=True, text=True, timeout=60)
    assert live.returncode == 0, live.stderr
    busy = Scheduler(cluster.project, cluster.env(), cluster.directory / "busy")
    busy.env["METRICS_PORT"] = str(scheduler.port)
    cluster.started.append(busy.start())
    assert busy.process is not None and busy.process.wait(timeout=60) == 78
    assert f"METRICS_PORT={scheduler.port}" in busy.log_path.read_text()
    assert scheduler.stop() == 0
    result = subprocess.run(
        [PYTHON, "-m", package_of(cluster.project), "schedules", "--json"], cwd=cluster.project,
        env=cluster.env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = {row["schedule"]: row for row in json.loads(result.stdout)["schedules"]}
    assert rows["every_second"]["last_fired"] and rows["every_second"]["runs"]["fired"] >= 1
    morning = rows["paris_morning"]
    assert morning["last_fired"] is None and len(morning["next"]) == 3
    for stamp in morning["next"]:
        assert stamp[11:19] == "06:30:00" and stamp.endswith(("+01:00", "+02:00")), stamp
