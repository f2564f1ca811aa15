"""The job API of issue #26 with real worker processes on a real Redis: typed actors (a bad send
refused in one line, a bad message dead-lettered once, never retried) and non-retryable errors
(``throws``, dead-lettered at once).

Producers run as API processes do (``python -c`` with only ``REDIS_URL``); bad messages are
pushed straight into Redis, as a buggy or foreign producer would.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
)
from bakery import PYTHON, copy_project, package_of, run_cli
from test_malformed import counted

pytestmark = pytest.mark.slow
__all__ = ["jobs"]

API_ACTORS = '''\
"""Actors of the job API tests (results, groups, async): each records what it did in Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import dramatiq
import redis

from ..lifecycle import checkpoint
from worker_runtime.typed import JobArguments, actor

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


class Stage(JobArguments):
    label: str


@actor(queue_name="notifications", max_retries=0)
def api_typed_stage(job: Stage) -> None:
    _client.rpush("test:typed_stage", job.label)


class _KillAsGroupCallbackEnqueued(dramatiq.Middleware):
    """SIGKILLs this worker process once (``TEST_GROUP_KILL_MARKER`` not there yet) as a
    group's callback is enqueued, before the member's ack: ``TEST_GROUP_KILL=before`` (the
    callback prepared, not stored) or ``after`` (stored; ``TEST_GROUP_KILL_PAUSE_S`` later).

    From the moment the callback is prepared, this process runs no callback: one it fetches
    waits for the kill. A process killed after running a job and before its ack runs it
    again, as every job (at least once): left free, the callback could run between its
    store and the kill and fire twice by that alone (1 run in 12-25)."""

    def __init__(self) -> None:
        self.dying = threading.Event()

    def _armed(self, message: dramatiq.Message) -> bool:
        marker = os.environ.get("TEST_GROUP_KILL_MARKER")
        return bool(message.actor_name == "api_group_done" and marker
                    and not Path(marker).exists())

    def _kill(self) -> None:
        Path(os.environ["TEST_GROUP_KILL_MARKER"]).touch()
        os.kill(os.getpid(), signal.SIGKILL)

    def before_enqueue(self, broker, message, delay):
        if self._armed(message):
            self.dying.set()
            if os.environ.get("TEST_GROUP_KILL") == "before":
                self._kill()

    def after_enqueue(self, broker, message, delay):
        if self._armed(message) and os.environ.get("TEST_GROUP_KILL") == "after":
            time.sleep(float(os.environ.get("TEST_GROUP_KILL_PAUSE_S", "0")))
            self._kill()

    def before_process_message(self, broker, message):
        while self.dying.is_set() and message.actor_name == "api_group_done":
            time.sleep(1)  # the kill is on its way


dramatiq.get_broker().add_middleware(_KillAsGroupCallbackEnqueued())


def _record(kind: str, job_id: str) -> None:
    _client.rpush(f"test:{kind}:{job_id}", f"{os.getpid()} {time.time()}")


@dramatiq.actor(queue_name="notifications", store_results=True, max_retries=0)
def api_add(x: int, y: int) -> int:
    return x + y


@dramatiq.actor(queue_name="notifications", store_results=True, max_retries=0)
def api_big(size: int) -> str:
    return "x" * size


@dramatiq.actor(queue_name="notifications", store_results=True)
def api_unstorable(kind: str) -> object:
    _client.rpush("test:unstorable", kind)
    return {"set": {1, 2}, "bytes": b"raw", "object": Stage(label="x")}[kind]


@dramatiq.actor(queue_name="notifications", store_results=True, max_retries=0)
def api_fail() -> None:
    raise RuntimeError("boom")


@dramatiq.actor(queue_name="notifications", max_retries=3, min_backoff=4000, max_backoff=4000)
def api_flaky(job_id: str) -> None:
    _record("start", job_id)
    raise RuntimeError("fails until cancelled")


@dramatiq.actor(queue_name="notifications")
def api_member(job_id: str, seconds: float = 0) -> None:
    time.sleep(seconds)
    _client.rpush("test:members", job_id)


@dramatiq.actor(queue_name="notifications")
def api_group_done(tag: str) -> None:
    _client.rpush("test:group_done", f"{tag} {_client.llen('test:members')}")


@dramatiq.actor(queue_name="notifications", max_retries=4, time_limit=600_000)
async def api_async(job_id: str, seconds: float, check: bool = False) -> None:
    _record("start", job_id)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        if check:
            checkpoint()
    _record("done", job_id)
'''


@pytest.fixture(scope="session")
def api_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``database="none"`` bake with the lifecycle test actors and the job API's."""
    base = bake(database="none")
    return make_test_project(base, tmp_path_factory.mktemp("api") / base.name,
                             job_api=API_ACTORS)


@pytest.fixture
def workers(api_project: Path, redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """``workers(**env)`` starts a worker of ``api_project``; all are killed at teardown."""
    count = iter(range(1_000))
    yield from started(
        lambda **env: Worker(api_project, redis_url, tmp_path / f"w{next(count)}", **env))


def produce(project: Path, redis_url: str, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (``{package}`` filled in) as an API process with only ``REDIS_URL``."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(project / "src"), "REDIS_URL": redis_url}
    return subprocess.run([PYTHON, "-c", code.format(package=package_of(project))], cwd=project,
                          env=env, capture_output=True, text=True, timeout=60, check=False)


def body(actor: str, args: list[Any], kwargs: dict[str, Any], redis_id: str,
         queue: str = QUEUE, **options: Any) -> bytes:
    return json.dumps({
        "queue_name": queue, "actor_name": actor, "args": args, "kwargs": kwargs,
        "options": {"redis_message_id": redis_id, **options}, "message_id": str(uuid.uuid4()),
        "message_timestamp": 0}).encode()


def push(jobs: Jobs, actor: str, args: list[Any], kwargs: dict[str, Any], **options: Any) -> str:
    """Store a message as a producer without the model would; return its Redis id."""
    redis_id = str(uuid.uuid4())
    jobs.client.hset(f"{NS}:{QUEUE}.msgs", redis_id, body(actor, args, kwargs, redis_id, **options))
    jobs.client.rpush(f"{NS}:{QUEUE}", redis_id)
    return redis_id


def dead_reasons(worker: Worker, queue: str = QUEUE) -> list[str]:
    result = run_cli(worker.project, "dlq", "list", "--json", "--queue", queue, env=worker.env)
    assert result.returncode == 0, result.stderr
    return [entry["reason"] for entry in json.loads(result.stdout)]


def test_a_bad_send_is_refused_in_one_line_and_nothing_is_enqueued(
        api_project: Path, redis_url: str, jobs: Jobs) -> None:
    done = produce(api_project, redis_url, (
        "from {package}.actors.notifications import send_notification\n"
        "try:\n"
        "    send_notification.send(user_id='x', template=1, notification_id=None)\n"
        "except ValueError as error:\n"
        "    print(error)\n"
        "send_notification.send(7)\n"))
    printed = done.stdout.strip()
    assert "\n" not in printed
    assert printed.startswith("send_notification: invalid arguments: user_id: Input should be a "
                              "valid integer"), printed
    assert "template: Input should be a valid string (got 1)" in printed
    assert "notification_id: Input should be a valid string (got None)" in printed
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith("typed.InvalidArgumentsError: send_notification: invalid arguments: "
                         "template: Field required (got {'user_id': 7}); notification_id: Field "
                         "required (got {'user_id': 7})"), last
    assert jobs.client.llen(f"{NS}:{QUEUE}") == 0


def test_a_bad_message_is_dead_lettered_once_with_its_reason_never_retried(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    push(jobs, "send_notification", [], {"user_id": "x", "template": 1, "notification_id": None})
    push(jobs, "send_notification", [7], {})  # the send_notification(7)
    push(jobs, "send_notification", [8, "welcome", "n-good"], {})  # an untyped producer's

    worker = workers()
    wait_for(lambda: jobs.client.get("idempotency:notification:n-good") == b"done", 30,
             "the good notification")
    wait_for(lambda: len(dead_reasons(worker)) == 2, 30, "two dead letters")
    reasons = sorted(dead_reasons(worker))
    assert reasons[0].startswith("invalid arguments: template: Field required"), reasons
    assert reasons[1].startswith("invalid arguments: user_id: Input should be a valid integer")
    assert "notification_id: Input should be a valid string (got None)" in reasons[1]
    assert jobs.client.get("idempotency:notification:None") is None  # the handler never ran
    assert jobs.delayed() == 0 and not jobs.stranded()  # no retry copy, nothing held
    text = worker.metrics()
    assert counted(text, "dead_letter", "send_notification") == 2
    assert counted(text, "retry", "send_notification") == 0
    assert counted(text, "success", "send_notification") == 1
    ends = [r for r in worker.records("job_end") if r.get("outcome") == "dead_letter"]
    assert len(ends) == 2
    assert worker.stop() == 0


def test_an_error_listed_in_throws_is_dead_lettered_at_once(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str) -> None:
    done = produce(api_project, redis_url, (
        "from {package}.actors.payments import CARD_LIMIT_CENTS, capture_payment\n"
        "capture_payment.send('pay-declined', CARD_LIMIT_CENTS + 1)\n"
        "capture_payment.send('pay-ok', 1000)\n"))
    assert done.returncode == 0, done.stderr
    worker = workers(WORKER_POOL="critical")
    wait_for(lambda: jobs.client.get("idempotency:payment:pay-ok") == b"done", 30, "pay-ok")
    wait_for(lambda: dead_reasons(worker, "payments"), 30, "the declined payment's dead letter")
    (reason,) = dead_reasons(worker, "payments")
    assert reason.startswith("PaymentDeclinedError: pay-declined: 1000001 cents is over"), reason
    assert jobs.client.llen(f"{NS}:payments.DQ") == 0  # never retried
    text = worker.metrics()
    assert counted(text, "failure", "capture_payment") == 1
    assert counted(text, "retry", "capture_payment") == 0
    assert worker.stop() == 0


RESULTS = """\
import dramatiq
from dramatiq.results import ResultFailure
from {package}.actors.job_api import api_add, api_big, api_fail
from {package}.actors.reports import build_report

print(api_add.send(2, 3).get_result(block=True, timeout=30_000))
late = api_add.send_with_options(args=(1, 1), delay=11_000)  # past the client's 10 s socket timeout
print(late.get_result(block=True, timeout=40_000))
print(len(build_report.send("r-1", 50, 10).get_result(block=True, timeout=30_000)))
for message in (api_big.send(5000), api_fail.send()):
    try:
        message.get_result(block=True, timeout=30_000)
    except ResultFailure as error:
        print(error.orig_exc_type, error.orig_exc_msg)
"""


def test_results_are_stored_with_their_ttl_and_capped(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str) -> None:
    for pool in ("interactive", "bulk"):
        workers(WORKER_POOL=pool, RESULT_TTL_MS="60000", RESULT_MAX_BYTES="2048")
    done = produce(api_project, redis_url, RESULTS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "5",
        "2",
        "64",  # the example actor's digest
        "ResultTooLargeError result of 5002 bytes is over RESULT_MAX_BYTES (2048)",
        "RuntimeError boom",
    ]
    keys = list(jobs.client.scan_iter(match=f"{NS}:__results__:*"))
    assert len(keys) == 5
    assert all(0 < jobs.client.pttl(key) <= 60_000 for key in keys)


GROUP = """\
import dramatiq
from {package}.actors.job_api import api_group_done, api_member

members = [api_member.message("m1"), api_member.message("m2"), api_member.message("m3", 3.0)]
group = dramatiq.group(members)
group.add_completion_callback(api_group_done.message("g1"))
group.run()
"""


UNSTORABLE = """\
from dramatiq.results import ResultFailure, ResultTimeout
from {package}.actors.job_api import api_unstorable

for kind in ("set", "bytes", "object"):
    try:
        api_unstorable.send(kind).get_result(block=True, timeout=15_000)
    except ResultFailure as error:
        print(kind, error.orig_exc_type, error.orig_exc_msg)
    except ResultTimeout:
        print(kind, "timed out")
"""


def test_a_result_that_is_not_json_fails_the_job_and_reaches_the_caller_at_once(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str) -> None:
    worker = workers()
    done = produce(api_project, redis_url, UNSTORABLE)
    assert done.returncode == 0, done.stderr
    types = {"set": "set", "bytes": "bytes", "object": "Stage"}
    assert done.stdout.splitlines() == [
        f"{kind} ResultNotStorableError result not stored: actor 'api_unstorable' returned a "
        f"value that is not JSON (Object of type {name} is not JSON serializable); return a "
        "dict, list, str, number, bool or None" for kind, name in types.items()]
    assert jobs.client.lrange("test:unstorable", 0, -1) == [b"set", b"bytes", b"object"]
    ends = [r for r in worker.records("job_end") if r["actor"] == "api_unstorable"]
    assert [(r["outcome"], r["reason"].split("(")[1].split(")")[0]) for r in ends] == [
        ("failure", f"Object of type {name} is not JSON serializable") for name in types.values()]
    assert not [r for r in worker.records() if r.get("level") == "critical"]
    wait_for(lambda: counted(worker.metrics(), "failure", "api_unstorable") == 3, 10, "counted")
    assert counted(worker.metrics(), "success", "api_unstorable") == 0
    assert len(dead_reasons(worker)) == 3 and jobs.delayed() == 0  # not retried
    assert worker.stop() == 0


def test_a_group_callback_fires_once_after_every_member_even_one_delivered_twice(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str) -> None:
    done = produce(api_project, redis_url, GROUP)
    assert done.returncode == 0, done.stderr
    # m1 delivered twice (as after a crash before its ack): Dramatiq's own barrier, decremented
    # per delivery, reached zero when m1, m1 and m2 were done, while m3 still ran.
    (first,) = [i for i in jobs.client.lrange(f"{NS}:{QUEUE}", 0, -1)
                if b'"m1"' in jobs.client.hget(f"{NS}:{QUEUE}.msgs", i)]
    twin = str(uuid.uuid4())
    raw = json.loads(jobs.client.hget(f"{NS}:{QUEUE}.msgs", first))
    raw["options"]["redis_message_id"] = twin
    jobs.client.hset(f"{NS}:{QUEUE}.msgs", twin, json.dumps(raw))
    jobs.client.rpush(f"{NS}:{QUEUE}", twin)
    worker = workers()
    wait_for(lambda: jobs.client.llen("test:group_done"), 30, "the group's callback")
    time.sleep(2)  # a second firing would come now
    assert jobs.client.lrange("test:group_done", 0, -1) == [b"g1 4"]  # after all 4 deliveries
    assert worker.stop() == 0


EXAMPLE_GROUP = """\
import dramatiq
from {package}.actors.reports import build_report, reports_ready

batch = dramatiq.group([build_report.message(f"r-{{n}}", 10_000) for n in range(3)])
batch.add_completion_callback(reports_ready.message(batch_id="b-1"))
batch.run()
"""


def test_the_example_async_callback_runs_once_after_its_batch(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str) -> None:
    done = produce(api_project, redis_url, EXAMPLE_GROUP)
    assert done.returncode == 0, done.stderr
    worker = workers(WORKER_POOL="bulk")

    def ready() -> list[dict[str, Any]]:
        return [r for r in worker.records() if r.get("msg") == "report batch ready"]

    def succeeded() -> list[str]:
        return sorted(r["actor"] for r in worker.records("job_end")
                      if r.get("outcome") == "success")

    wait_for(ready, 60, "the batch's callback")
    wait_for(lambda: len(succeeded()) >= 4, 30, "the jobs' ends logged")
    time.sleep(1)
    assert succeeded() == ["build_report"] * 3 + ["reports_ready"]
    assert [r["batch_id"] for r in ready()] == ["b-1"]
    assert worker.stop() == 0


@pytest.mark.parametrize("moment", ["before", "after", "after-pause"])
def test_a_group_callback_fires_once_when_the_worker_is_killed_as_it_is_enqueued(
        moment: str, workers: Callable[..., Worker], jobs: Jobs, api_project: Path,
        redis_url: str, tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    done = produce(api_project, redis_url, GROUP.replace('"m3", 3.0', '"m3"'))
    assert done.returncode == 0, done.stderr
    # after-pause: the process lives 1 s with the callback stored, long enough to fetch it
    # (it must not run it: it holds it when killed, and recovery requeues it once).
    when, _, pause = moment.partition("-")
    worker = workers(TEST_GROUP_KILL=when, TEST_GROUP_KILL_MARKER=str(marker),
                     TEST_GROUP_KILL_PAUSE_S="1" if pause else "0",
                     WORKER_HEARTBEAT_TIMEOUT_MS="3000")
    wait_for(marker.exists, 30, "the worker process killed as the callback is enqueued")
    wait_for(lambda: jobs.client.llen("test:group_done"), 30, "the group's callback")
    # The members the killed process held (the last one among them) run again, completing the
    # group again: nothing more.
    wait_for(lambda: jobs.client.llen("test:members") > 3, 30, "the last member run again")
    wait_for(lambda: not jobs.stranded() and jobs.queued() == [], 30, "everything settled")
    time.sleep(1)
    (fired,) = jobs.client.lrange("test:group_done", 0, -1)
    assert fired.startswith(b"g1 "), fired
    assert jobs.dead_letters() == [] and jobs.delayed() == 0
    assert worker.stop() == 0


def test_an_async_actor_runs_and_is_drained_on_sigterm(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str) -> None:
    send = "from {package}.actors.job_api import api_async\n"
    done = produce(api_project, redis_url, send + (
        "api_async.send('quick', 0.1)\n"
        "api_async.send('stops', 600.0, True)\n"))
    assert done.returncode == 0, done.stderr
    worker = workers(HEALTH_STALLED_AFTER_S="1")
    wait_for(lambda: jobs.dones("quick") and jobs.starts("stops"), 30, "the async jobs")
    time.sleep(1.5)  # past HEALTH_STALLED_AFTER_S: the checkpointing async job stays live
    live = worker.healthcheck("live")
    assert live.returncode == 0, live.stdout + live.stderr
    assert produce(api_project, redis_url, send + "api_async.send('finishes', 2.0)").returncode == 0
    wait_for(lambda: jobs.starts("finishes"), 30, "the job the drain lets finish")
    worker.signal()
    assert worker.wait(timeout=30) == 0
    assert len(jobs.dones("finishes")) == 1  # drained: finished during the drain
    assert jobs.dones("stops") == [] and jobs.queued_ids() == ["stops"]  # requeued at checkpoint
    assert not jobs.stranded() and jobs.delayed() == 0
    (drained,) = [r for r in worker.records() if r.get("msg") == "drained"]
    assert drained["requeued"] == 1 and drained["interrupted"] == 0, drained


UNSERVABLE = {
    "store_results": (
        "@dramatiq.actor(queue_name='untrusted', store_results=True)\n"
        "def sandboxed_result() -> int:\n"
        "    return 1\n",
        "actor 'sandboxed_result' sets store_results=True, but its queue 'untrusted' runs under "
        "the sandbox's Redis user, which may not write results: return nothing, or send the "
        "result to an actor of another queue"),
    "async": (
        "@dramatiq.actor(queue_name='untrusted')\n"
        "async def sandboxed_async() -> None:\n"
        "    pass\n",
        "actor 'sandboxed_async' is async def, but its queue 'untrusted' runs untrusted code in "
        "a child process it waits for: on the event loop that wait blocks every other job, and "
        "neither the time limit nor a cancel can stop it: declare it def"),
    "on_success": (
        "@dramatiq.actor(queue_name='untrusted', on_success='send_notification')\n"
        "def sandboxed_callback() -> None:\n"
        "    pass\n",
        "actor 'sandboxed_callback' sets on_success='send_notification', but its queue "
        "'untrusted' runs under the sandbox's Redis user, which may enqueue only on its own "
        "queue: the callback would be lost; send it from an actor of another queue"),
}


@pytest.mark.parametrize("case", sorted(UNSERVABLE))
def test_an_actor_the_service_cannot_serve_refuses_to_boot_in_one_line(
        case: str, api_project: Path, redis_url: str, tmp_path: Path) -> None:
    source, reason = UNSERVABLE[case]
    broken = copy_project(api_project, tmp_path / api_project.name,
                          unservable="import dramatiq\n\n\n" + source)
    worker = Worker(broken, redis_url, tmp_path / "w").start()
    try:
        assert worker.wait(timeout=60) == 78
    finally:
        worker.kill()
    (failed,) = [r for r in worker.records() if r.get("event") == "boot_failed"]
    assert failed["reason"] == reason


SANDBOX_COMPOSITIONS = """\
import dramatiq
from {package}.actors.job_api import api_group_done, api_member
from {package}.actors.sandbox import run_customer_code

source = "def main(p):\\n    return 1\\n"
group = dramatiq.group([run_customer_code.message(source, None), api_member.message("m")])
group.add_completion_callback(api_group_done.message("g"))
stages = [run_customer_code.message(source, None), api_member.message("after")]
for run in (group.run, dramatiq.pipeline(stages).run):
    try:
        run()
    except ValueError as error:
        print(error)
"""


def test_a_group_or_pipeline_the_sandbox_cannot_complete_is_refused_at_send(
        jobs: Jobs, api_project: Path, redis_url: str) -> None:
    done = produce(api_project, redis_url, SANDBOX_COMPOSITIONS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "group refused: member 'run_customer_code' runs under the sandbox's Redis user, which "
        "may not record the group's completion: its callbacks would never fire; complete the "
        "group from an actor of another queue",
        "pipeline refused: stage 'run_customer_code' runs under the sandbox's Redis user, which "
        "may enqueue only on its own queue: the next stage 'api_member' would be lost; start "
        "another pipeline from the sandbox stage's result instead",
    ]
    assert jobs.queued() == [] and jobs.client.llen("dramatiq-sandbox:untrusted") == 0


def test_a_queued_job_cancelled_never_runs_and_a_running_one_stops(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str) -> None:
    sent = produce(api_project, redis_url, (
        "from {package}.actors.lc_test import lc_quick, lc_sleep\n"
        "from {package}.actors.job_api import api_async\n"
        "from {package}.producer import cancel\n"
        "queued = lc_quick.send('queued')\n"
        "print(cancel(queued.message_id), cancel('no-such-message'))\n"
        "print(lc_sleep.send('running', 600).message_id)\n"
        "print(api_async.send('running-async', 600).message_id)\n"))
    assert sent.returncode == 0, sent.stderr
    found, running, running_async = sent.stdout.splitlines()
    assert found == "True False"
    worker = workers()
    wait_for(lambda: jobs.starts("running") and jobs.starts("running-async"), 30, "the jobs")
    for message_id in (running, running_async):
        cancelled = produce(api_project, redis_url, (
            "from {package}.producer import cancel\n"
            f"print(cancel({message_id!r}))\n"))
        assert cancelled.stdout.strip() == "True", cancelled.stderr
    wait_for(lambda: counted(worker.metrics(), "cancelled") == 3, 30, "3 cancelled jobs")
    jobs.enqueue("lc_quick", "after")
    wait_for(lambda: jobs.dones("after"), 30, "a job after the cancellations")
    assert jobs.starts("queued") == []
    assert jobs.dones("running") == [] and jobs.dones("running-async") == []
    text = worker.metrics()
    for outcome in ("failure", "retry", "dead_letter", "requeued"):
        assert counted(text, outcome) == 0, outcome
    assert jobs.queued() == [] and jobs.delayed() == 0 and jobs.dead_letters() == []
    assert not jobs.stranded()
    assert worker.stop() == 0


def test_a_retry_copy_is_found_by_its_id_and_cancelled(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str) -> None:
    sent = produce(api_project, redis_url, (
        "from {package}.actors.job_api import api_flaky\n"
        "print(api_flaky.send('flaky').message_id)\n"))
    assert sent.returncode == 0, sent.stderr
    message_id = sent.stdout.strip()
    worker = workers()
    # The retry copy's body (held by the worker's delay-queue consumer until it is due).
    wait_for(lambda: jobs.client.hlen(f"{NS}:{QUEUE}.DQ.msgs") == 1, 30, "its retry copy")
    cancelled = produce(api_project, redis_url, (
        "from {package}.producer import cancel\n"
        f"print(cancel({message_id!r}))\n"))
    assert cancelled.stdout.strip() == "True", cancelled.stderr  # the index followed the retry
    wait_for(lambda: counted(worker.metrics(), "cancelled") == 1, 30, "the copy skipped")
    assert len(jobs.starts("flaky")) == 1 and jobs.dead_letters() == []
    wait_for(lambda: not jobs.stranded(), 30, "nothing held")
    assert jobs.client.hlen(f"{NS}:{QUEUE}.DQ.msgs") == 0 and jobs.queued() == []
    assert jobs.client.hlen(f"{NS}:__where__") == 0
    assert worker.stop() == 0


def test_the_index_follows_messages_dead_lettered_unread_or_by_recovery_and_replayed(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str) -> None:
    """The message index (one entry per stored message: a cancel's one look-up) keeps none
    for a message the service sent that a foreign writer then garbled (dead-lettered as
    malformed, unread) or whose worker process died WORKER_MAX_ATTEMPTS times (dead-lettered
    by recovery); a dead letter replayed is indexed again: a cancel finds it, it never runs."""
    sent = produce(api_project, redis_url, (
        "from {package}.actors.lc_test import lc_poison, lc_quick\n"
        "print(lc_quick.send('garbled').options['redis_message_id'])\n"
        "print(lc_poison.send('poison').message_id)\n"))
    assert sent.returncode == 0, sent.stderr
    garbled, poison = sent.stdout.split()
    stored = json.loads(jobs.client.hget(f"{NS}:{QUEUE}.msgs", garbled))
    stored["kwargs"] = []  # its message id kept: the worker can still name its entry
    jobs.client.hset(f"{NS}:{QUEUE}.msgs", garbled, json.dumps(stored))
    index = f"{NS}:__where__"
    assert jobs.client.hlen(index) == 2
    worker = workers(WORKER_MAX_ATTEMPTS="2")
    wait_for(lambda: jobs.client.zcard(f"{NS}:{QUEUE}.XQ") == 2, 60, "both dead-lettered")
    wait_for(lambda: not jobs.stranded(), 30, "nothing held")
    assert len(jobs.starts("poison")) == 2 and jobs.starts("garbled") == []
    assert jobs.client.hgetall(index) == {}  # the old code kept both entries
    assert worker.stop() == 0

    (letter,) = [redis_id for redis_id, raw in jobs.client.hgetall(f"{NS}:{QUEUE}.XQ.msgs").items()
                 if poison.encode() in raw]
    replayed = run_cli(api_project, "dlq", "replay", letter.decode(), "--queue", QUEUE,
                       env=worker.env)
    assert replayed.returncode == 0, replayed.stderr
    assert jobs.client.hexists(index, poison)  # the old code: not indexed, cancel said False
    cancelled = produce(api_project, redis_url, (
        "from {package}.producer import cancel\n"
        f"print(cancel({poison!r}))\n"))
    assert cancelled.stdout.strip() == "True", cancelled.stderr
    worker = workers()
    jobs.enqueue("lc_quick", "after")  # queued behind the replayed copy
    wait_for(lambda: jobs.dones("after"), 30, "a job after the replayed copy")
    wait_for(lambda: counted(worker.metrics(), "cancelled") == 1, 30, "the replay skipped")
    assert len(jobs.starts("poison")) == 2
    wait_for(lambda: not jobs.stranded(), 30, "nothing held")
    assert jobs.client.hgetall(index) == {}
    assert worker.stop() == 0


PIPELINES = """\
import dramatiq
from {package}.actors.job_api import api_add, api_typed_stage

try:
    dramatiq.pipeline([api_add.message(2, 3), api_typed_stage.message(label="sum")]).run()
except ValueError as error:
    print(error)
ignoring = api_typed_stage.message_with_options(kwargs={{"label": "ok"}}, pipe_ignore=True)
dramatiq.pipeline([api_add.message(2, 3), ignoring]).run()
"""


def test_a_typed_actor_as_a_pipeline_stage_is_refused_at_send_unless_it_ignores_the_result(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str) -> None:
    done = produce(api_project, redis_url, PIPELINES)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "pipeline refused: typed actor 'api_typed_stage' cannot take the previous result as an "
        "argument (its arguments are its model's fields): send its message with "
        "pipe_ignore=True, or make the stage an untyped actor"]
    assert len(jobs.queued()) == 1  # the second pipeline's first stage alone
    # A pipeline sent past the check (an older producer): the result appended to the fields.
    push(jobs, "api_typed_stage", [5], {"label": "x"}, schema_version=1)
    worker = workers()
    wait_for(lambda: jobs.client.lrange("test:typed_stage", 0, -1) == [b"ok"], 30, "stage 2")
    wait_for(lambda: dead_reasons(worker), 30, "the appended result's dead letter")
    assert dead_reasons(worker) == [
        "invalid arguments: label: given both by position and by name (a pipeline's previous "
        "result? a typed stage is sent with pipe_ignore=True)"]
    assert worker.stop() == 0


CANCEL_AMONG_MANY = """\
import json
from {package}.actors.lc_test import lc_quick
from {package}.producer import broker, cancel

ids = [lc_quick.send(f"q{{i}}").message_id for i in range(2000)]
before = broker.client.info("commandstats")
found = cancel(ids[1000])
after = broker.client.info("commandstats")
calls = {{name: stats["calls"] - before.get(name, {{"calls": 0}})["calls"]
         for name, stats in after.items()}}
print(found, json.dumps({{name: n for name, n in calls.items() if n}}))
"""


def test_a_cancel_among_many_queued_messages_reads_no_bodies(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str) -> None:
    done = produce(api_project, redis_url, CANCEL_AMONG_MANY)
    assert done.returncode == 0, done.stderr
    found, raw = done.stdout.split(" ", 1)
    assert found == "True"
    calls = json.loads(raw)
    calls.pop("cmdstat_info", None)  # the measurement's own
    # One round trip: a script per namespace (the sandbox's too), each reading the message
    # index once; nothing that reads a queue or its bodies.
    for reader in ("hscan", "hgetall", "hvals", "hkeys", "lrange", "scan", "keys"):
        assert f"cmdstat_{reader}" not in calls, calls
    assert sum(calls.values()) <= 16, calls
    assert calls.get("cmdstat_hget") == 2 and calls.get("cmdstat_hexists") == 1, calls
    worker = workers()
    wait_for(lambda: len(jobs.client.keys("test:done:q*")) == 1999, 120, "the other 1,999 jobs")
    wait_for(lambda: counted(worker.metrics(), "success") == 1999, 30, "their metrics")
    assert counted(worker.metrics(), "cancelled") == 1
    assert jobs.starts("q1000") == [] and len(jobs.dones("q1001")) == 1
    assert jobs.client.hlen(f"{NS}:__where__") == 0  # the index follows the messages out
    assert worker.stop() == 0


EVOLVE = '''\\
"""A typed actor at schema version {version}, for the rolling-deploy test."""

from __future__ import annotations

import json
import os

import redis
from pydantic import AliasChoices, Field

from worker_runtime.typed import JobArguments, actor

_client = redis.Redis.from_url(os.environ["REDIS_URL"])

{model}

@actor(queue_name="notifications")
def greet(job: Greeting) -> None:
    _client.rpush("test:greeted", json.dumps({{"worker": {version}, **job.model_dump()}}))
'''

V1 = '''\\
class Greeting(JobArguments):
    user_id: int
    name: str
'''

# Release 2, as the README's upgrade path says: ``name`` renamed ``display_name`` (read under
# both names, still written as ``name`` for one release) and ``locale`` added with a default.
V2 = '''\\
class Greeting(JobArguments):
    version = 2
    user_id: int
    display_name: str = Field(
        validation_alias=AliasChoices("display_name", "name"), serialization_alias="name"
    )
    locale: str = "en"
'''


def test_a_rolling_deploy_runs_old_messages_on_new_workers_and_new_on_old(
        workers: Callable[..., Worker], jobs: Jobs, api_project: Path, redis_url: str,
        tmp_path: Path) -> None:
    old = copy_project(api_project, tmp_path / "old" / api_project.name,
                       evolve=EVOLVE.format(version=1, model=V1))
    new = copy_project(api_project, tmp_path / "new" / api_project.name,
                       evolve=EVOLVE.format(version=2, model=V2))
    send = "from {package}.actors.evolve import greet\n"
    # New producers (release 2) while only old workers run: new-version messages, old workers.
    done = produce(new, redis_url, send + (
        "greet.send(user_id=1, display_name='Ada', locale='fr')\n"
        "greet.send(2, 'Bob')\n"))
    assert done.returncode == 0, done.stderr
    old_worker = Worker(old, redis_url, tmp_path / "w-old").start()
    try:
        wait_for(lambda: jobs.client.llen("test:greeted") == 2, 30, "old workers on new messages")
        assert old_worker.stop() == 0
    finally:
        old_worker.kill()
    # Old producers (release 1) still running once new workers took over.
    done = produce(old, redis_url, send + "greet.send(user_id=3, name='Cy')\n")
    assert done.returncode == 0, done.stderr
    new_worker = Worker(new, redis_url, tmp_path / "w-new").start()
    try:
        wait_for(lambda: jobs.client.llen("test:greeted") == 3, 30, "new workers on old messages")
        assert new_worker.stop() == 0
    finally:
        new_worker.kill()
    greeted = sorted((json.loads(raw) for raw in jobs.client.lrange("test:greeted", 0, -1)),
                     key=lambda record: record["user_id"])
    assert greeted == [
        {"worker": 1, "user_id": 1, "name": "Ada"},  # locale, unknown to release 1, ignored
        {"worker": 1, "user_id": 2, "name": "Bob"},
        {"worker": 2, "user_id": 3, "display_name": "Cy", "locale": "en"},
    ]
    assert jobs.dead_letters() == [] and not jobs.stranded()
