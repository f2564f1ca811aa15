"""``dlq list|show|replay|purge`` of a baked service, against a real redis-server.

Dead letters are made the way the worker makes them: a message is enqueued by
Dramatiq's RedisBroker, fetched (moved to an acks set) and then moved to the
dead-letter zset and hash with its reason, as Dramatiq's nack and our
``recovery.dead_letter`` do.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

from bakery import PYTHON, free_port, package_of, project_env, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(bake: Callable[..., Path]) -> Path:
    return bake(database="none")


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def dlq(project: Path, redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = project_env(project, WORKER_POOL="interactive", REDIS_URL=redis_url)
    return run_cli(project, "dlq", *args, env=env)


def kill_letter(redis_url: str, queue: str, actor: str, *args: Any, reason: str | None = None,
                traceback: str | None = None) -> Message[Any]:
    """Enqueue a message, fetch it and dead-letter it; return it as stored in the dead letters."""
    broker = RedisBroker(url=redis_url)
    sent = broker.enqueue(Message(queue_name=queue, actor_name=actor, args=args, kwargs={},
                                  options={"retries": 4, "crashes": 1}))
    client: redis.Redis = broker.client
    redis_id = sent.options["redis_message_id"]
    assert client.lpop(f"dramatiq:{queue}") == redis_id.encode()
    options: dict[str, Any] = {}
    if reason is not None:
        options["dead_letter_reason"] = reason
    if traceback is not None:
        options["traceback"] = traceback
    dead = sent.copy(options=options)
    client.zadd(f"dramatiq:{queue}.XQ", {redis_id: int(time.time() * 1000)})
    client.hset(f"dramatiq:{queue}.XQ.msgs", redis_id, dead.encode())
    client.hdel(f"dramatiq:{queue}.msgs", redis_id)
    broker.close()
    time.sleep(0.002)  # distinct timestamps keep "oldest first" deterministic
    return dead


def test_list_shows_every_queues_dead_letters_with_their_reasons(project: Path,
                                                                redis_url: str) -> None:
    first = kill_letter(redis_url, "notifications", "send_notification", 7, "welcome", "n-1",
                        reason="ValueError: template 'welcome' is not defined")
    second = kill_letter(redis_url, "reports", "build_report", 3,
                         traceback="Traceback (most recent call last):\n  ...\nKeyError: 'q3'")
    third = kill_letter(redis_url, "notifications", "send_notification", 8, "bye", "n-2",
                        reason="its worker process died during 3 of 5 deliveries " + "x" * 80)

    table = dlq(project, redis_url, "list")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["QUEUE", "REDIS", "ID", "MESSAGE", "ID", "ACTOR", "DEAD", "SINCE",
                                "REASON"]
    rows = lines[1:4]
    for row, message in zip(rows, (first, second, third), strict=True):
        assert message.options["redis_message_id"] in row
        assert message.message_id in row
        assert message.actor_name in row
    assert "ValueError: template 'welcome' is not defined" in rows[0]
    assert "KeyError: 'q3'" in rows[1]
    assert rows[2].endswith("…") and "x" * 80 not in rows[2]
    assert lines[-1] == "3 dead letters"
    summary = lines[lines.index(
        "BY QUEUE, ACTOR, EXCEPTION AND REASON (numbers, ids and quoted values masked)") + 1:-2]
    assert summary[0].split() == ["COUNT", "QUEUE", "ACTOR", "EXCEPTION", "REASON"]
    assert [row.split()[:4] for row in summary[1:]] == [
        ["1", "notifications", "send_notification", "ValueError"],
        ["1", "reports", "build_report", "KeyError"],
        ["1", "notifications", "send_notification", "-"]]
    assert "template '…' is not defined" in summary[1]
    assert "its worker process died during <n> of <n> deliveries" in summary[3]

    only_reports = dlq(project, redis_url, "list", "--queue", "reports", "--json")
    entries = json.loads(only_reports.stdout)
    assert [entry["redis_id"] for entry in entries] == [second.options["redis_message_id"]]
    assert entries[0]["queue"] == "reports" and entries[0]["dead_since"].endswith("Z")

    limited = dlq(project, redis_url, "list", "--limit", "1")
    assert first.options["redis_message_id"] in limited.stdout
    assert third.options["redis_message_id"] not in limited.stdout
    assert limited.stdout.splitlines()[-1] == "1 of 3 dead letters"


def test_list_says_when_there_are_none(project: Path, redis_url: str) -> None:
    empty = dlq(project, redis_url, "list", "--queue", "payments")
    assert empty.returncode == 0
    assert empty.stdout.strip() == "no dead letters on payments"


def test_show_prints_the_whole_message(project: Path, redis_url: str) -> None:
    dead = kill_letter(redis_url, "payments", "charge", 42, reason="CardDeclined: 42",
                       traceback="Traceback (most recent call last):\nCardDeclined: 42")

    readable = dlq(project, redis_url, "show", dead.options["redis_message_id"])
    assert readable.returncode == 0, readable.stderr
    assert "reason:      CardDeclined: 42" in readable.stdout
    assert "traceback:\n  Traceback (most recent call last):\n  CardDeclined: 42\n" in (
        readable.stdout)
    assert '"args": [\n    42\n  ]' in readable.stdout and "\\n" not in readable.stdout

    shown = dlq(project, redis_url, "show", dead.options["redis_message_id"], "--json")
    assert shown.returncode == 0, shown.stderr
    body = json.loads(shown.stdout)
    assert body["queue"] == "payments"
    assert body["reason"] == "CardDeclined: 42"
    assert body["message"]["message_id"] == dead.message_id
    assert body["message"]["args"] == [42]
    assert body["message"]["options"]["traceback"].endswith("CardDeclined: 42")


def test_replay_sends_a_fresh_run_once_however_often_it_is_asked(project: Path, redis_url: str,
                                                                 client: redis.Redis) -> None:
    dead = kill_letter(redis_url, "notifications", "send_notification", 1, "t", "n-1",
                       reason="boom", traceback="Traceback ...\nRuntimeError: boom")
    kept = kill_letter(redis_url, "notifications", "send_notification", 2, "t", "n-2",
                       reason="boom")
    old_id = dead.options["redis_message_id"]

    dry = dlq(project, redis_url, "replay", old_id, "--dry-run")
    assert dry.returncode == 0 and "would replay 1 dead letter" in dry.stdout
    assert client.zcard("dramatiq:notifications.XQ") == 2

    replayed = dlq(project, redis_url, "replay", old_id)
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout.strip() == "replayed 1 dead letter"
    assert client.zrange("dramatiq:notifications.XQ", 0, -1) == [
        kept.options["redis_message_id"].encode()]
    assert not client.hexists("dramatiq:notifications.XQ.msgs", old_id)
    [new_id] = client.lrange("dramatiq:notifications", 0, -1)
    assert new_id.decode() != old_id
    fresh = Message.decode(client.hget("dramatiq:notifications.msgs", new_id))
    assert fresh.message_id == dead.message_id
    assert fresh.args == (1, "t", "n-1")
    assert fresh.queue_name == "notifications"
    assert fresh.options["redis_message_id"] == new_id.decode()
    assert fresh.options["retries"] == 0 and fresh.options["crashes"] == 0
    assert "dead_letter_reason" not in fresh.options and "traceback" not in fresh.options
    assert fresh.options["replays"] == 1

    again = dlq(project, redis_url, "replay", old_id)
    assert again.returncode == 1
    assert f"no dead letter {old_id!r}" in again.stderr
    assert client.llen("dramatiq:notifications") == 1


def test_concurrent_replays_neither_duplicate_nor_lose(project: Path, redis_url: str,
                                                       client: redis.Redis) -> None:
    letters = [kill_letter(redis_url, "reports", "build_report", n, reason="r")
               for n in range(40)]
    env = project_env(project, WORKER_POOL="interactive", REDIS_URL=redis_url)
    runs = [subprocess.Popen([PYTHON, "-m", package_of(project), "dlq", "replay", "--all",
                              "--yes"],
                             cwd=project, env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(3)]
    outputs = [run.communicate(timeout=60)[0] for run in runs]
    assert all(run.returncode == 0 for run in runs)
    moved = sum(int(output.split()[1]) for output in outputs)
    assert moved == len(letters)
    assert client.zcard("dramatiq:reports.XQ") == 0
    assert client.hlen("dramatiq:reports.XQ.msgs") == 0
    queued = client.lrange("dramatiq:reports", 0, -1)
    assert len(queued) == len(set(queued)) == len(letters)
    bodies = [Message.decode(body) for body in client.hvals("dramatiq:reports.msgs")]
    assert sorted(message.message_id for message in bodies) == sorted(
        message.message_id for message in letters)


def test_purge_refuses_without_yes_and_deletes_with_it(project: Path, redis_url: str,
                                                       client: redis.Redis) -> None:
    letters = [kill_letter(redis_url, "partner", "call_partner", n, reason="429")
               for n in range(3)]
    first_id = letters[0].options["redis_message_id"]

    refused = dlq(project, redis_url, "purge", "--all")
    assert refused.returncode == 2
    assert "refusing to delete 3 dead letters without --yes" in refused.stderr
    assert "nothing deleted" in refused.stderr
    assert client.zcard("dramatiq:partner.XQ") == 3
    assert client.hlen("dramatiq:partner.XQ.msgs") == 3

    one = dlq(project, redis_url, "purge", first_id, "--queue", "partner", "--yes")
    assert one.returncode == 0 and one.stdout.strip() == "purged 1 dead letter"
    assert client.zscore("dramatiq:partner.XQ", first_id) is None
    assert not client.hexists("dramatiq:partner.XQ.msgs", first_id)

    rest = dlq(project, redis_url, "purge", "--all", "--yes")
    assert rest.returncode == 0 and rest.stdout.strip() == "purged 2 dead letters"
    assert client.zcard("dramatiq:partner.XQ") == 0
    assert client.hlen("dramatiq:partner.XQ.msgs") == 0


def test_unknown_ids_are_refused_before_anything_moves(project: Path, redis_url: str,
                                                       client: redis.Redis) -> None:
    dead = kill_letter(redis_url, "notifications", "send_notification", 1, reason="x")
    for args in (("show", "no-such-id"),
                 ("replay", dead.options["redis_message_id"], "no-such-id"),
                 ("purge", "no-such-id", dead.options["redis_message_id"], "--yes")):
        result = dlq(project, redis_url, *args)
        assert result.returncode == 1, args
        assert result.stderr.strip().endswith(
            "no dead letter 'no-such-id' on queue(s) notifications, reports, partner, payments, "
            "untrusted (as a redis id or a job id)")
        assert "Traceback" not in result.stderr
    assert client.zcard("dramatiq:notifications.XQ") == 1
    assert client.llen("dramatiq:notifications") == 0

    unknown_queue = dlq(project, redis_url, "list", "--queue", "nope")
    assert unknown_queue.returncode == 1
    assert "queue 'nope' is not in pools.toml and has no dead letters" in unknown_queue.stderr


def test_usage_errors(project: Path, redis_url: str) -> None:
    for args in (("replay",), ("purge", "--yes"), ("replay", "--all", "some-id")):
        result = dlq(project, redis_url, *args)
        assert result.returncode == 2, args
        assert "give either --all or ids" in result.stderr


def test_redis_down_is_one_line_and_exit_1(project: Path) -> None:
    down = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    for args in (("list",), ("show", "x"), ("replay", "--all", "--yes"),
                 ("purge", "--all", "--yes")):
        result = dlq(project, down, *args)
        assert result.returncode == 1, args
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith(f"dlq {args[0]}: Redis at {down} is unreachable")
        assert result.stdout == ""


RECORDER = '''
"""Test actor: counts its runs in Redis, per key."""

import dramatiq

from ..broker import broker


@dramatiq.actor(queue_name="notifications", max_retries=0)
def record_run(key: str) -> None:
    broker.client.incr(f"runs:{key}")
'''


def test_a_replayed_message_runs_exactly_once(project: Path, redis_url: str,
                                              client: redis.Redis, tmp_path: Path) -> None:
    service = tmp_path / project.name
    shutil.copytree(project, service)
    actors = service / "src" / package_of(project) / "actors"
    (actors / "record_run.py").write_text(textwrap.dedent(RECORDER))
    kill_letter(redis_url, "notifications", "record_run", "a", reason="crashed 5 times")
    kill_letter(redis_url, "notifications", "record_run", "b", reason="crashed 5 times")

    refused = dlq(service, redis_url, "replay", "--all")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "refusing to replay 2 dead letters without --yes (nothing sent" in refused.stderr
    assert client.zcard("dramatiq:notifications.XQ") == 2
    assert dlq(service, redis_url, "replay", "--all", "--yes").stdout.strip() == (
        "replayed 2 dead letters")
    assert dlq(service, redis_url, "replay", "--all", "--yes").stdout.strip() == (
        "replayed 0 dead letters")

    env = project_env(service, WORKER_POOL="interactive", REDIS_URL=redis_url,
                      WORKER_STATE_DIR=str(tmp_path / "state"), METRICS_PORT=str(free_port()))
    worker = subprocess.Popen([PYTHON, "-m", package_of(service), "worker"], cwd=service,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and client.hlen("dramatiq:notifications.msgs"):
            time.sleep(0.05)
    finally:
        worker.send_signal(signal.SIGTERM)
        _, errors = worker.communicate(timeout=30)
    assert client.hlen("dramatiq:notifications.msgs") == 0, errors
    assert client.get("runs:a") == b"1" and client.get("runs:b") == b"1"
    assert client.zcard("dramatiq:notifications.XQ") == 0


def test_a_dead_letter_without_body_can_be_listed_and_purged_not_replayed(
        project: Path, redis_url: str, client: redis.Redis) -> None:
    client.zadd("dramatiq:reports.XQ", {"orphan": int(time.time() * 1000)})

    listed = json.loads(dlq(project, redis_url, "list", "--json").stdout)
    assert [(entry["redis_id"], entry["reason"]) for entry in listed] == [
        ("orphan", "(body missing)")]
    replayed = dlq(project, redis_url, "replay", "orphan")
    assert replayed.returncode == 1
    assert replayed.stderr.strip() == "dlq replay: dead letter 'orphan' has no body; purge it"
    assert client.llen("dramatiq:reports") == 0
    purged = dlq(project, redis_url, "purge", "orphan", "--yes")
    assert purged.returncode == 0 and client.zcard("dramatiq:reports.XQ") == 0


def plant(client: redis.Redis, queue: str, count: int, start_ms: int, actor: str, reason: str,
          prefix: str) -> list[str]:
    """``count`` dead letters of ``queue`` written straight into Redis (one pipeline), one
    ms apart from ``start_ms``; returns their redis ids, oldest first."""
    ids = [f"{prefix}-{index:05d}" for index in range(count)]
    pipe = client.pipeline(transaction=False)
    for index, redis_id in enumerate(ids):
        body = Message(queue_name=queue, actor_name=actor, args=(index,), kwargs={},
                       options={"redis_message_id": redis_id, "dead_letter_reason": reason})
        pipe.zadd(f"dramatiq:{queue}.XQ", {redis_id: start_ms + index})
        pipe.hset(f"dramatiq:{queue}.XQ.msgs", redis_id, body.encode())
    pipe.execute()
    return ids


def test_more_than_a_page_is_listed_merged_summarised_replayed_and_purged(
        project: Path, redis_url: str, client: redis.Redis) -> None:
    now = int(time.time() * 1000)
    # 2 x 700 letters interleaved in time across two queues (a page is 500), one not a message.
    early = plant(client, "reports", 700, now - 10_000, "build_report", "KeyError: 'q3'", "r")
    late = plant(client, "partner", 700, now - 10_000, "call_partner", "429", "p")
    client.hset("dramatiq:partner.XQ.msgs", late[10], b"not json")

    listed = dlq(project, redis_url, "list", "--limit", "4")
    lines = listed.stdout.splitlines()
    assert [line.split()[1] for line in lines[1:5]] == [late[0], early[0], late[1], early[1]]
    assert lines[-1] == "4 of 1,400 dead letters"
    summary = lines[lines.index(
        "BY QUEUE, ACTOR, EXCEPTION AND REASON (numbers, ids and quoted values masked)") + 2:-2]
    assert [row.split()[:3] for row in summary] == [
        ["700", "reports", "build_report"], ["699", "partner", "call_partner"],
        ["1", "partner", "-"]]

    streamed = json.loads(dlq(project, redis_url, "list", "--json").stdout)
    assert len(streamed) == 1_400
    assert [entry["dead_since_ms"] for entry in streamed] == sorted(
        entry["dead_since_ms"] for entry in streamed)

    replayed = dlq(project, redis_url, "replay", "--all", "--yes")
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout.strip() == (
        "replayed 1399 dead letters; skipped 1 that cannot run (purge them)")
    assert f"dead letter {late[10]!r} is not a Dramatiq message" in replayed.stderr
    assert client.llen("dramatiq:reports") == 700 and client.llen("dramatiq:partner") == 699
    assert client.zrange("dramatiq:partner.XQ", 0, -1) == [late[10].encode()]

    purged = dlq(project, redis_url, "purge", "--all", "--yes")
    assert purged.stdout.strip() == "purged 1 dead letter"
    assert client.zcard("dramatiq:partner.XQ") == 0 == client.hlen("dramatiq:partner.XQ.msgs")


def test_show_and_replay_take_the_job_id_the_logs_print(project: Path, redis_url: str,
                                                        client: redis.Redis) -> None:
    """The job id every log line prints is the message_id, not the redis id the dead
    letters are kept under: ``dlq show`` and ``replay`` take either."""
    dead = kill_letter(redis_url, "notifications", "send_notification", 7, "welcome", "n-1",
                       reason="ValueError: template 'welcome' is not defined")
    other = kill_letter(redis_url, "notifications", "send_notification", 8, "bye", "n-2",
                        reason="ValueError: template 'bye' is not defined")
    redis_id = dead.options["redis_message_id"]
    assert dead.message_id != redis_id
    for job_id in (dead.message_id, redis_id):
        shown = dlq(project, redis_url, "show", job_id, "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["redis_id"] == redis_id

    replayed = dlq(project, redis_url, "replay", dead.message_id)
    assert replayed.returncode == 0 and replayed.stdout.strip() == "replayed 1 dead letter"
    [new_id] = client.lrange("dramatiq:notifications", 0, -1)
    assert Message.decode(client.hget("dramatiq:notifications.msgs", new_id)).message_id == (
        dead.message_id)
    assert client.zrange("dramatiq:notifications.XQ", 0, -1) == [
        other.options["redis_message_id"].encode()]

    # A job that is queued (the message index knows it) is said not to be dead.
    live = Message(queue_name="notifications", actor_name="send_notification", args=(9,),
                   kwargs={}, options={})
    client.hset("dramatiq:__where__", live.message_id, "dramatiq:notifications.msgs x")
    again = dlq(project, redis_url, "show", live.message_id)
    assert again.returncode == 1
    assert again.stderr.strip() == (
        f"dlq show: job {live.message_id!r} is not a dead letter: it is queued, delayed or "
        "running (see `status`)")


def test_the_summary_groups_one_failure_of_many_jobs_in_one_row(project: Path,
                                                               redis_url: str) -> None:
    for number in range(5):
        kill_letter(redis_url, "reports", "build_report", number,
                    traceback=f"Traceback...\nKeyError: 'q{number}' (report {1000 + number}, "
                    f"id 3f2a9c1e-0b7d-4d43-9c55-2b1f7c9e0a1{number})")
    kill_letter(redis_url, "reports", "build_report", 9,
                traceback="Traceback...\nValueError: report 9 has no rows")
    table = dlq(project, redis_url, "list", "--queue", "reports")
    lines = table.stdout.splitlines()
    start = lines.index(
        "BY QUEUE, ACTOR, EXCEPTION AND REASON (numbers, ids and quoted values masked)")
    rows = [line.split(None, 4) for line in lines[start + 2:-2]]
    assert rows == [
        ["5", "reports", "build_report", "KeyError", "'…' (report <n>, id <id>)"],
        ["1", "reports", "build_report", "ValueError", "report <n> has no rows"]], lines
