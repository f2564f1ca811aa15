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
from _lifecycle import Jobs, Worker, lc_project, wait_for  # noqa: F401  (fixture)
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
    code = (f"import {package}.broker as b; "
            "from worker_runtime.broker import build_broker, build_producer_broker; "
            "from worker_runtime.settings import load_redis_settings, load_settings; "
            "w = build_broker(load_settings(), b.middleware).actor_options; "
            "p = build_producer_broker(load_redis_settings()).actor_options; "
            "print(sorted(w - p))")
    env = clean_env(default_project, WORKER_POOL="external", REDIS_URL="redis://127.0.0.1:1/0")
    done = subprocess.run([PYTHON, "-c", code], cwd=default_project, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


UNCERTAIN = """\
import pathlib, sys, time

import redis
from {package}.actors.lc_test import lc_quick
from {package}.broker import broker

folder = pathlib.Path(sys.argv[1])
broker.enqueue(lc_quick.message("warm"))  # a first send (the scripts are loaded)
print("warm", flush=True)
while not (folder / "cut").exists():
    time.sleep(0.05)
message = lc_quick.message("once")
try:
    broker.enqueue(message)
    print("sent", flush=True)
except redis.RedisError as error:
    print("raised", type(error).__name__, isinstance(error, redis.TimeoutError), flush=True)
    while not (folder / "go").exists():
        time.sleep(0.05)
    broker.enqueue(message)  # the retry: the same message
    print("resent", flush=True)
"""


def test_a_send_during_a_blackhole_raises_may_be_enqueued_and_a_resend_runs_once(
        lc_project: Path, redis_url: str, tmp_path: Path) -> None:
    """A send through a blackholed path raises EnqueueUncertain (a TimeoutError too) after
    the socket timeout, and its command reaches Redis when the path heals (the message is
    enqueued after all); the caller's retry of the same message enqueues nothing: the job
    runs exactly once."""
    from blackhole import Blackhole

    jobs = Jobs(redis_url)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with Blackhole(port) as hole:
        producer = subprocess.Popen(
            [PYTHON, "-c", UNCERTAIN.format(package=package_of(lc_project)), str(tmp_path)],
            cwd=lc_project, env=clean_env(lc_project, REDIS_URL=hole.url),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert producer.stdout is not None
            assert producer.stdout.readline().strip() == "warm"
            hole.cut()
            (tmp_path / "cut").touch()
            lines = [producer.stdout.readline()]  # a warning may come first (Redis's clock)
            while lines[-1] and not lines[-1].startswith(("raised", "sent")):
                lines.append(producer.stdout.readline())
            assert lines[-1].startswith("raised"), lines
            hole.heal()
            wait_for(lambda: "once" in jobs.queued_ids(), 30, "the uncertain send to land")
            (tmp_path / "go").touch()
            assert producer.wait(timeout=60) == 0
            assert "resent" in producer.stdout.read()
        finally:
            producer.kill()
    assert sorted(jobs.queued_ids()) == ["once", "warm"], "the resend enqueued nothing"
    # one documented type: it may have been enqueued (a TimeoutError too, as before)
    assert lines[-1] == "raised EnqueueUncertain True\n", lines
    worker = Worker(lc_project, redis_url, tmp_path / "w").start()
    try:
        wait_for(lambda: jobs.dones("once") and jobs.dones("warm") and not jobs.queued_ids()
                 and not jobs.stranded(), 30, "both jobs done")
        assert worker.stop(timeout=30) == 0, worker.log()[-3000:]
    finally:
        worker.kill()
        jobs.client.close()
    assert len(jobs.dones("once")) == 1 and len(jobs.starts("once")) == 1


def test_enqueue_with_a_message_id_twice_enqueues_once(default_project: Path,
                                                       redis_url: str) -> None:
    package = package_of(default_project)
    code = (f"from {package}.producer import enqueue\n"
            "for _ in range(3):\n"
            "    enqueue('send_notification', 9, 'welcome', 'n-9', message_id='welcome-9')\n")
    done = subprocess.run([PYTHON, "-c", code], cwd=default_project, check=False, timeout=60,
                          env=clean_env(default_project, REDIS_URL=redis_url),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    client = redis.Redis.from_url(redis_url)
    sent = [m for m in queued(client, "notifications") if m.message_id == "welcome-9"]
    assert len(sent) == 1, sent
