"""The backlog the exporter publishes: a message's wait counts from when it became due (a
delayed or retried message from its ``eta``), and the scheduler's copy names each pool."""

from __future__ import annotations

import json

import redis
from prometheus_client import CollectorRegistry, generate_latest

from worker_runtime import layout
from worker_runtime.backlog import due_ms, read_backlog
from worker_runtime.exporter import POOL_SERIES_LABEL, BacklogCollector

NOW_S = 1_900_000_000.0


def enqueue(client: redis.Redis, queue: str, message_id: str, body: dict[str, object]) -> None:
    client.rpush(layout.queue_key(queue), message_id)
    client.hset(layout.bodies_key(queue), message_id, json.dumps(body))


def test_a_delayed_message_waits_from_its_eta_not_from_its_sending(client: redis.Redis) -> None:
    """Sent 25 s ago with a 25 s delay and due 0.5 s ago: it waited 0.5 s (from its sending
    it read 25.5 s, and the critical pool, target 2 s, scaled to its cap)."""
    sent_ms, eta_ms = (NOW_S - 25.5) * 1000, (NOW_S - 0.5) * 1000
    enqueue(client, "q", "m1", {"message_timestamp": sent_ms, "options": {"eta": eta_ms}})
    (backlog,) = read_backlog(client, ["q"], now=NOW_S)
    assert abs(backlog.oldest_s - 0.5) < 1e-6


def test_a_message_without_eta_waits_from_its_sending(client: redis.Redis) -> None:
    enqueue(client, "q", "m1", {"message_timestamp": (NOW_S - 7) * 1000, "options": {}})
    (backlog,) = read_backlog(client, ["q"], now=NOW_S)
    assert abs(backlog.oldest_s - 7) < 1e-6


def test_due_is_the_later_of_sending_and_eta_and_ignores_junk() -> None:
    assert due_ms({"message_timestamp": 10, "options": {"eta": 20}}) == 20
    assert due_ms({"message_timestamp": 30, "options": {"eta": 20}}) == 30
    assert due_ms({"message_timestamp": 10, "options": {"eta": "soon"}}) == 10
    assert due_ms({"options": {"eta": True}}) is None


def test_the_schedulers_copy_labels_every_series_with_its_pool(client: redis.Redis) -> None:
    enqueue(client, "notifications", "m1", {"message_timestamp": 1, "options": {}})
    registry = CollectorRegistry()
    registry.register(
        BacklogCollector(
            client,
            ["notifications", "reports"],
            {"notifications": "interactive", "reports": "big_jobs"},
        )
    )
    text = generate_latest(registry).decode()
    ready = 'queue="notifications",' + POOL_SERIES_LABEL + '="interactive"'
    delayed = 'queue="reports.DQ",' + POOL_SERIES_LABEL + '="big-jobs"'
    assert "queue_depth{" + ready + "} 1.0" in text
    assert "queue_depth{" + delayed + "} 0.0" in text
    # No worker process: the waiting queue is unserved, the empty one is not.
    assert "queue_consumers{" + ready + "} 0.0" in text
    assert "queue_unserved{" + ready + "} 1.0" in text
    assert 'queue_unserved{queue="reports",' + POOL_SERIES_LABEL + '="big-jobs"} 0.0' in text
    lines = [line for line in text.splitlines() if line.startswith("queue_")]
    assert len(lines) == 14 and all(POOL_SERIES_LABEL in line for line in lines)
