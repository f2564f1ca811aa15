"""Daylight saving, proved with a real ``scheduler`` process whose Redis clock is moved.

The scheduler judges time by Redis's ``TIME`` alone (:mod:`test_clock_skew`), so the night
is staged by moving what ``TIME`` returns *in the scheduler process*: the test shim of
:mod:`test_clock_skew` (a ``sitecustomize`` on its ``PYTHONPATH``) adds the seconds written
in a file to redis-py's ``TIME`` reply, re-read at each call. The production code has no
test hook; the Redis server, the host clock and everything else run as they are. The test
moves the clock while the scheduler runs, as the night goes: first sight of the schedule an
hour before, then a few seconds before each instant that matters, and watches what the
real process enqueues (no worker runs: the messages stay queued, each with its tick).

* Fall-back, Europe/Berlin, 25 October 2026: ``0 2 * * *`` with ``dst = "once"`` (the
  default) enqueues 02:00 CEST and nothing at 02:00 CET an hour later; ``dst = "every"``
  enqueues both. Neither counts a tick missed. Without the ``dst`` rule the default fired
  both (the nightly job ran twice).
* Spring-forward, 29 March 2026: ``30 2 * * *`` (02:30 does not exist that night) enqueues
  once, at 03:00 CEST, the end of the gap, and nothing at 03:30 CEST.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis
from bakery import wait_for
from test_clock_skew import SITECUSTOMIZE
from test_scheduler import Cluster, Scheduler, cluster, sched_project  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow

#: Europe/Berlin 2026: back at 01:00 UTC on 25 October (03:00 CEST -> 02:00 CET), forward at
#: 01:00 UTC on 29 March (02:00 CET -> 03:00 CEST).
CEST_2AM_OCT_25 = int(datetime(2026, 10, 25, 0, 0, tzinfo=UTC).timestamp())
CET_2AM_OCT_25 = CEST_2AM_OCT_25 + 3600
CEST_3AM_MAR_29 = int(datetime(2026, 3, 29, 1, 0, tzinfo=UTC).timestamp())
#: How long before an instant the clock is set, and how long after it the test watches.
LEAD_S, WATCH_S = 3.0, 4.0


class RedisClock:
    """Sets what Redis's ``TIME`` reads in the processes started with :meth:`env`."""

    def __init__(self, directory: Path, client: redis.Redis) -> None:
        shim = directory / "redisclock"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.shim, self.file, self.client = shim, directory / "redis-time-shift", client
        self.file.write_text("0")

    def env(self, project: Path) -> dict[str, str]:
        return {"PYTHONPATH": f"{self.shim}:{project / 'src'}",
                "TEST_REDIS_TIME_SHIFT_FILE": str(self.file)}

    def real(self) -> float:
        seconds, micros = self.client.time()
        return float(seconds) + micros / 1e6

    def set(self, instant: float) -> None:
        """From now on the processes read ``instant`` (epoch s) from ``TIME``, and on. The
        shift file is replaced, never rewritten in place: the shim reads it at every
        ``TIME``, and a read between a truncation and the write saw an empty file, shift 0,
        the real clock (a loaded CI run: the scheduler ticked in December and counted 248
        nights missed)."""
        staged = self.file.with_suffix(".new")
        staged.write_text(repr(instant - self.real()))
        staged.replace(self.file)

    def now(self) -> float:
        """What the processes read from ``TIME`` now."""
        return self.real() + float(self.file.read_text())

    def wait_until(self, instant: float) -> None:
        while (left := instant - self.now()) > 0:
            time.sleep(min(left, 0.2))


@pytest.fixture
def redis_clock(cluster: Cluster) -> Iterator[RedisClock]:
    yield RedisClock(cluster.directory, cluster.client)


def nightly(cron: str, dst: str) -> str:
    return f"""
[schedules.nightly]
actor = "sched_job"
cron = "{cron}"
timezone = "Europe/Berlin"
missed = "skip"
dst = "{dst}"
max_runtime_s = 1
args = [0.0]
"""


def start_at(cluster: Cluster, clock: RedisClock, instant: float) -> Scheduler:
    """A scheduler that first sees the schedule at ``instant`` and leads."""
    clock.set(instant)
    scheduler = Scheduler(cluster.project, {**cluster.env(), **clock.env(cluster.project)},
                          cluster.directory / "s")
    cluster.started.append(scheduler)
    scheduler.start()
    wait_for(lambda: scheduler.records("leading") and "since" in cluster.state("nightly"), 30,
             "the scheduler to lead and see the schedule")
    assert abs(int(cluster.state("nightly")["since"]) - instant) < 30, "the shim is not in use"
    return scheduler


def pass_through(cluster: Cluster, clock: RedisClock, instant: float) -> list[int]:
    """Set the clock just before ``instant``, watch past it; the queued ticks then."""
    clock.set(instant - LEAD_S)
    clock.wait_until(instant + WATCH_S)
    return cluster.queued_ticks()


@pytest.mark.parametrize("dst", ["once", "every"])
def test_the_fall_back_night_fires_two_am_by_the_dst_setting(
        cluster: Cluster, redis_clock: RedisClock, dst: str) -> None:
    cluster.use(nightly("0 2 * * *", dst))
    scheduler = start_at(cluster, redis_clock, CEST_2AM_OCT_25 - 3600)
    assert pass_through(cluster, redis_clock, CEST_2AM_OCT_25) == [CEST_2AM_OCT_25]
    ticks = pass_through(cluster, redis_clock, CET_2AM_OCT_25)
    expected = [CEST_2AM_OCT_25, CET_2AM_OCT_25] if dst == "every" else [CEST_2AM_OCT_25]
    assert ticks == expected, f"dst={dst}: queued ticks {ticks}, expected {expected}"
    state = cluster.state("nightly")
    assert int(state.get("runs:fired", 0)) == len(expected), state
    assert int(state.get("runs:missed", 0)) == 0, state
    assert scheduler.stop(timeout=20) == 0, scheduler.log()[-3000:]


def test_the_spring_forward_night_fires_the_skipped_time_once_at_three(
        cluster: Cluster, redis_clock: RedisClock) -> None:
    cluster.use(nightly("30 2 * * *", "once"))
    scheduler = start_at(cluster, redis_clock, CEST_3AM_MAR_29 - 1800)
    assert pass_through(cluster, redis_clock, CEST_3AM_MAR_29) == [CEST_3AM_MAR_29]
    assert pass_through(cluster, redis_clock, CEST_3AM_MAR_29 + 1800) == [CEST_3AM_MAR_29]
    state = cluster.state("nightly")
    assert int(state.get("runs:fired", 0)) == 1 and int(state.get("runs:missed", 0)) == 0, state
    assert scheduler.stop(timeout=20) == 0, scheduler.log()[-3000:]
