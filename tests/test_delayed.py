"""Delayed work (``send_with_options(delay=...)``, retries with backoff) with real worker
processes and a real Redis: nothing delayed runs twice when its worker freezes or dies,
a due message never waits behind later ones, and a worker holds no delayed body.

Dramatiq's delay consumer fetched the delay queue in list order (a thousand per thread),
held each body in memory until due, then enqueued a copy before acking the original: a
worker frozen past its heartbeat, or killed between the two, ran the message twice, a due
message waited behind the prefetched later ones, and large delayed bodies filled the
process. The worker now moves each due message in one Lua step, ordered by due time in
Redis (``layout.MOVE_DUE``), and holds none.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import dramatiq
import pytest
from _lifecycle import (
    NS,
    QUEUE,
    Jobs,
    Worker,
    jobs,
    make_test_project,
    started,
    wait_for,
    wait_ready,
)
from bakery import project_env, run_cli
from worker_runtime import accounting

pytestmark = pytest.mark.slow
__all__ = ["jobs"]
HEARTBEAT_TIMEOUT_MS = 3000

DELAY_ACTORS = '''\
"""Actors of the delayed-work tests: a retried one, and a hook that kills its worker once."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import dramatiq
import redis

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


def _record(kind: str, job_id: str) -> None:
    _client.rpush(f"test:{kind}:{job_id}", f"{os.getpid()} {time.time()}")


@dramatiq.actor(queue_name="notifications", min_backoff=500, max_backoff=1000)
def dl_flaky(job_id: str) -> None:
    """Fails its first delivery: its retry goes through the delay queue."""
    _record("start", job_id)
    if _client.incr(f"test:attempt:{job_id}") == 1:
        raise RuntimeError("first delivery fails")
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications")
def dl_big(job_id: str, payload: str) -> None:
    _record("start", job_id)
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", max_retries=0, time_limit=600_000)
def dl_hog(job_id: str, seconds: float) -> None:
    """Holds the interpreter lock for ``seconds`` (as a long C call, a regex that
    backtracks, does): every other thread of its process, the heartbeat's too, stops.
    Only its first delivery does: the copy another worker recovers ends at once (else each
    copy freezes the worker that runs it, the other recovers it again, and no run ends)."""
    _record("start", job_id)
    if _client.incr(f"test:hogged:{job_id}") > 1:
        _record("done", job_id)
        return
    sys.setswitchinterval(seconds + 5)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pass
    finally:
        sys.setswitchinterval(0.005)
    _record("done", job_id)


class KillOnce(dramatiq.Middleware):
    """SIGKILLs its worker process the first time the message of job ``kill-me`` is seen on
    its queue after its delay: Dramatiq's move enqueued its copy then (and had not acked
    the delayed original yet); the worker's own move has put it on the queue."""

    def _maybe_kill(self, message: Any) -> None:
        if message.queue_name != "notifications" or list(message.args[:1]) != ["kill-me"]:
            return
        if _client.set("test:killed", os.getpid(), nx=True):
            os.kill(os.getpid(), signal.SIGKILL)

    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self._maybe_kill(message)

    def before_process_message(self, broker: Any, message: Any) -> None:
        self._maybe_kill(message)


if os.environ.get("TEST_KILL_ONCE"):
    dramatiq.get_broker().add_middleware(KillOnce())
'''


@pytest.fixture(scope="module")
def dl_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = bake(database="none")
    return make_test_project(base, tmp_path_factory.mktemp("dl") / base.name, dl_test=DELAY_ACTORS)


@pytest.fixture
def workers(dl_project: Path, redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    count = iter(range(1_000))
    yield from started(
        lambda **env: Worker(dl_project, redis_url, tmp_path / f"w{next(count)}", **env))


def send(jobs: Jobs, actor: str, *args: object, delay_ms: int) -> dramatiq.Message[object]:
    """Enqueue as a bare Dramatiq producer does (it wakes no worker: they poll)."""
    message: dramatiq.Message[object] = dramatiq.Message(
        queue_name=QUEUE, actor_name=actor, args=args, kwargs={}, options={})
    return jobs.broker.enqueue(message, delay=delay_ms)


def held_delayed(jobs: Jobs) -> int:
    """Delayed messages held in some worker's acks set."""
    return sum(size for key, size in jobs.stranded().items() if key.endswith(".DQ"))


def gauge(text: str, name: str, queue: str) -> float:
    found = re.search(rf'^{name}{{[^}}]*queue="{re.escape(queue)}"[^}}]*}} (\S+)$', text, re.MULTILINE)
    assert found, f"no {name}{{queue={queue!r}}} in /metrics"
    return float(found.group(1))


#: The short heartbeat timeout of the freeze tests' workers.
FREEZE_ENV = {"WORKER_HEARTBEAT_TIMEOUT_MS": str(HEARTBEAT_TIMEOUT_MS)}


def worker_with_ten_delayed(workers: Callable[..., Worker], jobs: Jobs, prefix: str,
                            delay_ms: int) -> tuple[Worker, list[str]]:
    """A worker (heartbeat timeout :data:`HEARTBEAT_TIMEOUT_MS`) that has taken ten messages
    delayed ``delay_ms`` off the delay list (Dramatiq's consumer held them in memory)."""
    first = workers(**FREEZE_ENV)
    wait_ready(jobs)
    ids = [f"{prefix}{index}" for index in range(10)]
    for job_id in ids:
        send(jobs, "lc_quick", job_id, delay_ms=delay_ms)
    wait_for(lambda: not jobs.delayed(), 10, "the worker to take the delay list")
    return first, ids


def test_a_worker_frozen_past_its_heartbeat_runs_no_delayed_message_twice(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    first, ids = worker_with_ten_delayed(workers, jobs, "d", 12_000)
    beats = {raw.decode() for raw in jobs.client.zrange(f"{NS}:__heartbeats__", 0, -1)}
    first.signal(signal.SIGSTOP, group=True)
    try:
        workers(**FREEZE_ENV)
        # The second worker's recovery judges the frozen one dead and forgets it.
        wait_for(lambda: not beats & {raw.decode() for raw in
                                      jobs.client.zrange(f"{NS}:__heartbeats__", 0, -1)},
                 HEARTBEAT_TIMEOUT_MS / 1000 + 10, "the frozen worker to be recovered")
    finally:
        first.signal(signal.SIGCONT, group=True)
    wait_for(lambda: all(jobs.dones(job_id) for job_id in ids), 30, "every delayed job")
    time.sleep(3)  # a second run would come now: both workers ran their delay steps since
    assert [len(jobs.starts(job_id)) for job_id in ids] == [1] * 10
    assert [len(jobs.dones(job_id)) for job_id in ids] == [1] * 10
    assert not held_delayed(jobs)


def test_a_handler_holding_the_interpreter_lock_past_the_heartbeat_runs_no_delayed_message_twice(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    first, ids = worker_with_ten_delayed(workers, jobs, "g", 6_000)
    jobs.enqueue("dl_hog", "hog", 9.0)
    wait_for(lambda: jobs.starts("hog"), 10, "the hog to start")
    second = workers(**FREEZE_ENV)  # recovers the first one's messages while its heartbeat is frozen
    wait_for(lambda: all(jobs.dones(job_id) for job_id in ids), 40, "every delayed job")
    wait_for(lambda: jobs.dones("hog"), 40, "the hog's recovered copy to end")
    time.sleep(3)  # a second run of a delayed job would come now
    assert [len(jobs.dones(job_id)) for job_id in ids] == [1] * 10
    assert "recovered the messages of a dead worker" in second.log(), "the hog froze nothing"
    assert not held_delayed(jobs) and first.process is not None


def test_a_resumed_worker_that_fetches_its_recovered_messages_again_runs_each_once(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    """Frozen past its heartbeat with one job running and four prefetched, a worker is
    recovered while no other worker runs (this test recovers it), resumes and fetches the
    requeued copies itself: the copy still in its memory and the fetched one are one
    message (the hold check found the id held again and both ran, 5 ms apart)."""
    worker = workers(WORKER_CONCURRENCY="1", WORKER_PREFETCH="5", **FREEZE_ENV)
    wait_ready(jobs)
    jobs.enqueue("lc_sleep", "long", 2.0)
    wait_for(lambda: jobs.starts("long"), 10, "the long job to start")
    ids = [f"p{index}" for index in range(4)]
    for job_id in ids:
        jobs.enqueue("lc_quick", job_id)
    wait_for(lambda: not jobs.queued(), 10, "the worker to prefetch the four")
    worker.signal(signal.SIGSTOP, group=True)
    try:
        time.sleep(HEARTBEAT_TIMEOUT_MS / 1000 + 1)
        requeued, dead = accounting.recover_dead_workers(
            jobs.client, [QUEUE], HEARTBEAT_TIMEOUT_MS, max_attempts=5)
        assert (requeued, dead) == (5, 0)
    finally:
        worker.signal(signal.SIGCONT, group=True)
    wait_for(lambda: all(jobs.dones(job_id) for job_id in [*ids, "long"]), 30, "every job")
    time.sleep(3)  # a second run would come now
    assert [len(jobs.starts(job_id)) for job_id in ids] == [1] * 4, worker.log()[-3000:]
    # The long job ran on while frozen: stopped when seen no longer held (it runs again
    # from its requeued copy), or, when its end came first, logged lost and run again.
    assert 1 <= len(jobs.dones("long")) <= 2
    assert not jobs.stranded() and not jobs.queued()


def test_a_worker_killed_as_a_delayed_message_reaches_its_queue_runs_it_once(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    worker = workers(TEST_KILL_ONCE="1", **FREEZE_ENV)
    wait_ready(jobs)
    send(jobs, "lc_quick", "kill-me", delay_ms=2_000)
    wait_for(lambda: jobs.client.get("test:killed"), 20, "the hook to kill the worker process")
    wait_for(lambda: jobs.dones("kill-me"), 30, "the job to run after the kill")
    time.sleep(4)  # a second copy would run now (the supervisor replaced the process)
    assert len(jobs.dones("kill-me")) == 1, jobs.starts("kill-me")
    assert not jobs.stranded() and not jobs.delayed() and not jobs.queued()
    assert worker.process is not None and worker.process.poll() is None


def test_a_due_message_and_a_retry_never_wait_behind_later_delayed_ones(
        workers: Callable[..., Worker], jobs: Jobs, dl_project: Path, redis_url: str) -> None:
    # Two threads: Dramatiq's delay prefetch is 2,000, fewer than the messages due later.
    worker = workers(WORKER_CONCURRENCY="2")
    wait_ready(jobs)
    for index in range(2_100):
        send(jobs, "lc_quick", f"later{index}", delay_ms=3_600_000)
    soon = send(jobs, "lc_quick", "soon", delay_ms=2_000)
    jobs.enqueue("dl_flaky", "flaky")
    wait_for(lambda: jobs.dones("soon"), 20, "the message due in 2 s to run")
    assert jobs.dones("soon")[0][1] >= soon.options["eta"] / 1000 - 0.1, "not run early"
    wait_for(lambda: jobs.dones("flaky"), 20, "the retry, due in a second, to run")
    assert len(jobs.starts("flaky")) == 2
    assert not any(jobs.starts(f"later{index}") for index in range(0, 2_100, 100))

    # The age of the delay queue is the next due message's: freeze the worker process (not
    # the supervisor, whose exporter answers) once it took a message due in 4 s.
    (child,) = worker.children()
    frozen = send(jobs, "lc_quick", "frozen", delay_ms=4_000)
    wait_for(lambda: not jobs.delayed(), 10, "the worker to take the delay list")
    os.kill(child, signal.SIGSTOP)
    try:
        frozen_id = frozen.options["redis_message_id"]
        assert jobs.client.zscore(f"{NS}:{QUEUE}.DQ.due", frozen_id) is not None, "moved early"
        time.sleep(max(0.0, frozen.options["eta"] / 1000 + 3.5 - time.time()))
        overdue = gauge(worker.metrics(), "queue_oldest_message_seconds", f"{QUEUE}.DQ")
        depth = gauge(worker.metrics(), "queue_depth", f"{QUEUE}.DQ")
        env = project_env(dl_project, REDIS_URL=redis_url, WORKER_STATE_DIR="/nonexistent")
        done = run_cli(dl_project, "status", "--json", env=env)
    finally:
        os.kill(child, signal.SIGCONT)
    assert 2.5 <= overdue <= 30, overdue
    assert depth == 2_101
    (row,) = [q for q in json.loads(done.stdout)["queues"] if q["queue"] == QUEUE]
    assert row["delayed"] == 2_101 and 2.5 <= row["oldest_due_s"] <= 30, row
    wait_for(lambda: jobs.dones("frozen"), 20, "the frozen worker to run it once resumed")
    assert not held_delayed(jobs)


def test_large_delayed_messages_stay_in_redis_not_in_the_worker(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    worker = workers()
    wait_ready(jobs)
    (child,) = worker.children()

    def rss_mb() -> float:
        status = Path(f"/proc/{child}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]

    time.sleep(1)
    before = rss_mb()
    payload = "x" * (4 * 1024 * 1024)
    for index in range(30):  # 120 MiB of bodies, each under MAX_MESSAGE_BYTES
        send(jobs, "dl_big", f"big{index}", payload, delay_ms=3_600_000)
    wait_for(lambda: not jobs.delayed(), 30, "the worker to take the delay list")
    time.sleep(2)
    grown = rss_mb() - before
    assert grown < 40, f"the worker grew by {grown:.0f} MiB holding delayed bodies"
    assert not held_delayed(jobs)
    assert jobs.client.hlen(f"{NS}:{QUEUE}.DQ.msgs") == 30, "the bodies stay in Redis"
