"""Message size: producers refuse a message over ``MAX_MESSAGE_BYTES`` in one line, without
the memory it would take to encode it; the worker dead-letters one sent past them.

A real producer process sends a 200 MB argument (the issue's case: accepted, the producer
peaked at 1.0 GB): it gets ``MessageTooLargeError`` naming the actor and the size, its
peak RSS grows by far less than the argument, and nothing reaches Redis. A real worker with
``MAX_MESSAGE_BYTES=100000`` is sent a 200 kB message by bare Dramatiq: it is
dead-lettered unread (its body kept as it was sent), logged and counted with the reason
(``dlq list`` says it too), while a small message sent with it runs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis
from _lifecycle import NS, QUEUE, Jobs, Worker, jobs, lc_project, wait_for
from bakery import PYTHON, package_of, project_env, run_cli
from test_malformed import counted

pytestmark = pytest.mark.slow

#: 200 MB in one argument; RSS peaks are read from getrusage (kB on Linux).
PRODUCER = """\
import json, resource, sys
from {package}.producer import enqueue
from worker_runtime.middleware import MessageTooLargeError

big = "x" * (200 * 1024 * 1024)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    enqueue("lc_quick", big)
    outcome = "sent"
except MessageTooLargeError as error:
    outcome = str(error)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"outcome": outcome, "before_kb": before, "after_kb": after}}))
"""

#: The growth of the producer's peak RSS allowed while it refuses (the argument is 200 MB).
MAX_GROWTH_KB = 32 * 1024


def test_a_producer_refuses_a_200_mb_message_in_one_line_without_a_memory_spike(
        lc_project: Path, redis_url: str) -> None:
    code = PRODUCER.format(package=package_of(lc_project))
    done = subprocess.run([PYTHON, "-c", code], cwd=lc_project, capture_output=True, text=True,
                          env=project_env(lc_project, REDIS_URL=redis_url), timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    size = f"{200 * 1024 * 1024 + 2:,}"
    assert result["outcome"].startswith(
        f"message for actor 'lc_quick' is {size[:4]}"), result["outcome"]
    assert "over MAX_MESSAGE_BYTES (10,485,760)" in result["outcome"]
    assert "\n" not in result["outcome"]
    growth = result["after_kb"] - result["before_kb"]
    print(f"producer peak RSS: {result['before_kb'] / 1024:.0f} MB with the argument, "
          f"+{growth / 1024:.1f} MB while refusing it")
    assert growth < MAX_GROWTH_KB, result
    client = redis.Redis.from_url(redis_url)
    assert not client.llen(f"{NS}:{QUEUE}") and not client.hlen(f"{NS}:{QUEUE}.msgs")
    client.close()


def test_the_worker_dead_letters_a_message_sent_past_the_limit(
        lc_project: Path, redis_url: str, jobs: Jobs, tmp_path: Path) -> None:
    big = "b" * 200_000
    sent = jobs.enqueue("lc_quick", big)
    jobs.enqueue("lc_quick", "small")
    worker = Worker(lc_project, redis_url, tmp_path / "w", MAX_MESSAGE_BYTES="100000").start()
    try:
        wait_for(lambda: jobs.dones("small"), 30, "the small job to run")
        wait_for(lambda: jobs.client.zcard(f"{NS}:{QUEUE}.XQ"), 30, "a dead letter")
        assert not jobs.starts(big), "the big message never ran"
        stored = jobs.client.hget(f"{NS}:{QUEUE}.XQ.msgs",
                                  sent.options["redis_message_id"])
        assert stored is not None and len(stored) > 200_000
        assert json.loads(stored)["args"] == [big], "its body is kept as it was sent"
        records = [r for r in worker.records() if r.get("outcome") == "dead_letter"]
        assert len(records) == 1, records
        assert records[0]["actor"] == "lc_quick"
        assert records[0]["reason"].startswith("message of 200,"), records[0]
        assert records[0]["reason"].endswith("bytes is over MAX_MESSAGE_BYTES (100,000)")
        wait_for(lambda: counted(worker.metrics(), "dead_letter") == 1, 10, "one dead letter")
        listed = run_cli(lc_project, "dlq", "list", "--json", "--queue", QUEUE, env=worker.env)
        assert listed.returncode == 0, listed.stderr
        [letter] = json.loads(listed.stdout)
        assert letter["reason"] == records[0]["reason"], letter
        assert worker.stop(timeout=30) == 0, worker.log()[-3000:]
        assert not jobs.stranded()
    finally:
        worker.kill()
