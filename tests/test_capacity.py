"""``capacity`` of a baked service: real worker processes against a real redis-server.

The baked project is copied and given test actors on the ``notifications`` queue
(pool ``interactive``): one that waits (I/O-bound), one that waits holding a
process-wide lock (serialized), one that fails, and one that is much slower in the
first round (a disturbed round).

These tests prove what the command does with real processes: the table, the rounds,
the refusals, what it leaves behind, and bounds that load cannot break (a level never
beats its ideal). No verdict here depends on how busy the machine is: where throughput
stops rising is decided by pure functions, proven on measurements fed to them in the
baked ``tests/test_capacity.py``; the real CPU-bound measurement is
``bench/capacity_bench.py``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

from bakery import PYTHON, copy_project, package_of, project_env, run_cli, wait_for

pytestmark = pytest.mark.slow

ACTORS = '''
"""Test actors for ``capacity``."""

import os
import threading
import time

import dramatiq

_ONE_AT_A_TIME = threading.Lock()
# Every job of wait_longer_in_the_first_round adds a byte here (an atomic append).
_DONE = os.environ.get("CAPACITY_TEST_JOBS", "")
DISTURBED = 8  # times slower in the first round


@dramatiq.actor(queue_name="notifications", max_retries=0)
def wait(seconds: float) -> None:
    time.sleep(seconds)


@dramatiq.actor(queue_name="notifications", max_retries=0)
def wait_in_line(seconds: float) -> None:
    with _ONE_AT_A_TIME:
        time.sleep(seconds)


@dramatiq.actor(queue_name="notifications", max_retries=0)
def wait_longer_in_the_first_round(seconds: float, first_round: int) -> None:
    with open(_DONE, "a") as done:
        done.write("x")
        count = done.tell()
    time.sleep(seconds * DISTURBED if count <= first_round else seconds)


@dramatiq.actor(queue_name="notifications", max_retries=0)
def fail() -> None:
    raise RuntimeError("probe job fails")
'''


@pytest.fixture(scope="module")
def service(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    project = bake(database="none")
    return copy_project(project, tmp_path_factory.mktemp("capacity") / project.name,
                        capacity_probes=ACTORS)


def capacity(service: Path, redis_url: str, *args: str, **env_vars: str
             ) -> subprocess.CompletedProcess[str]:
    env = project_env(service, WORKER_POOL="interactive", REDIS_URL=redis_url, **env_vars)
    return run_cli(service, "capacity", *args, env=env, timeout=450)


def measured(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout)
    return report


def rates(report: dict[str, object]) -> list[float]:
    levels = report["levels"]
    assert isinstance(levels, list)
    return [float(level["jobs_per_s"]) for level in levels]


def assert_queue_empty(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    for key in ("notifications", "notifications.msgs", "notifications.DQ",
                "notifications.DQ.msgs", "notifications.XQ"):
        assert not client.exists(f"dramatiq:{key}"), key


def test_io_bound_handler_keeps_rising(service: Path, redis_url: str) -> None:
    result = capacity(service, redis_url, "--actor", "wait", "--args", "[0.02]",
                      "--jobs", "60", "--concurrency", "1,2,4")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("actor 'wait' on queue 'notifications' (pool interactive), 60 jobs per "
                        "level, best of 3 rounds")
    assert lines[2].split() == ["concurrency", "jobs/s", "gain", "rounds"]
    assert [line.split()[0] for line in lines[3:6]] == ["1", "2", "4"]
    # Rounds 1 and 2 say how far they are (stderr) before the rows of round 3.
    progress = [line.rsplit(",", 1)[0] for line in result.stderr.splitlines()]
    assert progress == [f"round {r} of 3: concurrency {c}" for r in (1, 2) for c in (1, 2, 4)]
    assert lines[-1].startswith(("throughput still rises at concurrency 4",
                                 "throughput stops rising at concurrency ")), lines[-1]
    for line in lines[3:6]:  # a level is its best round, and every round is shown
        rate, *rounds = (float(field) for field in line.split()[1:2] + line.split()[3:])
        assert len(rounds) == 3 and rate == max(rounds), line
    for concurrency, line in zip((1, 2, 4), lines[3:6], strict=True):
        # Load only slows a round: no level beats c handlers that each wait 20 ms.
        assert float(line.split()[1]) < concurrency / 0.02 * 1.05, line
    assert_queue_empty(redis_url)


def test_serialized_handler_stops_rising(service: Path, redis_url: str) -> None:
    report = measured(capacity(service, redis_url, "--actor", "wait_in_line", "--args", "[0.02]",
                               "--jobs", "40", "--concurrency", "1,2,4", "--json"))
    assert report["rounds"] == 3 and isinstance(report["noisy"], list)
    # The lines the command prints beside the table are kept for the console's page.
    assert isinstance(report["verdict"], str) and report["verdict"]
    assert len(report["warnings"]) == (1 if report["noisy"] else 0), report
    assert report["stops_rising_at"] in (1, 2, 4, None), report
    for level in report["levels"]:  # type: ignore[union-attr]
        assert len(level["rounds"]) == 3 and level["jobs_per_s"] == max(level["rounds"]), level
    # Whatever the load, the lock lets through at most one 20 ms job at a time.
    assert max(rates(report)) < 1 / 0.02 * 1.05, report
    assert_queue_empty(redis_url)
    # The result is kept as the queue's last one, for the console's chart
    # (tests/test_console.py draws one of this shape).
    stored = json.loads(redis.Redis.from_url(redis_url).get("dramatiq:__capacity__.notifications"))
    assert stored.pop("measured_at_ms") > 1_700_000_000_000
    assert stored == report


def test_a_disturbed_round_is_reported(service: Path, redis_url: str, tmp_path: Path) -> None:
    result = capacity(service, redis_url, "--actor", "wait_longer_in_the_first_round",
                      "--args", "[0.02, 20]", "--jobs", "20", "--concurrency", "1",
                      "--rounds", "2", CAPACITY_TEST_JOBS=str(tmp_path / "done"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    first, second = (float(rate) for rate in lines[3].split()[3:])
    # The first round ran jobs 8 times longer: only load that slowed the second round
    # more than 6-fold against the first could hide that.
    assert second > 1.33 * first, lines[3]
    assert float(lines[3].split()[1]) == second  # the level is its best round
    warning = next(line for line in lines if line.startswith("the rounds of concurrency 1 "))
    assert warning.endswith(": something else ran on this machine, and the verdict may be "
                            "wrong; measure again where nothing else runs"), warning
    assert_queue_empty(redis_url)


def test_refuses_a_queue_that_holds_messages(service: Path, redis_url: str) -> None:
    broker = RedisBroker(url=redis_url)
    waiting = broker.enqueue(Message(queue_name="notifications", actor_name="wait",
                                     args=(0,), kwargs={}, options={}))
    result = capacity(service, redis_url, "--actor", "wait", "--args", "[0.01]")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "capacity: queue 'notifications' holds messages; the probe runs only on an idle queue, "
        "so it never mixes with real traffic")
    client = broker.client
    assert client.lrange("dramatiq:notifications", 0, -1) == [
        waiting.options["redis_message_id"].encode()]
    assert client.hlen("dramatiq:notifications.msgs") == 1
    broker.close()


def test_failing_jobs_abort_and_leave_nothing_behind(service: Path, redis_url: str) -> None:
    result = capacity(service, redis_url, "--actor", "fail", "--jobs", "20",
                      "--concurrency", "1,2")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("capacity: ")
    assert line.endswith(" probe job(s) failed (RuntimeError: probe job fails); capacity is "
                         "measured with jobs that succeed")
    assert_queue_empty(redis_url)


def test_redis_down_is_one_line(service: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        down = f"redis://:hunter2@127.0.0.1:{sock.getsockname()[1]}/0"
    result = capacity(service, down, "--actor", "wait", "--json")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("capacity: Redis at redis://:***@127.0.0.1:")
    assert "unreachable" in line and "hunter2" not in line


def test_too_few_jobs_to_time_the_highest_level_is_one_line(service: Path, redis_url: str
                                                             ) -> None:
    result = capacity(service, redis_url, "--actor", "wait", "--jobs", "15",
                      "--concurrency", "1,2,4")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "capacity: --jobs 15 is too few to time concurrency 4: give at least 16 (a level's "
        "first and last 4 are not timed)")
    assert_queue_empty(redis_url)


def test_jobs_too_fast_to_time_is_one_line(service: Path, redis_url: str) -> None:
    result = capacity(service, redis_url, "--actor", "wait", "--args", "[0]", "--jobs", "8",
                      "--concurrency", "1,2")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("capacity: the ") and " timed jobs of 8 were done in " in line, line
    assert line.endswith(" s, too fast to time; give more --jobs"), line
    assert_queue_empty(redis_url)


def test_rounds_is_a_positive_whole_number(service: Path, redis_url: str) -> None:
    result = capacity(service, redis_url, "--actor", "wait", "--rounds", "0")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].endswith("argument --rounds: must be at least 1"), (
        result.stderr)


def test_unknown_actor(service: Path, redis_url: str) -> None:
    result = capacity(service, redis_url, "--actor", "nope")
    assert result.returncode == 1
    assert result.stderr.startswith("capacity: no actor named 'nope' (actors: ")
    assert "wait_in_line" in result.stderr


def children(pid: int, running: str) -> list[int]:
    """The child processes of ``pid`` whose command line has the argument ``running``."""
    try:
        pids = [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    found = []
    for child in pids:
        try:
            if running in Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0"):
                found.append(child)
        except OSError:
            continue  # gone meanwhile
    return found


def test_a_killed_probe_leaves_no_worker_taking_jobs(service: Path, redis_url: str) -> None:
    env = project_env(service, WORKER_POOL="interactive", REDIS_URL=redis_url)
    probe = subprocess.Popen(
        [PYTHON, "-m", package_of(service), "capacity", "--actor", "wait", "--args", "[0.5]",
         "--jobs", "40", "--concurrency", "1"],
        cwd=service, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: client.hlen("dramatiq:notifications.msgs") == 40, 120, "the jobs")
        (worker,) = wait_for(lambda: children(probe.pid, running="worker"), 120,
                             "the probe's worker")
        wait_for(lambda: client.hlen("dramatiq:notifications.msgs") < 40, 120, "a job done")
    finally:
        probe.kill()  # SIGKILL: the probe cannot stop its worker itself
        probe.wait()
    # The worker hears of it (SIGTERM), drains its one job and exits.
    wait_for(lambda: not Path(f"/proc/{worker}").exists()
             or Path(f"/proc/{worker}/stat").read_text().rpartition(")")[2].split()[0] == "Z",
             120, "the orphaned worker to exit")
    left = client.hlen("dramatiq:notifications.msgs")
    time.sleep(1.5)  # three 0.5 s jobs' time: nothing takes them now
    assert client.hlen("dramatiq:notifications.msgs") == left > 0
    client.flushall()
