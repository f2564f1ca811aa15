"""The console's job pages cost the same few Redis calls whatever waits: a page of the
waiting or delayed jobs of a queue holding 20,000 is as cheap as one holding 100 (counted
by a real redis-server's ``INFO commandstats``: calls sent and commands its scripts ran);
a filtered page reads a bounded window of the line, however long it is."""

from __future__ import annotations

import html
from typing import Any

import redis
from dramatiq import Message

from worker_runtime import layout
from worker_runtime.console.jobs import FILTER_WINDOW, JOB_FILTER_READS
from worker_runtime.console.pages import Console
from worker_runtime.console.paging import PAGE_SIZE

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


def test_a_filtered_page_of_jobs_reads_a_bounded_window(client: redis.Redis) -> None:
    """``find`` keeps the jobs whose actor, job id or redis id holds it (any case), among the
    first :data:`JOB_FILTER_READS` in line: as cheap at 30,000 waiting as at 12,000, and
    says it did not read them all."""
    console = Console(client, [QUEUE], None)
    costs, bodies = {}, {}
    params = {"queue": QUEUE, "find": "SEND_NOTIFICATION", "page": "3"}
    for total in (12_000, 30_000):
        client.flushall()
        fill(client, QUEUE, 5)
        odd: Message[Any] = Message(
            queue_name=QUEUE, actor_name="Send_Invoice", args=(), kwargs={}, options={}
        )
        client.hset(f"dramatiq:{QUEUE}.msgs", "redis-odd", odd.encode())
        client.rpush(f"dramatiq:{QUEUE}", "redis-odd")
        fill(client, QUEUE, total - 6)
        for sought in ("send_invoice", odd.message_id.upper(), "REDIS-ODD"):
            found = console.jobs({"queue": QUEUE, "find": sought})
            assert found.count(b"<tr><td") == 1 and b"Send_Invoice" in found, sought
        costs[total] = calls_of(client, lambda: console.jobs(params))
        bodies[total] = html.unescape(console.jobs(params).decode())
    assert costs[12_000] == costs[30_000], costs
    windows = -(-JOB_FILTER_READS // FILTER_WINDOW)
    assert costs[12_000] <= JOB_FILTER_READS + windows * 10, costs  # a body each, a few more
    for total, body in bodies.items():
        assert (
            f"{total} waiting on {QUEUE}; {JOB_FILTER_READS - 1} of them match "
            f"'SEND_NOTIFICATION' (of the first {JOB_FILTER_READS} read; narrow the search)"
        ) in body
        assert body.count("<tr><td") == PAGE_SIZE and ">152</td>" in body  # page 4: from 151
