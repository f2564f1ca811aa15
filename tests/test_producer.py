"""Producers: an API process enqueues with only ``REDIS_URL`` set, in a real subprocess with a
clean environment (no ``WORKER_*`` variable), by importing an actor or through
``<package>.producer``; a worker then runs what it enqueued."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import redis
from _lifecycle import Worker, wait_for
from bakery import PYTHON, package_of
from dramatiq import Message

pytestmark = pytest.mark.slow

API = """\
import sys

from {package}.actors.notifications import send_notification
from {package}.producer import enqueue

send_notification.send(7, "welcome", "by-import")
enqueue("send_notification", 8, "welcome", "by-name")
enqueue("capture_payment", "pay-1", 1000, delay_ms=60_000)
print("enqueued")
"""


def clean_env(project: Path, **env: str) -> dict[str, str]:
    """What an API container has: its PATH, the code, ``REDIS_URL``; nothing of the worker."""
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(project / "src"), **env}


def run_api(project: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = API.format(package=package_of(project))
    return subprocess.run([PYTHON, "-c", code], cwd=project, env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def queued(client: redis.Redis, queue: str) -> list[Message[object]]:
    ids = client.lrange(f"dramatiq:{queue}", 0, -1)
    return [Message.decode(client.hget(f"dramatiq:{queue}.msgs", redis_id))  # type: ignore[arg-type]
            for redis_id in ids]


def test_api_process_enqueues_with_only_redis_url(default_project: Path, redis_url: str,
                                                  tmp_path: Path) -> None:
    env = clean_env(default_project, REDIS_URL=redis_url)
    done = run_api(default_project, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "enqueued"
    client = redis.Redis.from_url(redis_url)
    sent = queued(client, "notifications")
    assert [(m.actor_name, m.kwargs["notification_id"]) for m in sent] == [
        ("send_notification", "by-import"),
        ("send_notification", "by-name"),
    ]  # a typed actor's positional arguments are sent as its model's fields
    assert sent[0].kwargs == {"user_id": 7, "template": "welcome", "notification_id": "by-import"}
    (delayed,) = queued(client, "payments.DQ")
    assert delayed.actor_name == "capture_payment" and delayed.options["eta"] > 0

    worker = Worker(default_project, redis_url, tmp_path / "worker")  # needs no database
    worker.start()
    try:
        wait_for(lambda: client.get("idempotency:notification:by-name") == b"done"
                 and client.get("idempotency:notification:by-import") == b"done", 30,
                 "the worker to send both notifications")
    finally:
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.log()[-3000:]


def test_api_process_with_a_bad_redis_url_gets_one_line(default_project: Path) -> None:
    done = run_api(default_project, clean_env(default_project, REDIS_URL="http://redis:6379"))
    assert done.returncode == 78
    assert done.stderr.strip() == ("config error: REDIS_URL='http://redis:6379': must start "
                                   "with redis://, rediss://, unix:// or redis+sentinel://")


def test_producer_broker_declares_every_option_the_worker_accepts(default_project: Path) -> None:
    package = package_of(default_project)
    code = (f"from {package}.broker import build_broker, build_producer_broker; "
            f"from {package}.settings import load_redis_settings, load_settings; "
            "w = build_broker(load_settings()).actor_options; "
            "p = build_producer_broker(load_redis_settings()).actor_options; "
            "print(sorted(w - p))")
    env = clean_env(default_project, WORKER_POOL="external", REDIS_URL="redis://127.0.0.1:1/0")
    done = subprocess.run([PYTHON, "-c", code], cwd=default_project, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
