"""Schedules: the pools.toml model, tick arithmetic, and one scheduler round on a fake clock
against the test session's real Redis (the real-process tests live in the template repo)."""

from __future__ import annotations

import inspect
import itertools
import tomllib
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import redis

import templateservice
from worker_runtime.layout import read_states
from worker_runtime.layout import scheduler_leader_key as leader_key
from worker_runtime.pools import PoolsFileError, load_pools
from worker_runtime.scheduling.loop import Scheduler, SchedulerSettings, Target
from worker_runtime.scheduling.schedules import Schedule, actor_problems

ROOT = templateservice.HOME
T0 = 1_800_000_000  # a whole minute (2027-01-15T08:00:00Z)


def schedule(**fields: object) -> Schedule:
    return Schedule.model_validate(
        {"actor": "job", "cron": "* * * * * *", "missed": "skip", **fields}
    )


def test_the_default_pools_file_ships_a_valid_example_schedule() -> None:
    schedules = load_pools(ROOT / "pools.toml").schedules
    assert schedules, "the bake ships one example schedule"
    for item in schedules.values():
        assert item.missed in {"skip", "catch_up"}


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ('actor = "a"\ncron = "61 * * * *"\nmissed = "skip"', "cron"),
        ('actor = "a"\ncron = "* * * *"\nmissed = "skip"', "cron"),
        ('actor = "a"\ncron = "0 6 31 2 *"\nmissed = "skip"', "cron"),
        ('actor = "a"\ncron = "* * * * *"', "missed"),
        ('actor = "a"\ncron = "* * * * *"\nmissed = "never"', "missed"),
        ('actor = "a"\ncron = "* * * * *"\nmissed = "skip"\ntimezone = "Nowhere/City"', "timezone"),
        ('actor = "a"\ncron = "* * * * *"\nmissed = "skip"\nmax_runtime_s = 0', "max_runtime_s"),
        ('actor = "a"\ncron = "* * * * *"\nmissed = "skip"\nsurprise = 1', "surprise"),
        ('actor = "a"\ncron = "* * * * *"\nmissed = "skip"\nargs = [1979-05-27]', "schedules.x"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_schedule_and_key(
    tmp_path: Path, table: str, key: str
) -> None:
    text = (ROOT / "pools.toml").read_text().split("\n# [schedules.<name>]")[0]
    path = tmp_path / "pools.toml"
    path.write_text(f"{text}\n\n[schedules.x]\n{table}\n")
    with pytest.raises(PoolsFileError) as error:
        load_pools(path)
    lines = str(error.value).splitlines()
    assert len(lines) == 1 and "schedules.x" in lines[0] and key in lines[0], lines


def test_actor_problems_name_the_schedule_and_key() -> None:
    def job(report: str, rows: int = 1) -> None: ...

    fits = inspect.signature(job)
    actors = {"job": ("reports", fits), "stray": ("nowhere", fits)}
    served = {"reports": "bulk"}.get
    problems = actor_problems(
        {
            "ok": schedule(args=["r"]),
            "unknown": schedule(actor="nope"),
            "orphan": schedule(actor="stray", args=["r"]),
            "misfit": schedule(kwargs={"colour": "red"}),
        },
        actors,
        served,
    )
    assert [line.split(":")[0] for line in problems] == [
        "schedules.unknown.actor",
        "schedules.orphan.actor",
        "schedules.misfit.args",
    ]


def test_six_fields_put_seconds_first_and_time_zones_follow_daylight_saving() -> None:
    assert [t - T0 for t in schedule(cron="*/15 * * * * *").ticks_before(T0 + 59, T0 - 1, 10)] == [
        0,
        15,
        30,
        45,
    ]
    paris = schedule(cron="30 6 * * *", timezone="Europe/Paris")
    winter, summer = paris.next_ticks(datetime(2027, 3, 27, tzinfo=UTC).timestamp(), 2)
    assert (winter.hour, winter.minute, summer.hour, summer.minute) == (6, 30, 6, 30)
    assert winter.utcoffset() != summer.utcoffset()


def test_latest_tick_and_counts() -> None:
    every = schedule()
    assert every.latest_tick(T0 + 0.9) == T0
    assert every.count_ticks(T0, T0 + 5) == 4
    assert every.ticks_before(T0 + 10, T0 + 5, 3) == [T0 + 8, T0 + 9, T0 + 10]


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


def round_at(
    client: redis.Redis, item: Schedule, times: list[float]
) -> tuple[list[list[tuple[int, str]]], Scheduler]:
    """Scheduler rounds of schedule ``s`` at the given instants (the scheduler leads)."""
    settings = SchedulerSettings(scheduler_leader_ttl_ms=2000)
    scheduler = Scheduler(settings, {"s": item}, {"s": Target("job", "q")}, client=client)
    client.set(leader_key(), scheduler.me)
    return [scheduler.fire_due("s", now) for now in times], scheduler


def test_skip_fires_only_the_latest_tick_after_downtime(client: redis.Redis) -> None:
    rounds, _ = round_at(client, schedule(), [T0 + 0.1, T0 + 1.1, T0 + 20.2])
    assert rounds == [[], [(T0 + 1, "fired")], [(T0 + 20, "fired")]]
    state = read_states(client, ["s"])["s"]
    assert state.runs["missed"] == 18 and state.runs["fired"] == 2
    assert client.llen("dramatiq:q") == 2


def test_skip_fires_nothing_when_even_the_latest_tick_is_too_late(client: redis.Redis) -> None:
    hourly = schedule(cron="0 * * * *")
    rounds, _ = round_at(client, hourly, [T0 - 1, T0 + 600])
    assert rounds == [[], []]
    assert read_states(client, ["s"])["s"].runs["missed"] == 1


def test_catch_up_enqueues_the_latest_limit_ticks_oldest_first(client: redis.Redis) -> None:
    rounds, _ = round_at(
        client, schedule(missed="catch_up", catch_up_limit=4), [T0 + 0.1, T0 + 10.5]
    )
    assert rounds[1] == [
        (T0 + 7, "caught_up"),
        (T0 + 8, "fired"),
        (T0 + 9, "fired"),
        (T0 + 10, "fired"),
    ]
    runs = read_states(client, ["s"])["s"].runs
    assert runs["missed"] == 6 and runs["caught_up"] == 1


def test_a_tick_is_claimed_once_and_never_without_the_leader_lock(client: redis.Redis) -> None:
    _, first = round_at(client, schedule(), [T0 + 0.1, T0 + 1.1])
    second = Scheduler(first.settings, first.schedules, first.targets, client=client)
    assert second.fire_due("s", T0 + 2.05) == []  # not the leader: the script refuses
    client.set(leader_key(), second.me)
    assert first.fire_due("s", T0 + 2.1) == []  # the old leader, fenced off
    assert second.fire_due("s", T0 + 2.2) == [(T0 + 2, "fired")]
    assert second.fire_due("s", T0 + 2.3) == []  # claimed: never twice
    assert client.llen("dramatiq:q") == 2


def test_a_tick_is_not_enqueued_while_the_previous_run_holds_its_lock(
    client: redis.Redis,
) -> None:
    client.set("dramatiq:schedules:s:lock", "previous-run")
    rounds, _ = round_at(client, schedule(), [T0 + 0.1, T0 + 1.1])
    assert rounds[1] == [(T0 + 1, "skipped_overlap")]
    assert client.llen("dramatiq:q") == 0
    assert read_states(client, ["s"])["s"].runs["skipped_overlap"] == 1


def test_example_toml_in_the_module_docstring_is_valid() -> None:
    from worker_runtime.scheduling import schedules

    doc = schedules.__doc__ or ""
    block = "\n".join(
        line.strip()
        for line in doc.split("[schedules.nightly_report]")[1].split("\n\n")[0].splitlines()
    )
    Schedule.model_validate(tomllib.loads(block))


BERLIN = "Europe/Berlin"
#: Europe/Berlin 2026: clocks go back at 01:00 UTC on October 25 (03:00 CEST -> 02:00 CET),
#: forward at 01:00 UTC on March 29 (02:00 CET -> 03:00 CEST).
CEST_2AM_OCT_25 = int(datetime(2026, 10, 25, 0, 0, tzinfo=UTC).timestamp())
CET_2AM_OCT_25 = CEST_2AM_OCT_25 + 3600
CEST_3AM_MAR_29 = int(datetime(2026, 3, 29, 1, 0, tzinfo=UTC).timestamp())


def local(ticks: list[int]) -> list[str]:
    return [datetime.fromtimestamp(t, ZoneInfo(BERLIN)).strftime("%d %H:%M %Z") for t in ticks]


def test_a_repeated_local_time_fires_once_by_default_and_twice_with_every() -> None:
    start = datetime(2026, 10, 24, 12, tzinfo=UTC).timestamp()
    nightly = schedule(cron="0 2 * * *", timezone=BERLIN)
    assert nightly.dst == "once"
    assert local(nightly.ticks_before(start + 3 * 86_400, start, 10)) == [
        "25 02:00 CEST",
        "26 02:00 CET",
        "27 02:00 CET",
    ]
    every = schedule(cron="0 2 * * *", timezone=BERLIN, dst="every")
    assert local(every.ticks_before(start + 3 * 86_400, start, 10)) == [
        "25 02:00 CEST",
        "25 02:00 CET",
        "26 02:00 CET",
        "27 02:00 CET",
    ]
    assert nightly.latest_tick(CET_2AM_OCT_25 + 60) == CEST_2AM_OCT_25
    assert every.latest_tick(CET_2AM_OCT_25 + 60) == CET_2AM_OCT_25
    assert nightly.count_ticks(CEST_2AM_OCT_25, CET_2AM_OCT_25 + 1) == 0
    hourly = schedule(cron="0 * * * *", timezone=BERLIN)
    around = list(itertools.islice(hourly.ticks_after(CEST_2AM_OCT_25 - 1), 3))
    assert local(around) == ["25 02:00 CEST", "25 03:00 CET", "25 04:00 CET"]  # two hours


@pytest.mark.parametrize("dst", ["once", "every"])
def test_a_skipped_local_time_fires_once_at_the_end_of_the_gap(dst: str) -> None:
    start = datetime(2026, 3, 28, 12, tzinfo=UTC).timestamp()
    for cron in ("0 2 * * *", "30 2 * * *"):
        item = schedule(cron=cron, timezone=BERLIN, dst=dst)
        minute = cron.split()[0].zfill(2)
        assert local(item.ticks_before(start + 3 * 86_400, start, 10)) == [
            "29 03:00 CEST",
            f"30 02:{minute} CEST",
            f"31 02:{minute} CEST",
        ]
    half_hourly = schedule(cron="*/30 * * * *", timezone=BERLIN, dst=dst)
    around = list(itertools.islice(half_hourly.ticks_after(CEST_3AM_MAR_29 - 1801), 3))
    assert local(around) == [
        "29 01:30 CET",
        "29 03:00 CEST",
        "29 03:30 CEST",
    ]


def test_a_bad_dst_value_is_refused() -> None:
    with pytest.raises(ValueError, match="dst"):
        schedule(dst="twice")


@pytest.mark.parametrize(("dst", "fired"), [("once", 1), ("every", 2)])
def test_the_scheduler_fires_the_fall_back_night_by_its_dst_setting(
    client: redis.Redis, dst: str, fired: int
) -> None:
    nightly = schedule(cron="0 2 * * *", timezone=BERLIN, dst=dst)
    times = [CEST_2AM_OCT_25 - 30, CEST_2AM_OCT_25 + 0.5, CET_2AM_OCT_25 + 0.5, CET_2AM_OCT_25 + 60]
    rounds, _ = round_at(client, nightly, times)
    expected = [[], [(CEST_2AM_OCT_25, "fired")], [(CET_2AM_OCT_25, "fired")], []]
    assert rounds == (expected if dst == "every" else [[], expected[1], [], []])
    runs = read_states(client, ["s"])["s"].runs
    assert runs["fired"] == fired and runs["missed"] == 0
    assert client.llen("dramatiq:q") == fired


def test_the_scheduler_fires_the_skipped_spring_hour_once_at_three(client: redis.Redis) -> None:
    nightly = schedule(cron="30 2 * * *", timezone=BERLIN)
    times = [CEST_3AM_MAR_29 - 30, CEST_3AM_MAR_29 + 0.5, CEST_3AM_MAR_29 + 1800.5]
    rounds, _ = round_at(client, nightly, times)
    assert rounds == [[], [(CEST_3AM_MAR_29, "fired")], []]
    assert client.llen("dramatiq:q") == 1
