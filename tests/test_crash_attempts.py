"""Crash-safe delivery: messages of a killed worker come back; a poison one ends dead-lettered.

A worker killed outright (SIGKILL to the supervisor and its processes) leaves its
messages in its acks sets; another worker recovers them once the heartbeat is
older than ``WORKER_HEARTBEAT_TIMEOUT_MS``. A message that kills its worker
process is redelivered until ``WORKER_MAX_ATTEMPTS`` deliveries, then
dead-lettered with the reason, while the other messages keep flowing.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import dramatiq
import pytest
from _lifecycle import QUEUE, Jobs, Worker, jobs, lc_project, wait_for, workers

pytestmark = pytest.mark.slow
__all__ = ["jobs", "lc_project", "workers"]
HEARTBEAT_TIMEOUT_MS = 3000


def test_sigkilled_worker_messages_are_delivered_again_to_another_worker(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    env = {"WORKER_HEARTBEAT_TIMEOUT_MS": str(HEARTBEAT_TIMEOUT_MS), "WORKER_PROCESSES": "2",
           "WORKER_CONCURRENCY": "2"}
    ids = jobs.many("lc_sleep", 8, 2.5)
    first = workers(**env)
    wait_for(lambda: jobs.started_count() == 4, 20, "four jobs to start")
    # A message due in 6 s, sent once the worker runs (a boot slower than 6 s under load
    # would release it before the kill): the worker takes it off the delay list into the
    # due set, and holds no delayed message.
    delayed = jobs.broker.enqueue(dramatiq.Message(
        queue_name=QUEUE, actor_name="lc_quick", args=("later",), kwargs={}, options={}),
        delay=6000)
    wait_for(lambda: not jobs.client.llen(f"dramatiq:{QUEUE}.DQ"), 5,
             "the delayed message to be taken into the due set")
    held = set(jobs.stranded())
    assert held and not any(key.endswith(".DQ") for key in held), held
    in_flight = [job_id for job_id in ids if jobs.starts(job_id) and not jobs.dones(job_id)]
    assert in_flight, "jobs in flight at the kill"
    killed = first.signal(signal.SIGKILL, group=True)
    first.wait(timeout=10)

    workers(**env)
    limit = HEARTBEAT_TIMEOUT_MS / 1000 + 15
    wait_for(lambda: all(len(jobs.starts(job_id)) == 2 for job_id in in_flight), limit,
             "the killed worker's jobs to start again")
    assert time.monotonic() - killed <= limit
    wait_for(lambda: jobs.done_count() == 9, 30, "every job to complete")
    for job_id in [*ids, "later"]:
        assert len(jobs.dones(job_id)) == 1, job_id
    assert jobs.dones("later")[0][1] >= delayed.options["eta"] / 1000 - 0.1, "not run early"
    assert not set(jobs.stranded()) & held, "the dead worker's acks sets were emptied"
    assert not jobs.dead_letters()


@pytest.mark.parametrize("max_attempts", [3])
def test_poison_job_is_dead_lettered_after_max_attempts_while_others_complete(
        workers: Callable[..., Worker], jobs: Jobs, max_attempts: int) -> None:
    # The poison job starts beside healthy ones, so its first crash takes them down too.
    healthy = [f"h{index}" for index in range(50)]
    for job_id in healthy[:3]:
        jobs.enqueue("lc_sleep", job_id, 0.3)
    poison = jobs.enqueue("lc_poison", "poison")
    for job_id in healthy[3:]:
        jobs.enqueue("lc_sleep", job_id, 0.3)
    worker = workers(WORKER_MAX_ATTEMPTS=str(max_attempts), WORKER_PROCESSES="2")

    wait_for(lambda: jobs.dead_letters(), 30, "the poison job to be dead-lettered")
    wait_for(lambda: jobs.done_count() == 50, 30, "the healthy jobs to complete")
    time.sleep(0.5)
    assert len(jobs.starts("poison")) == max_attempts, "delivered exactly max_attempts times"
    (dead,) = jobs.dead_letters()
    assert dead.message_id == poison.message_id
    reason = dead.options.get("dead_letter_reason", "")
    assert "died" in reason and f"WORKER_MAX_ATTEMPTS={max_attempts}" in reason, reason
    assert jobs.client.zcard("dramatiq:notifications.XQ") == 1
    # A bystander whose run ended just before the poison killed its process is run again
    # (at least once): that rerun may still be going; nothing may stay queued or held after.
    wait_for(lambda: not jobs.queued_ids() and not jobs.stranded(), 20,
             "every rerun to end")
    held = {key: [(m, jobs.client.hget(f"dramatiq:{QUEUE}.msgs", m)) for m in
                  jobs.client.smembers(key)] for key in jobs.stranded()}
    heartbeats = jobs.client.zrange("dramatiq:__heartbeats__", 0, -1, withscores=True)
    assert not jobs.queued_ids() and not held, (held, heartbeats, time.time())
    for job_id in healthy:
        assert jobs.dones(job_id), job_id
    bystanders = [job_id for job_id in healthy if len(jobs.starts(job_id)) > 1]
    assert bystanders, "some healthy jobs were running when the poison job crashed"
    assert worker.process is not None and worker.process.poll() is None, "the pool runs on"

    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=10) == 0


def test_term_while_a_dead_child_awaits_replacement_exits_zero(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    ids = jobs.many("lc_long", 4, 30.0)
    worker = workers()
    wait_for(lambda: jobs.started_count() == 4, 20, "four jobs to start")
    (child,) = worker.children()
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: "replacing it" in worker.log(), 5, "the supervisor to bury the child")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=10) == 0, worker.log()
    assert jobs.assert_exactly_once_or_queued(ids) == (0, 4)
    assert all(message.options.get("crashes") == 1 for message in jobs.queued())


def test_child_killed_during_the_drain_has_its_messages_recovered_at_once(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    ids = jobs.many("lc_long", 4, 30.0)
    worker = workers()
    wait_for(lambda: jobs.started_count() == 4, 20, "four jobs to start")
    (child,) = worker.children()
    worker.signal(signal.SIGTERM)
    time.sleep(0.5)
    os.kill(child, signal.SIGKILL)
    assert worker.wait(timeout=5) == 1, "a child that did not drain is reported"
    assert jobs.assert_exactly_once_or_queued(ids) == (0, 4)
    assert all(message.options.get("crashes") == 1 for message in jobs.queued())
