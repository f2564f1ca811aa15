"""ScheduleLock on a StubBroker carrying a real Redis client (the lock is Lua): a scheduled
run holds its schedule's lock while it runs, a run that overlaps is skipped and counted,
a redelivery takes its own lock over, the lease is renewed while the run goes on."""

from __future__ import annotations

import logging
from typing import Any

import dramatiq
import pytest
import redis
from prometheus_client import REGISTRY

from worker_runtime.layout import schedule_lock_key, schedule_state_key, text
from worker_runtime.middleware import Metrics
from worker_runtime.middleware.schedule_lock import ScheduleLock
from worker_runtime.scheduling.schedules import OPTION_LEASE_MS, OPTION_SCHEDULE
from worker_runtime.settlement import SKIPPED_OPTION

from stub_brokers import RedisStubBroker, work_off

LEASE_MS = 60_000


def scheduled(schedule: str) -> dict[str, Any]:
    """The options the scheduler gives a run of ``schedule``."""
    return {OPTION_SCHEDULE: schedule, OPTION_LEASE_MS: LEASE_MS}


def state(client: redis.Redis, schedule: str) -> dict[str, str]:
    return {text(k): text(v) for k, v in client.hgetall(schedule_state_key(schedule)).items()}


def test_a_run_holds_its_schedules_lock_while_it_runs(client: redis.Redis) -> None:
    broker = RedisStubBroker([ScheduleLock()], client)
    held: list[tuple[bytes | str | None, int]] = []
    key = schedule_lock_key("nightly")

    @dramatiq.actor(broker=broker)
    def job() -> None:
        held.append((client.get(key), client.pttl(key)))

    sent = job.send_with_options(**scheduled("nightly"))
    work_off(broker, job.queue_name)
    assert held == [(sent.message_id.encode(), held[0][1])]
    assert 0 < held[0][1] <= LEASE_MS, "the lock has the schedule's lease"
    assert client.get(key) is None, "released when the run ends"
    assert float(state(client, "nightly")["success_at"]) > 0


def test_a_failed_run_releases_the_lock_without_a_success(client: redis.Redis) -> None:
    broker = RedisStubBroker([ScheduleLock()], client)

    @dramatiq.actor(broker=broker)
    def job() -> None:
        raise ValueError("boom")

    job.send_with_options(**scheduled("hourly"))
    work_off(broker, job.queue_name)
    assert client.get(schedule_lock_key("hourly")) is None
    assert "success_at" not in state(client, "hourly")


def test_a_run_that_overlaps_the_previous_one_is_skipped_and_counted(
    client: redis.Redis,
) -> None:
    lock, metrics = ScheduleLock(), Metrics(1, database=False)
    broker = RedisStubBroker([lock, metrics], client)  # ScheduleLock first, as in broker.py
    ran: list[str] = []
    skipped: list[bool] = []

    class Spy(dramatiq.Middleware):
        def after_skip_message(self, broker: dramatiq.Broker, message: object) -> None:
            skipped.append(bool(message.options.get(SKIPPED_OPTION)))  # type: ignore[attr-defined]

    broker.add_middleware(Spy())

    @dramatiq.actor(broker=broker, queue_name="overlapping")
    def report() -> None:
        ran.append("ran")

    client.set(schedule_lock_key("daily"), "the-previous-run", px=LEASE_MS)
    labels = {"queue": "overlapping", "actor": "report", "outcome": "skipped"}
    before = REGISTRY.get_sample_value("jobs_processed_total", labels) or 0.0
    report.send_with_options(**scheduled("daily"))
    work_off(broker, "overlapping")
    assert ran == [], "the overlapping run did not start"
    assert skipped == [True]
    assert broker.dead_letters == [], "skipped, not failed"
    assert state(client, "daily")["runs:skipped_overlap"] == "1"
    assert client.get(schedule_lock_key("daily")) == b"the-previous-run", "not taken over"
    assert REGISTRY.get_sample_value("jobs_processed_total", labels) == before + 1


def test_a_redelivery_takes_its_own_lock_over(client: redis.Redis) -> None:
    broker = RedisStubBroker([ScheduleLock()], client)
    ran: list[str] = []

    @dramatiq.actor(broker=broker)
    def job() -> None:
        ran.append("ran")

    message = job.message_with_options(**scheduled("weekly"))
    client.set(schedule_lock_key("weekly"), message.message_id, px=LEASE_MS)  # its worker died
    broker.enqueue(message)
    work_off(broker, job.queue_name)
    assert ran == ["ran"]
    assert client.get(schedule_lock_key("weekly")) is None


def test_renewal_extends_every_held_lease_and_reports_a_lost_lock_once(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    lock = ScheduleLock(renew_floor_s=0.1)
    lock._held = {"m-1": ("kept", LEASE_MS), "m-2": ("lost", 3_000)}
    client.set(schedule_lock_key("kept"), "m-1", px=1_000)
    client.set(schedule_lock_key("lost"), "another-run", px=LEASE_MS)
    lapsed: set[str] = set()

    with caplog.at_level(logging.ERROR):
        pause = lock._renew_round(client, lapsed)
        lock._renew_round(client, lapsed)

    assert client.pttl(schedule_lock_key("kept")) > 1_000, "the lease is extended"
    assert pause == 1.0, "every third of the shortest lease"
    lost = [r for r in caplog.records if getattr(r, "event", None) == "schedule_lock_lost"]
    assert len(lost) == 1, "a lost lock is reported once"
    assert lapsed == {"m-2"}
    lock._held = {}
    assert lock._renew_round(client, lapsed) is None, "nothing held: the thread waits"
    assert lapsed == set()
