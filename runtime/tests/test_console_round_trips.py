"""The console's job pages cost the same few Redis calls whatever waits: a page of the
waiting or delayed jobs of a queue holding 20,000 is as cheap as one holding 100 (counted
by a real redis-server's ``INFO commandstats``: calls sent and commands its scripts ran)."""

from __future__ import annotations

from typing import Any

import redis
from dramatiq import Message

from worker_runtime import layout
from worker_runtime.console.pages import PAGE_SIZE, Console

QUEUE = "notifications"
#: Redis's own calls in a counted window: the CONFIG RESETSTAT and our INFO.
OURS = {"config|resetstat", "info"}


def fill(client: redis.Redis, queue: str, count: int) -> None:
    """``count`` messages on ``queue`` as Dramatiq's RedisBroker enqueues them, pipelined."""
    pipe = client.pipeline(transaction=False)
    for index in range(count):
        message: Message[Any] = Message(
            queue_name=queue,
            actor_name="send_notification",
            args=(index,),
            kwargs={},
            options={},
        )
        pipe.hset(f"dramatiq:{queue}.msgs", message.message_id, message.encode())
        pipe.rpush(f"dramatiq:{queue}", message.message_id)
        if index % 10_000 == 9_999:
            pipe.execute()
    pipe.execute()


def calls_of(client: redis.Redis, page: Any) -> int:
    """The commands Redis ran (sent, and run inside scripts) while ``page()`` was built."""
    client.config_resetstat()
    body = page()
    assert b"<table>" in body
    stats: dict[str, Any] = client.info("commandstats")
    return sum(
        int(stat["calls"])
        for name, stat in stats.items()
        if name.removeprefix("cmdstat_") not in OURS
    )


def test_a_page_of_jobs_costs_the_same_at_100_and_at_20000(client: redis.Redis) -> None:
    console = Console(client, [QUEUE], None)
    costs = {}
    for total in (100, 20_000):
        client.flushall()
        fill(client, QUEUE, total)
        fill(client, layout.delay_queue(QUEUE), 100)
        costs[total] = (
            calls_of(client, lambda: console.jobs({"queue": QUEUE, "page": "1"})),
            calls_of(client, lambda: console.jobs({"queue": QUEUE, "kind": "delayed"})),
        )
    assert costs[100] == costs[20_000], costs
    # One script call a page: the page's ids and their bodies, and a few lengths.
    assert costs[100][0] <= PAGE_SIZE + 10, costs
