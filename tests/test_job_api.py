"""The job API of issue #26 with real worker processes on a real Redis: typed actors (a bad send
refused in one line, a bad message dead-lettered once, never retried) and non-retryable errors
(``throws``, dead-lettered at once).

Producers run as API processes do (``python -c`` with only ``REDIS_URL``); bad messages are
pushed straight into Redis, as a buggy or foreign producer would.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _lifecycle import NS, QUEUE, Jobs, Worker, jobs, lc_project, wait_for, workers
from bakery import PYTHON, package_of, run_cli
from test_malformed import counted

pytestmark = pytest.mark.slow
__all__ = ["jobs", "lc_project", "workers"]


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
        lc_project: Path, redis_url: str, jobs: Jobs) -> None:
    done = produce(lc_project, redis_url, (
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
        workers: Callable[..., Worker], jobs: Jobs, lc_project: Path, redis_url: str) -> None:
    done = produce(lc_project, redis_url, (
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
