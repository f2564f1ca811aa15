"""The Redis idempotency helpers against a real Redis (the database one: test_db.py)."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import redis.client

from worker_runtime import idempotency


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def test_effect_runs_once_and_its_redis_writes_commit_with_the_done_mark(
    client: redis.Redis,
) -> None:
    def effect(tx: redis.client.Pipeline) -> None:
        tx.rpush("effects", "k")

    assert idempotency.once_with_lease("k", effect, client=client)
    assert not idempotency.once_with_lease("k", effect, client=client)
    assert client.lrange("effects", 0, -1) == [b"k"]
    assert idempotency.is_done("k", client=client)
    assert not client.exists(idempotency.lease_key("k"))


def test_failed_effect_leaves_the_key_undone_and_the_lease_free(client: redis.Redis) -> None:
    def failing(tx: redis.client.Pipeline) -> None:
        tx.rpush("effects", "never")
        raise RuntimeError("partner down")

    with pytest.raises(RuntimeError, match="partner down"):
        idempotency.once_with_lease("k", failing, client=client)
    assert not idempotency.is_done("k", client=client)
    assert not client.exists(idempotency.lease_key("k"), "effects")
    assert idempotency.once_with_lease("k", lambda tx: tx.rpush("effects", "k"), client=client)


def test_lease_of_a_dead_holder_delays_the_next_delivery_until_it_expires(
    client: redis.Redis,
) -> None:
    client.set(idempotency.done_key("k"), "dead-token")
    client.set(idempotency.lease_key("k"), "dead-token", px=500)
    started = time.monotonic()
    assert idempotency.once_with_lease(
        "k", lambda tx: tx.rpush("effects", "k"), lease_s=2, client=client
    )
    assert 0.4 <= time.monotonic() - started < 2
    assert client.lrange("effects", 0, -1) == [b"k"]


def test_lease_is_renewed_while_a_long_effect_runs(client: redis.Redis) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(tx: redis.client.Pipeline) -> None:
        entered.set()
        release.wait(5)
        tx.rpush("effects", "slow")

    holder = threading.Thread(
        target=idempotency.once_with_lease,
        args=("k", slow),
        kwargs={"lease_s": 0.3, "client": client},
    )
    holder.start()
    entered.wait(5)
    time.sleep(0.9)  # three lease lengths: only renewals keep it
    with pytest.raises(idempotency.LeaseBusyError):
        idempotency.once_with_lease(
            "k", lambda tx: tx.rpush("effects", "dup"), lease_s=0.3, client=client
        )
    release.set()
    holder.join(5)
    assert client.lrange("effects", 0, -1) == [b"slow"]


def test_at_most_once_says_so_and_marks_before(client: redis.Redis) -> None:
    assert idempotency.at_most_once("k", client=client)
    assert not idempotency.at_most_once("k", client=client)
    assert idempotency.is_done("k", client=client)
