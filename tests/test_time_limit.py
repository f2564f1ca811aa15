"""The job time limit, proved with real worker processes and a real redis-server.

``WORKER_JOB_TIMEOUT_MS`` interrupts every job, whatever its actor or message asks
for (an actor's ``time_limit`` may only lower it); an interrupted job is a failed
attempt, retried within ``WORKER_MAX_ATTEMPTS`` and then dead-lettered with the
reason "time limit".
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from _lifecycle import Jobs, Worker, jobs, lc_project, wait_for, workers

pytestmark = pytest.mark.slow
__all__ = ["jobs", "lc_project", "workers"]

LIMIT_S = 2.0
TIME_LIMIT = "time limit: the job ran past WORKER_JOB_TIMEOUT_MS"  # settlement.TIME_LIMIT_REASON
ATTEMPTS = 3
SETTINGS = {
    "WORKER_JOB_TIMEOUT_MS": str(int(LIMIT_S * 1000)),
    "WORKER_SHUTDOWN_TIMEOUT_MS": "3000",
    "WORKER_MAX_ATTEMPTS": str(ATTEMPTS),
}


def assert_cut_at_the_limit_then_dead_lettered(jobs: Jobs, job_id: str) -> None:
    # Each attempt lasts the limit plus a short backoff; a job left to run would take 10 s.
    budget = ATTEMPTS * (LIMIT_S + 3) + 10
    wait_for(jobs.dead_letters, budget, "the job to be dead-lettered")
    (dead,) = jobs.dead_letters()
    starts = [stamp for _, stamp in jobs.starts(job_id)]
    assert len(starts) == ATTEMPTS, f"{len(starts)} deliveries, expected {ATTEMPTS}"
    assert jobs.dones(job_id) == [], "an attempt ran to completion"
    assert "time limit" in dead.options["dead_letter_reason"]
    assert dead.options["retries"] == ATTEMPTS
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:], strict=False)]
    for gap in gaps:
        # interrupted at the limit (not at the end of the 10 s job), then retried at once
        assert LIMIT_S - 0.1 <= gap < LIMIT_S + 3, f"attempts started {gaps} s apart"
    time.sleep(LIMIT_S + 0.5)
    assert len(jobs.starts(job_id)) == ATTEMPTS, "a dead letter was delivered again"
    assert not jobs.queued() and not jobs.delayed() and not jobs.stranded()


def test_job_past_the_limit_is_interrupted_retried_then_dead_lettered(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    jobs.enqueue("lc_overrun", "slow", 10.0)
    workers(**SETTINGS)
    assert_cut_at_the_limit_then_dead_lettered(jobs, "slow")


def test_actor_declaring_a_larger_limit_is_cut_at_the_setting(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    jobs.enqueue("lc_overrun_declared", "declared", 10.0)
    workers(**SETTINGS)
    assert_cut_at_the_limit_then_dead_lettered(jobs, "declared")


def test_message_asking_for_a_larger_limit_is_cut_at_the_setting(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    jobs.enqueue("lc_overrun", "asked", 10.0, time_limit=600_000)
    workers(**SETTINGS)
    assert_cut_at_the_limit_then_dead_lettered(jobs, "asked")


def test_actor_may_lower_the_limit(workers: Callable[..., Worker], jobs: Jobs) -> None:
    jobs.enqueue("lc_overrun", "short", 10.0, time_limit=500)
    workers(**SETTINGS)
    assert_cut_or_not = wait_for(jobs.dead_letters, ATTEMPTS * 4 + 10, "the dead letter")
    assert assert_cut_or_not
    starts = [stamp for _, stamp in jobs.starts("short")]
    assert len(starts) == ATTEMPTS
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:], strict=False)]
    assert all(gap < LIMIT_S - 0.2 for gap in gaps), f"attempts started {gaps} s apart"


def time_limits(text: str, actor: str) -> float:
    """``jobs_time_limit_exceeded_total`` of ``actor`` in a /metrics text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("jobs_time_limit_exceeded_total{") and f'actor="{actor}"' in line)


def test_a_handler_that_swallows_the_time_limit_is_stopped_at_its_next_checkpoint(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    message = jobs.enqueue("lc_swallow", "swallow", 10.0)
    worker = workers(**SETTINGS)
    assert_cut_at_the_limit_then_dead_lettered(jobs, "swallow")
    assert len(jobs._entries("swallowed", "swallow")) == ATTEMPTS  # each swallowed the first
    wait_for(lambda: time_limits(worker.metrics(), "lc_swallow") == ATTEMPTS, 10, "counted")
    said = [r for r in worker.records() if r.get("msg") == "job ran past its time limit; "
            "interrupting it"]
    assert [r["job_id"] for r in said] == [message.message_id] * ATTEMPTS
    assert worker.stop() == 0


def test_a_handler_that_never_stops_is_abandoned_and_its_process_replaced_after_a_drain(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    """A bare ``except:`` around checkpoints, for ever: TimeLimitExceeded comes again at
    every checkpoint and every second, then the thread is given up: the process drains the
    job beside it, charges the stuck one as a time limit, exits and is replaced at once."""
    stuck = jobs.enqueue("lc_swallow", "stuck", 600.0, True, time_limit=1000)
    jobs.enqueue("lc_sleep", "neighbour", 8.0)  # still running when the thread is given up
    worker = workers(WORKER_MAX_ATTEMPTS="2")
    wait_for(jobs.dead_letters, 60, "the stuck job dead-lettered")
    (dead,) = jobs.dead_letters()
    assert dead.message_id == stuck.message_id
    assert dead.options["dead_letter_reason"].startswith(TIME_LIMIT)
    assert len(jobs.starts("stuck")) == 2 and jobs.dones("stuck") == []
    assert len(jobs.starts("neighbour")) == 1 and len(jobs.dones("neighbour")) == 1  # drained
    given_up = worker.records("time_limit_abandoned")
    assert [r["job_id"] for r in given_up] == [stuck.message_id] * 2
    replaced = wait_for(lambda: r if len(r := worker.records("process_replaced")) == 2 else [],
                        30, "the second process replaced")
    assert {r["exit_code"] for r in replaced} == {75}
    assert worker.records("process_died") == []  # not a crash
    wait_for(lambda: time_limits(worker.metrics(), "lc_swallow") == 2, 10, "counted")
    jobs.enqueue("lc_quick", "after")
    wait_for(lambda: jobs.dones("after"), 30, "a job on the replaced process")
    wait_for(lambda: not jobs.stranded(), 10, "its settlement")
    assert not jobs.queued() and not jobs.delayed()
    assert worker.stop() == 0


def test_a_handler_holding_the_interpreter_past_its_limit_is_killed_as_a_time_limit(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    """A catastrophic regular expression holds the interpreter lock: nothing in its process
    runs (no watchdog, no tick). The supervisor sees its deadline passed on the progress
    board and kills the process: a time limit, not a crash, and so says the dead letter."""
    held = jobs.enqueue("lc_regex", "regex", 32, time_limit=1000)
    worker = workers(WORKER_MAX_ATTEMPTS="2")
    wait_for(jobs.dead_letters, 60, "the regex job dead-lettered")
    (dead,) = jobs.dead_letters()
    assert dead.message_id == held.message_id
    assert dead.options["dead_letter_reason"].startswith(TIME_LIMIT)
    assert dead.options.get("crashes", 0) == 0 and dead.options["retries"] == 2
    assert len(jobs.starts("regex")) == 2 and jobs.dones("regex") == []
    killed = worker.records("time_limit_kill")
    assert len(killed) == 2 and all(r["past_limit_s"] < 10 for r in killed), killed
    wait_for(lambda: len(worker.records("time_limit_killed")) == 2, 30, "both processes buried")
    assert worker.records("process_died") == []
    wait_for(lambda: time_limits(worker.metrics(), "lc_regex") == 2, 10, "counted")
    assert worker.stop() == 0
