"""Dead letters are kept ``DLQ_RETENTION_DAYS`` days (default 14), and the ``dlq`` commands
need only ``REDIS_URL``: real worker processes and a real redis-server, dead letters aged
by their score (the time they died, ms) as the worker itself records it."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from _lifecycle import Worker, lc_project, wait_for, workers
from bakery import project_env, run_cli

pytestmark = pytest.mark.slow
__all__ = ["lc_project", "workers"]
DAY_MS = 86_400_000
XQ = "dramatiq:notifications.XQ"


def bury_aged(client: redis.Redis, redis_id: str, days: float) -> None:
    """A dead letter that died ``days`` ago."""
    died = int(time.time() * 1000 - days * DAY_MS)
    client.zadd(XQ, {redis_id: died})
    client.hset(f"{XQ}.msgs", redis_id, b'{"not": "a message"}')


def kept(client: redis.Redis) -> set[str]:
    return {raw.decode() for raw in client.zrange(XQ, 0, -1)}


def test_worker_deletes_dead_letters_older_than_the_retention(
        workers: Callable[..., Worker], redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    bury_aged(client, "fifteen-days", 15)
    bury_aged(client, "thirteen-days", 13)
    bury_aged(client, "one-hour", 1 / 24)
    worker = workers(WORKER_HEARTBEAT_TIMEOUT_MS="2000")  # a recovery pass every 0.4 s
    wait_for(lambda: "fifteen-days" not in kept(client), 20, "the 15-day-old letter to go")
    time.sleep(1.0)  # two more passes
    assert kept(client) == {"thirteen-days", "one-hour"}, "the default keeps 14 days"
    assert not client.hexists(f"{XQ}.msgs", "fifteen-days"), "its body goes with it"
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0

    shorter = workers(WORKER_HEARTBEAT_TIMEOUT_MS="2000", DLQ_RETENTION_DAYS="10")
    wait_for(lambda: kept(client) == {"one-hour"}, 20, "the 13-day-old letter to go")
    shorter.signal(signal.SIGTERM)
    assert shorter.wait(timeout=30) == 0


def test_retention_below_one_day_refuses_to_boot(lc_project: Path) -> None:
    env = project_env(lc_project, WORKER_POOL="interactive", DLQ_RETENTION_DAYS="0")
    done = run_cli(lc_project, "config", env=env)
    assert done.returncode == 78
    assert "DLQ_RETENTION_DAYS='0': Input should be greater than or equal to 1" in done.stderr


def test_dlq_commands_need_only_redis_url(lc_project: Path, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    bury_aged(client, "r-1", 1)
    env = {name: value for name, value in project_env(lc_project, REDIS_URL=redis_url).items()
           if not name.startswith("WORKER_")}  # no WORKER_* variable at all
    assert not any(name.startswith("WORKER_") for name in env)
    listed = run_cli(lc_project, "dlq", "list", "--queue", "notifications", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "r-1" in listed.stdout
    purged = run_cli(lc_project, "dlq", "purge", "r-1", "--yes", env=env)
    assert purged.returncode == 0, purged.stderr
    assert not kept(client)
    bad = run_cli(lc_project, "dlq", "list", env={**env, "REDIS_URL": "http://nope"})
    assert bad.returncode == 78
    assert bad.stderr.strip() == ("config error: REDIS_URL='http://nope': must start with "
                                  "redis://, rediss://, unix:// or redis+sentinel://")
