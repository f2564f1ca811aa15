"""``status`` and the console tell the truth about running jobs, processes and unserved work.

Real worker processes on a real redis-server, judged against the jobs' own start and end
stamps (each test actor records ``"<pid> <time>"`` in Redis when it starts and ends):

* 3 processes of 2 threads run 20 two-second jobs (and 2 that fail into a 4 s backoff):
  sampled all along through the console's ``/status.json`` (the same read as ``status``),
  each job is seen running, and a job shown as running had started and had not ended, for
  no longer than it ran; no
  process shows more running jobs than its threads; retries in backoff are delayed, never
  in flight.
* A process that drained (a reload) or died is gone from the list at once; one frozen
  (SIGSTOP) is shown stale with the age of its heartbeat, and serves no queue.
* A queue with waiting work and no live consumer is flagged in ``status``, its JSON, its
  ``--check`` (exit 1, listing it) and the console; ``checkpoint(progress, note)`` is shown
  with the running job; ``status`` into a closed pipe ends quietly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from _lifecycle import QUEUE, Jobs, Worker, bake_with_actors, get, wait_for, workers_of
from bakery import PYTHON, package_of, project_env, run_cli
from dramatiq import Message
from test_console import Console

pytestmark = pytest.mark.slow

TRUTH_ACTORS = '''\
"""Actors of the status tests: two-second jobs, a failing one with a long backoff, and a
long one that reports its progress."""

from __future__ import annotations

import dramatiq

from ..lifecycle import checkpoint
from .lc_test import _nap, _record


@dramatiq.actor(queue_name="notifications", max_retries=0, time_limit=600_000)
def truth_two(job_id: str) -> None:
    _record("start", job_id)
    _nap(2.0)
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", max_retries=1, min_backoff=4000, max_backoff=4000)
def truth_fail(job_id: str) -> None:
    _record("start", job_id)
    raise ValueError(f"job {job_id} failed")


@dramatiq.actor(queue_name="notifications", max_retries=0)
def truth_dead(job_id: str) -> None:
    raise ValueError(f"job {job_id} cannot run")


@dramatiq.actor(queue_name="notifications", max_retries=0, time_limit=600_000)
def truth_progress(job_id: str, pages: int) -> None:
    _record("start", job_id)
    for page in range(1, pages + 1):
        _nap(0.25)
        checkpoint(progress=page / pages, note=f"page {page} of {pages}")
    _record("done", job_id)
'''
#: Slack between a job's own stamp and what status saw: the reader's round trips and the
#: after-hooks between a handler's end stamp and its settlement (ms on a quiet machine).
SLACK_S = 0.5


@pytest.fixture(scope="module")
def project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bake_with_actors(bake, tmp_path_factory, "truth", truth=TRUTH_ACTORS)


@pytest.fixture
def workers(project: Path, redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    yield from workers_of(project, redis_url, tmp_path)


@pytest.fixture
def console(project: Path, redis_url: str, tmp_path: Path) -> Iterator[Console]:
    made = Console(project, redis_url, tmp_path / "console")
    yield made
    made.stop()


def snapshot(console: Console) -> dict[str, Any]:
    code, body = get(console.url + "/status.json")
    assert code == 200, body
    found: dict[str, Any] = json.loads(body)
    return found


def status(project: Path, redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = project_env(project, REDIS_URL=redis_url, WORKER_STATE_DIR="/nonexistent")
    return run_cli(project, "status", *args, env=env)


def queue_row(found: dict[str, Any], queue: str = QUEUE) -> dict[str, Any]:
    return next(q for q in found["queues"] if q["queue"] == queue)


def live(found: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in found["processes"] if not (p["silent"] or p["stale"])]


def test_a_job_is_running_only_between_its_own_start_and_end(
        project: Path, redis_url: str, workers: Any, console: Console) -> None:
    jobs = Jobs(redis_url)
    worker = workers(WORKER_PROCESSES="3", WORKER_CONCURRENCY="2")
    wait_for(lambda: len(worker.children()) == 3, 30, "3 worker processes")
    wait_for(lambda: len(live(snapshot(console))) == 3, 30, "3 live processes in status")
    failing = {jobs.enqueue("truth_fail", f"f{i}").message_id: f"f{i}" for i in range(2)}
    ids = {jobs.enqueue("truth_two", f"t{i}").message_id: f"t{i}" for i in range(20)}
    samples = []
    deadline = time.monotonic() + 90
    while sum(bool(jobs.dones(job)) for job in ids.values()) < 20:
        assert time.monotonic() < deadline, "the 20 jobs did not end in 90 s"
        samples.append(snapshot(console))
        time.sleep(0.05)
    samples.append(snapshot(console))
    wait_for(lambda: all(len(jobs.starts(job)) == 2 for job in failing.values()), 30,
             "each failing job's retry")

    shown = 0
    seen: set[str] = set()
    delayed_seen = 0
    for sample in samples:
        now = sample["now_ms"] / 1000
        row = queue_row(sample)
        for process in sample["processes"]:
            assert len(process["jobs"]) <= process["concurrency"] == 2, process
            assert process["held"] == len(process["jobs"]) + process["prefetched"], process
            for job in process["jobs"]:
                assert job["message_id"] not in failing or job["running_s"] < 1, job
                if job["message_id"] not in ids:
                    continue
                job_id = ids[job["message_id"]]
                seen.add(job_id)
                [(pid, start)] = jobs.starts(job_id)
                [(_, end)] = jobs.dones(job_id)
                shown += 1
                assert pid == process["pid"], (job, pid)
                assert start - SLACK_S <= now <= end + SLACK_S, (
                    f"{job_id} shown running at {now:.3f}, ran {start:.3f}..{end:.3f}")
                assert job["running_s"] <= end - start + SLACK_S, job
        in_hand = sum(p["held"] for p in sample["processes"])
        assert row["inflight"] == in_hand, (row, sample["processes"])
        delayed_seen = max(delayed_seen, row["delayed"])
    # Each two-second job was seen running: its process publishes a job that starts within
    # half a second, not at its next heartbeat (5 s by default).
    assert seen == set(ids.values()), f"never seen running: {set(ids.values()) - seen}"
    assert delayed_seen == 2, "the 2 retries in their backoff were never shown as delayed"

    # status reads the same: what it prints now is the console's snapshot's shape, at rest.
    done = status(project, redis_url, "--json")
    assert done.returncode == 0, done.stderr
    at_rest = json.loads(done.stdout)
    assert sorted(at_rest) == sorted(samples[-1])
    assert all(not p["jobs"] and p["held"] == 0 for p in at_rest["processes"]), at_rest
    text = status(project, redis_url).stdout
    assert "3 live processes, 0 running jobs" in text, text


def beat_every_s(redis_url: str, pid: int) -> float:
    """How often the worker process ``pid`` beats, as its record in Redis says."""
    client = redis.Redis.from_url(redis_url)
    try:
        for key in client.scan_iter("dramatiq:__process__.*"):
            record = json.loads(client.get(key) or "{}")
            if record.get("pid") == pid:
                return float(record["beat_every_ms"]) / 1000
    finally:
        client.close()
    raise AssertionError(f"no process record of {pid}")


def test_a_process_that_exits_is_gone_at_once_and_a_frozen_one_is_stale(
        project: Path, redis_url: str, workers: Any, console: Console) -> None:
    reloaded = workers(WORKER_PROCESSES="2", WORKER_CONCURRENCY="1")
    frozen = workers(WORKER_PROCESSES="1", WORKER_CONCURRENCY="1",
                     WORKER_HEARTBEAT_TIMEOUT_MS="20000")
    wait_for(lambda: len(reloaded.children()) == 2 and len(frozen.children()) == 1, 30,
             "3 worker processes")
    wait_for(lambda: len(live(snapshot(console))) == 3, 30, "3 live processes in status")

    # A reload: the supervisor drains its processes and exits; both are gone at once.
    old = set(reloaded.children())
    assert reloaded.stop(timeout=30) == 0
    after = snapshot(console)
    assert not old & {p["pid"] for p in after["processes"]}, after["processes"]

    # A process that died: its supervisor replaces it, and only the new one is listed.
    survivor = workers(WORKER_PROCESSES="2", WORKER_CONCURRENCY="1")
    wait_for(lambda: len(live(snapshot(console))) == 3, 30, "3 live processes again")
    victim = survivor.children()[0]
    beat_s = beat_every_s(redis_url, victim)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: victim not in {p["pid"] for p in snapshot(console)["processes"]}, 10,
             "the killed process gone from the list")
    gone_s = time.monotonic() - killed_at
    assert gone_s < beat_s, f"gone {gone_s:.2f} s after the kill: more than a beat ({beat_s} s)"
    # The supervisor logs the death after recovering its messages and removing its record.
    wait_for(lambda: survivor.records("process_died"), 10, "its supervisor's line of the death")
    wait_for(lambda: len(live(snapshot(console))) == 3, 30, "its replacement listed")

    # A frozen process: stale (3 of its 4 s beat intervals and a second), with its age.
    [stopped] = frozen.children()
    os.kill(stopped, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        found = wait_for(lambda: (s := snapshot(console)) and any(
            p["pid"] == stopped and p["stale"] for p in s["processes"]) and s, 30,
            "the frozen process to show stale")
        assert time.monotonic() - stopped_at > 12
        [row] = [p for p in found["processes"] if p["pid"] == stopped]
        assert 13 <= row["heartbeat_age_s"] < 20, row
        assert queue_row(found)["consumers"] == len(live(found)), found
        table = status(project, redis_url).stdout
        assert "ago (stale)" in table and ", 1 stale" in table, table
        page = get(console.url + "/")[1]
        assert "ago (stale)" in page
    finally:
        os.kill(stopped, signal.SIGCONT)


def test_work_no_live_process_serves_is_flagged(
        project: Path, redis_url: str, workers: Any, console: Console) -> None:
    jobs = Jobs(redis_url)
    worker = workers(WORKER_PROCESSES="1", WORKER_CONCURRENCY="1")
    wait_for(lambda: worker.children() and live(snapshot(console)), 30, "a live process")
    for index in range(3):
        jobs.broker.enqueue(Message(queue_name="partner", actor_name="truth_two",
                                    args=(f"p{index}",), kwargs={}, options={}))

    found = snapshot(console)
    partner = queue_row(found, "partner")
    assert (partner["pool"], partner["consumers"], partner["waiting"]) == ("external", 0, 3)
    assert partner["unserved"] is True, partner
    served = queue_row(found)
    assert (served["pool"], served["consumers"], served["unserved"]) == (
        "interactive", 1, False)
    assert not [q for q in found["queues"] if q["unserved"] and q["queue"] != "partner"]

    checked = status(project, redis_url, "--check")
    assert checked.returncode == 1, checked
    [line] = checked.stdout.splitlines()
    assert line.startswith("unserved: queue partner (pool external): 3 waiting (oldest due ")
    assert line.endswith("), and no live process serves it"), line
    table = status(project, redis_url).stdout
    assert "UNSERVED" in table and "unserved: queue partner (pool external)" in table, table
    page = get(console.url + "/")[1]
    assert "Unserved: queue partner (pool external): 3 waiting" in page
    # The flow state read with it: the downstream budgets, and a queue paused by `pause`.
    assert "Downstream budgets" in page and "partner_api" in page
    env = project_env(project, REDIS_URL=redis_url, WORKER_STATE_DIR="/nonexistent")
    assert run_cli(project, "pause", "reports", env=env).returncode == 0
    assert 'reports <strong class="note">paused</strong>' in get(console.url + "/")[1]

    external = workers(WORKER_POOL="external", WORKER_PROCESSES="1", WORKER_CONCURRENCY="1")
    wait_for(lambda: external.children() and not queue_row(snapshot(console), "partner")[
        "unserved"], 30, "the partner queue served")
    checked = status(project, redis_url, "--check")
    assert checked.returncode == 0, checked
    assert checked.stdout.strip() == "every queue with work has a live process serving it"


def test_delayed_work_due_that_no_process_serves_is_flagged(
        project: Path, redis_url: str, console: Console) -> None:
    """Nothing waits on ``reports``, but a delayed job there is due and no process runs to
    move it: flagged all the same (status, its --check, the console, the same rule)."""
    jobs = Jobs(redis_url)
    jobs.broker.enqueue(Message(queue_name="reports", actor_name="truth_two", args=("d",),
                                kwargs={}, options={}), delay=500)
    row = wait_for(lambda: (r := queue_row(snapshot(console), "reports"))["unserved"] and r,
                   10, "the due delayed job flagged")
    assert (row["waiting"], row["delayed"], row["consumers"]) == (0, 1, 0), row
    checked = status(project, redis_url, "--check")
    assert checked.returncode == 1, checked
    [line] = checked.stdout.splitlines()
    assert line.startswith("unserved: queue reports (pool ") and " delayed work due " in line
    assert "Unserved: queue reports (pool " in get(console.url + "/")[1]


def test_a_handler_progress_and_note_show_with_its_running_job(
        project: Path, redis_url: str, workers: Any, console: Console) -> None:
    jobs = Jobs(redis_url)
    worker = workers(WORKER_CONCURRENCY="1", WORKER_HEARTBEAT_TIMEOUT_MS="5000")
    wait_for(lambda: worker.children() and live(snapshot(console)), 30, "a live process")
    jobs.enqueue("truth_progress", "long", 30)

    def reported() -> Any:
        running = [job for p in snapshot(console)["processes"] for job in p["jobs"]]
        return running and running[0]["progress"] and running[0]

    job = wait_for(reported, 20, "the job's progress in status")
    assert job["actor"] == "truth_progress", job
    assert 0 < job["progress"] < 1, job
    page = int(job["note"].split()[1])
    assert job["note"] == f"page {page} of 30" and abs(job["progress"] - page / 30) < 1e-3
    table = status(project, redis_url).stdout
    assert "truth_progress" in table and "% page " in table and " of 30" in table, table
    body = get(console.url + "/")[1]
    assert "<progress" in body and " of 30" in body


def test_status_into_a_closed_pipe_ends_quietly(project: Path, redis_url: str) -> None:
    read, write = os.pipe()
    os.close(read)
    env = project_env(project, REDIS_URL=redis_url, WORKER_STATE_DIR="/nonexistent")
    done = subprocess.run([PYTHON, "-m", package_of(project), "status"], cwd=project, env=env,
                          stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
                          check=False)
    os.close(write)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_dlq_show_takes_the_job_id_a_log_line_prints(
        project: Path, redis_url: str, workers: Any) -> None:
    """The id an operator copies from the worker's log line of a job that died is enough
    for ``dlq show`` and ``dlq replay`` (the dead letter is kept under another, Redis, id)."""
    jobs = Jobs(redis_url)
    worker = workers(WORKER_CONCURRENCY="1")
    wait_for(lambda: worker.children(), 30, "a worker process")
    jobs.enqueue("truth_dead", "gone")

    def died() -> list[dict[str, Any]]:
        return [r for r in worker.records("job_end")
                if r.get("actor") == "truth_dead" and r.get("outcome") == "dead_letter"]

    [line] = wait_for(died, 30, "the job's dead-letter log line")
    client = redis.Redis.from_url(redis_url)
    [redis_id] = client.zrange("dramatiq:notifications.XQ", 0, -1)
    assert line["job_id"] != redis_id.decode(), "the log prints another id than Redis keeps"
    env = project_env(project, REDIS_URL=redis_url, WORKER_STATE_DIR="/nonexistent")
    shown = run_cli(project, "dlq", "show", line["job_id"], "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    found = json.loads(shown.stdout)
    assert found["redis_id"] == redis_id.decode(), found
    assert (found["message"]["message_id"], found["message"]["actor_name"]) == (
        line["job_id"], "truth_dead"), found
    assert found["reason"].startswith("ValueError: job gone cannot run"), found
    replayed = run_cli(project, "dlq", "replay", line["job_id"], env=env)
    assert replayed.returncode == 0 and replayed.stdout.strip() == "replayed 1 dead letter"
    wait_for(lambda: len(died()) == 2, 30, "the replayed job to run (and die) again")
    assert {r["job_id"] for r in died()} == {line["job_id"]}, "the same job id, run again"
