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
