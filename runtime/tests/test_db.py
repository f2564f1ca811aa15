"""The database option: a pool of DB_POOL_SIZE connections to a real PostgreSQL."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from psycopg_pool import ConnectionPool

from worker_runtime import db, idempotency
from worker_runtime.middleware.database import DatabasePool
from worker_runtime.settings import WorkerSettings

DATABASE_URL = os.environ.get("DATABASE_URL") or os.environ.get("TEST_DATABASE_URL", "")

# The only tests that need a real PostgreSQL: `make test` without DATABASE_URL skips them.
pytestmark = pytest.mark.skipif(
    not DATABASE_URL,
    reason="DATABASE_URL is not set: these tests need a PostgreSQL, e.g. "
    "DATABASE_URL=postgresql://postgres:postgres@localhost:5432/postgres make test",
)


def test_pool_opens_with_db_pool_size_and_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_POOL", "interactive")
    monkeypatch.setenv("DATABASE_URL", DATABASE_URL)
    monkeypatch.setenv("DB_POOL_SIZE", "9")
    settings = WorkerSettings()  # type: ignore[call-arg]
    pool = db.open_pool(settings)
    try:
        assert pool.get_stats()["pool_size"] == 9
        with db.connection() as conn:
            assert conn.execute("select 1").fetchone() == (1,)
        db.ping(settings)
    finally:
        db.close_pool()
    with pytest.raises(RuntimeError, match="not open"):
        db.pool()


def test_once_in_transaction_commits_the_key_with_the_writes_or_neither(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORKER_POOL", "interactive")
    monkeypatch.setenv("DATABASE_URL", DATABASE_URL)
    db.open_pool(WorkerSettings())  # type: ignore[call-arg]
    with db.connection() as conn:
        idempotency.create_table(conn)  # as the DatabasePool middleware does at boot
    table, key = f"effects_{uuid.uuid4().hex[:8]}", f"k-{uuid.uuid4()}"
    try:
        with db.connection() as conn:
            conn.execute(f"create table {table} (key text)")

        def effect(conn: Any) -> None:
            conn.execute(f"insert into {table} values (%s)", (key,))  # noqa: S608

        def failing(conn: Any) -> None:
            effect(conn)
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            idempotency.once_in_transaction(key, failing)
        assert idempotency.once_in_transaction(key, effect)
        assert not idempotency.once_in_transaction(key, effect)
        with db.connection() as conn:
            assert conn.execute(f"select count(*) from {table}").fetchone() == (1,)  # noqa: S608
            assert conn.execute(
                "select count(*) from idempotency_keys where key = %s", (key,)
            ).fetchone() == (1,)
    finally:
        with db.connection() as conn:
            conn.execute(f"drop table if exists {table}")
            conn.execute("delete from idempotency_keys where key = %s", (key,))
        db.close_pool()


def test_a_job_waiting_at_boot_finds_the_pool_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job already queued when the worker starts runs on an open pool, first time, even
    when the pool is slow to open: the consumers start only after it is open."""
    monkeypatch.setenv("WORKER_POOL", "interactive")
    monkeypatch.setenv("DATABASE_URL", DATABASE_URL)
    opening = ConnectionPool.open

    def slow_open(pool: ConnectionPool, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.5)  # a database slow to accept connections
        opening(pool, *args, **kwargs)

    monkeypatch.setattr(ConnectionPool, "open", slow_open)
    broker = StubBroker(middleware=[DatabasePool(WorkerSettings())])  # type: ignore[call-arg]
    outcomes: list[object] = []

    @dramatiq.actor(broker=broker, queue_name="boot")
    def query() -> None:
        try:
            with db.connection() as conn:
                outcomes.append(conn.execute("select 1").fetchone())
        except Exception as error:
            outcomes.append(error)

    query.send()
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=2)
    worker.start()
    try:
        broker.join("boot", timeout=10_000)
        worker.join()
    finally:
        worker.stop()
        db.close_pool()
    assert outcomes == [(1,)]
