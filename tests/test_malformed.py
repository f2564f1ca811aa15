"""Malformed messages: each is dead-lettered at once with a reason and counted; none holds others.

Every shape of issue #9 is pushed straight into Redis (as a buggy or foreign
producer would) between good messages, before the worker starts, so the bad ones
are fetched in the same batches as the good ones. The good ones all complete; each
bad one is in the dead letters with the reason ``dlq list`` shows, counted as
``jobs_processed_total{outcome="dead_letter"}`` and logged; no acks set holds anything.
Recovery (another worker's heartbeat recovery) meets an undecodable body held by a
dead worker: it dead-letters it with a reason and goes on recovering the others.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from _lifecycle import NS, QUEUE, Jobs, Worker, jobs, lc_project, wait_for, workers
from bakery import run_cli

pytestmark = pytest.mark.slow
__all__ = ["jobs", "lc_project", "workers"]


def good_fields(job_id: str, redis_id: str, actor: str = "lc_quick") -> dict[str, Any]:
    return {
        "queue_name": QUEUE, "actor_name": actor, "args": [job_id], "kwargs": {},
        "options": {"redis_message_id": redis_id}, "message_id": str(uuid.uuid4()),
        "message_timestamp": int(time.time() * 1000),
    }


def shape(name: str, redis_id: str) -> bytes:
    """The body of malformed shape ``name`` stored under ``redis_id``."""
    fields = good_fields(f"bad-{name}", redis_id)
    if name == "not_json":
        return b"\x80not json {"
    if name == "json_list":
        return json.dumps([fields]).encode()
    if name == "no_actor_name":
        del fields["actor_name"]
    elif name == "options_null":
        fields["options"] = None
    elif name == "no_redis_message_id":
        fields["options"] = {}
    elif name == "unknown_actor":
        fields["actor_name"] = "no_such_actor"
    elif name == "other_queue":
        fields["queue_name"] = "reports"
    elif name == "kwargs_list":
        fields["kwargs"] = []
    elif name == "retries_text":
        fields["options"]["retries"] = "many"
    return json.dumps(fields).encode()


#: shape -> a word its dead-letter reason must contain.
SHAPES = {
    "not_json": "not JSON", "json_list": "JSON list", "no_actor_name": "no actor_name",
    "options_null": "options is null", "no_redis_message_id": "redis_message_id",
    "unknown_actor": "unknown actor 'no_such_actor'", "other_queue": "queue_name 'reports'",
    "kwargs_list": "kwargs is []", "retries_text": "options.retries",
}


def push_raw(jobs: Jobs, body: bytes) -> str:
    redis_id = str(uuid.uuid4())
    jobs.client.hset(f"{NS}:{QUEUE}.msgs", redis_id, body)
    jobs.client.rpush(f"{NS}:{QUEUE}", redis_id)
    return redis_id


def counted(text: str, outcome: str, actor: str | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("jobs_processed_total{") and f'outcome="{outcome}"' in line:
            if actor is None or f'actor="{actor}"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def dlq_list(worker: Worker) -> list[dict[str, Any]]:
    result = run_cli(worker.project, "dlq", "list", "--json", "--queue", QUEUE, env=worker.env)
    assert result.returncode == 0, result.stderr
    listed: list[dict[str, Any]] = json.loads(result.stdout)
    return listed


def test_every_malformed_shape_is_dead_lettered_with_a_reason_and_good_ones_complete(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    good, bad = [], {}
    for index, name in enumerate(SHAPES):
        for n in range(2):
            job_id = f"g{index}-{n}"
            jobs.enqueue("lc_quick", job_id)
            good.append(job_id)
        redis_id = str(uuid.uuid4())
        jobs.client.hset(f"{NS}:{QUEUE}.msgs", redis_id, shape(name, redis_id))
        jobs.client.rpush(f"{NS}:{QUEUE}", redis_id)
        bad[redis_id] = name
    worker = workers(WORKER_CONCURRENCY="4")

    wait_for(lambda: jobs.done_count() == len(good), 30, "every good job to complete")
    wait_for(lambda: jobs.client.zcard(f"{NS}:{QUEUE}.XQ") == len(bad), 10,
             "every malformed message to be dead-lettered")
    # A job records its end before its settlement: wait for the last settlements.
    wait_for(lambda: not jobs.stranded(), 10, "nothing held in an acks set")
    assert not jobs.client.llen(f"{NS}:{QUEUE}"), "nothing left queued"
    assert not [key for key in jobs.client.scan_iter(match="test:start:bad-*")], "none ran"

    listed = {entry["redis_id"]: entry for entry in dlq_list(worker)}
    assert set(listed) == set(bad)
    for redis_id, name in bad.items():
        reason = listed[redis_id]["reason"]
        assert reason.startswith("malformed message: ") and SHAPES[name] in reason, (name, reason)
    assert listed[next(r for r, n in bad.items() if n == "unknown_actor")]["actor"] == (
        "no_such_actor")

    text = wait_for(lambda: next((t for t in [worker.metrics()]
                                  if counted(t, "dead_letter") == len(bad)), None),
                    10, "the dead letters to be counted")
    assert counted(text, "success") == len(good)
    # Labelled by actor when it names a declared one, else "unknown" (a bounded label set).
    assert counted(text, "dead_letter", actor="unknown") == 4, text
    lines = worker.records()
    logged = {line.get("redis_id"): line for line in lines if line.get("outcome") == "dead_letter"}
    assert set(logged) == set(bad)
    assert all(logged[r]["reason"] == listed[r]["reason"] for r in bad)
    assert not [line for line in lines if line["level"] in {"error", "critical"}], "no thread died"

    # A replay sends what decodes (the unknown actor) and refuses what is not a message.
    unknown = next(r for r, n in bad.items() if n == "unknown_actor")
    not_json = next(r for r, n in bad.items() if n == "not_json")
    assert run_cli(worker.project, "dlq", "replay", unknown, "--queue", QUEUE,
                   env=worker.env).returncode == 0
    refused = run_cli(worker.project, "dlq", "replay", not_json, "--queue", QUEUE, env=worker.env)
    assert refused.returncode == 1 and "purge it" in refused.stderr + refused.stdout


def test_recovery_dead_letters_an_undecodable_message_of_a_dead_worker_and_goes_on(
        workers: Callable[..., Worker], jobs: Jobs) -> None:
    dead_worker = "dead-" + str(uuid.uuid4())
    acks = f"{NS}:__acks__.{dead_worker}.{QUEUE}"
    held = {}
    for name in ("not_json", "json_list", "options_null"):
        redis_id = str(uuid.uuid4())
        jobs.client.hset(f"{NS}:{QUEUE}.msgs", redis_id, shape(name, redis_id))
        held[redis_id] = name
    good = []
    for index in range(3):
        redis_id = str(uuid.uuid4())
        jobs.client.hset(f"{NS}:{QUEUE}.msgs", redis_id,
                         json.dumps(good_fields(f"held{index}", redis_id)))
        good.append(redis_id)
    jobs.client.sadd(acks, *held, *good)
    jobs.client.zadd(f"{NS}:__heartbeats__", {dead_worker: 1000})

    worker = workers(WORKER_HEARTBEAT_TIMEOUT_MS="2000")
    wait_for(lambda: jobs.done_count() == 3, 30, "the dead worker's good messages to run")
    wait_for(lambda: jobs.client.zcard(f"{NS}:{QUEUE}.XQ") == 3, 10, "the bad ones dead-lettered")
    assert not jobs.client.exists(acks)
    listed = {entry["redis_id"]: entry["reason"] for entry in dlq_list(worker)}
    assert set(listed) == set(held)
    assert all(re.match("malformed message: ", reason) for reason in listed.values()), listed
    # The recovery thread lives on: a second dead worker's message is recovered too.
    later = "dead-" + str(uuid.uuid4())
    redis_id = str(uuid.uuid4())
    jobs.client.hset(f"{NS}:{QUEUE}.msgs", redis_id, json.dumps(good_fields("later", redis_id)))
    jobs.client.sadd(f"{NS}:__acks__.{later}.{QUEUE}", redis_id)
    jobs.client.zadd(f"{NS}:__heartbeats__", {later: 1000})
    wait_for(lambda: jobs.dones("later"), 20, "the later dead worker's message to run")
