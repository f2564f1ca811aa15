"""Dead-letter reads against a real Redis, with a concurrent ``dlq replay`` between two reads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from worker_runtime import layout
from worker_runtime.deadletters import store as dlq

QUEUE = "reports"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    zset, bodies = layout.dead_letter_keys(QUEUE)
    client.zadd(zset, {"taken": 1, "kept": 2, "bodiless": 3})
    client.hset(bodies, mapping={"taken": b"{}", "kept": b"{}"})
    yield client
    client.close()


def take_before(client: redis.Redis, command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make another replayer move the letter ``taken`` just before ``command`` runs."""
    zset, bodies = layout.dead_letter_keys(QUEUE)
    real = getattr(client, command)

    def taken_then_run(*args: Any) -> Any:
        client.zrem(zset, "taken")
        client.hdel(bodies, "taken")
        return real(*args)

    monkeypatch.setattr(client, command, taken_then_run)


def test_a_letter_replayed_between_the_reads_is_not_listed(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    take_before(client, "hmget", monkeypatch)
    letters = dlq.dead_letters(client, QUEUE)
    assert [letter.redis_id for letter in letters] == ["kept", "bodiless"]
    assert letters[1].reason == "(body missing)"


def test_a_letter_replayed_between_the_reads_is_not_found(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    take_before(client, "hget", monkeypatch)
    with pytest.raises(dlq.DeadLetterError, match="no dead letter 'taken'"):
        dlq.find(client, [QUEUE], "taken")
    assert dlq.find(client, [QUEUE], "bodiless").body is None
