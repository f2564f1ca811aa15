"""SIGKILL chaos: 2,000 jobs, each recording a side effect, on 2 worker processes of which at
least 10 are SIGKILLed at random moments.

Delivery is at least once: a process killed after a job's side effect and before its ack
has the job delivered again. Without an idempotency helper the side effect then happens
twice (the test shows duplicates); with the helper it happens exactly once, none lost:

* Redis: :func:`idempotency.once_with_lease`, the side effect a write queued on the
  transaction that also marks the key done, counted in Redis;
* PostgreSQL: :func:`idempotency.once_in_transaction`, the side effect an insert in the
  transaction that records the key, counted in the database.

Each job records its side effect first, then works a little longer (``JOB_S``), so kills
land between the side effect and the ack as they do in production, only more often.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from _lifecycle import Worker, wait_for
from bakery import DATABASE_POOL, DATABASE_QUEUE, TEST_DATABASE_URL, copy_project
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

pytestmark = pytest.mark.slow
JOBS = 2000
KILLS = 10
JOB_S = 0.01
#: How long a worker process works before it may be killed (it fetches first).
WARM_S = 0.3
QUEUE = DATABASE_QUEUE  # a pool that uses PostgreSQL runs both stores

CHAOS_ACTORS = '''\
"""Chaos-test actors: each records one side effect per delivery (plain) or per job (once)."""

from __future__ import annotations

import os
import time
from typing import Any

import dramatiq
import redis

from .. import db
from worker_runtime.idempotency import once_in_transaction, once_with_lease

RUN = os.environ.get("CHAOS_RUN", "none")
JOB_S = float(os.environ.get("CHAOS_JOB_S", "0.02"))
_client = redis.Redis.from_url(os.environ["REDIS_URL"])
EFFECTS = f"chaos:{RUN}:effects"
TABLE = f"chaos_{RUN}"
OPTIONS: dict[str, Any] = {"queue_name": "QUEUE", "max_retries": 20,
                           "min_backoff": 10, "max_backoff": 100}


def _insert(conn: Any, job_id: str) -> None:
    conn.execute(f"insert into {TABLE} (job_id) values (%s)", (job_id,))


@dramatiq.actor(**OPTIONS)
def chaos_redis_plain(job_id: str) -> None:
    _client.rpush(EFFECTS, job_id)
    time.sleep(JOB_S)


@dramatiq.actor(**OPTIONS)
def chaos_redis_once(job_id: str) -> None:
    once_with_lease(f"chaos:{RUN}:{job_id}", lambda tx: tx.rpush(EFFECTS, job_id), lease_s=1.0)
    time.sleep(JOB_S)


@dramatiq.actor(**OPTIONS)
def chaos_db_plain(job_id: str) -> None:
    with db.connection() as conn:
        _insert(conn, job_id)
    time.sleep(JOB_S)


@dramatiq.actor(**OPTIONS)
def chaos_db_once(job_id: str) -> None:
    once_in_transaction(f"chaos:{RUN}:{job_id}", lambda conn: _insert(conn, job_id))
    time.sleep(JOB_S)
'''


@pytest.fixture(scope="module")
def chaos_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default bake (database option on) with the chaos actors."""
    base = bake()
    return copy_project(base, tmp_path_factory.mktemp("chaos") / base.name,
                        chaos_test=CHAOS_ACTORS.replace('"QUEUE"', repr(QUEUE)))


class Effects:
    """Where a run's side effects are recorded: a Redis list or a PostgreSQL table."""

    def __init__(self, store: str, run: str, redis_url: str) -> None:
        self.store, self.run = store, run
        self.client = redis.Redis.from_url(redis_url)
        self.table = f"chaos_{run}"
        if store == "db":
            with psycopg.connect(TEST_DATABASE_URL, autocommit=True) as conn:
                conn.execute(f"create table {self.table} (job_id text not null)")

    def counts(self) -> Counter[str]:
        if self.store == "redis":
            raw = self.client.lrange(f"chaos:{self.run}:effects", 0, -1)
            return Counter(item.decode() for item in raw)
        with psycopg.connect(TEST_DATABASE_URL) as conn:
            rows = conn.execute(
                f"select job_id, count(*) from {self.table} group by job_id"  # noqa: S608
            ).fetchall()
        return Counter({job_id: int(count) for job_id, count in rows})

    def close(self) -> None:
        self.client.close()
        if self.store == "db":
            with psycopg.connect(TEST_DATABASE_URL, autocommit=True) as conn:
                conn.execute(f"drop table if exists {self.table}")
                conn.execute("delete from idempotency_keys where key like %s",
                             (f"chaos:{self.run}:%",))


@pytest.fixture
def chaos(chaos_project: Path, redis_url: str,
          tmp_path: Path) -> Iterator[Callable[[str], dict[str, dict[str, int]]]]:
    """``chaos(store)``: one worker run of ``JOBS`` jobs with the helper and ``JOBS`` without,
    interleaved, under ``KILLS`` SIGKILLs; returns the counts of each half."""
    started: list[Worker] = []
    stores: list[Effects] = []

    def _run(store: str) -> dict[str, dict[str, int]]:
        run = uuid.uuid4().hex[:10]
        effects = Effects(store, run, redis_url)
        stores.append(effects)
        broker = RedisBroker(url=redis_url)
        halves = {"with": [f"once{n}" for n in range(JOBS)],
                  "without": [f"plain{n}" for n in range(JOBS)]}
        for once_id, plain_id in zip(halves["with"], halves["without"], strict=True):
            for actor, job_id in ((f"chaos_{store}_once", once_id),
                                  (f"chaos_{store}_plain", plain_id)):
                broker.enqueue(Message(queue_name=QUEUE, actor_name=actor, args=(job_id,),
                                       kwargs={}, options={}))
        broker.close()
        worker = Worker(chaos_project, redis_url, tmp_path / store,
                        WORKER_POOL=DATABASE_POOL, WORKER_PROCESSES="2", WORKER_CONCURRENCY="8",
                        WORKER_MAX_ATTEMPTS="20",
                        WORKER_HEARTBEAT_TIMEOUT_MS="2000", DATABASE_URL=TEST_DATABASE_URL,
                        # The pool's partner rate (50/s) would run the jobs one at a time,
                        # each process mostly holding none when killed: kills must find work.
                        DOWNSTREAM_PARTNER_API_RATE="100000/s",
                        CHAOS_RUN=run, CHAOS_JOB_S=str(JOB_S))
        started.append(worker)
        began = time.monotonic()
        worker.start()

        seed = random.randrange(2**32)
        rng = random.Random(seed)
        boards = worker.state_dir / "progress"
        booted_at: dict[int, float] = {}
        kills = 0
        while kills < KILLS:
            time.sleep(rng.uniform(0.05, 0.3))
            assert len(effects.counts()) < 2 * JOBS, (
                f"every job ran before {KILLS} kills (only {kills}; seed {seed})")
            now = time.monotonic()
            for pid in worker.children():
                if pid not in booted_at and (boards / f"{pid}.bin").exists():
                    booted_at[pid] = now
            # A process that booted a moment ago has fetched nothing yet: kill working ones.
            working = [pid for pid in worker.children() if now - booted_at.get(pid, now) > WARM_S]
            if working:
                os.kill(rng.choice(working), signal.SIGKILL)
                kills += 1

        client = effects.client

        def settled() -> bool:
            return (len(effects.counts()) == 2 * JOBS and not client.llen(f"dramatiq:{QUEUE}")
                    and not client.hlen(f"dramatiq:{QUEUE}.msgs")
                    and not client.hlen(f"dramatiq:{QUEUE}.DQ.msgs"))

        wait_for(settled, 180, f"every job to finish (seed {seed})", step=0.2)
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, worker.log()[-3000:]
        counts = effects.counts()
        common = {
            "kills": kills, "seed": seed, "elapsed_s": round(time.monotonic() - began, 1),
            "dead_letters": int(client.zcard(f"dramatiq:{QUEUE}.XQ")),
            "requeued_after_kills": sum(
                int(record.get("requeued") or 0) for record in worker.records("process_died")),
        }
        result = {
            half: {
                "jobs": len(ids),
                "lost": sum(1 for job_id in ids if counts[job_id] == 0),
                "duplicated_jobs": sum(1 for job_id in ids if counts[job_id] > 1),
                "extra_side_effects": sum(max(0, counts[job_id] - 1) for job_id in ids),
                **common,
            }
            for half, ids in halves.items()
        }
        print(f"chaos {store}: {json.dumps(result)}")
        return result

    yield _run
    for worker in started:
        worker.kill()
    for effects in stores:
        effects.close()


def assert_exactly_once_only_with_the_helper(result: dict[str, dict[str, int]]) -> None:
    helped, plain = result["with"], result["without"]
    assert helped["kills"] >= KILLS
    assert helped["dead_letters"] == 0, result
    assert (helped["lost"], helped["duplicated_jobs"]) == (0, 0), result
    assert plain["lost"] == 0, result
    assert plain["duplicated_jobs"] > 0, f"the kills should have duplicated side effects: {result}"


def test_redis_side_effects_exactly_once_with_the_helper_duplicated_without(
        chaos: Callable[[str], dict[str, dict[str, int]]]) -> None:
    assert_exactly_once_only_with_the_helper(chaos("redis"))


def test_database_side_effects_exactly_once_with_the_helper_duplicated_without(
        chaos: Callable[[str], dict[str, dict[str, int]]], database_url: str) -> None:
    assert_exactly_once_only_with_the_helper(chaos("db"))
