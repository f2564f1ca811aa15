"""The database option: a handler's writes and its idempotency key in one transaction, on
a real PostgreSQL (``TEST_DATABASE_URL`` or ``DATABASE_URL``; skipped without one)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from worker_runtime import Service, db, idempotency
from worker_runtime.settings import load_settings


def test_once_in_transaction_runs_a_key_once(
    service: Service, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKER_POOL", "critical")  # a pool that uses postgres (pools.toml)
    monkeypatch.setenv("DATABASE_URL", database_url)
    db.open_pool(load_settings())
    try:
        with db.connection() as conn:
            idempotency.create_table(conn)  # as the worker does when it opens its pool
        key, runs = f"test:{uuid.uuid4()}", []

        def effect(conn: Any) -> None:
            runs.append(conn.execute("select 1").fetchone())

        assert idempotency.once_in_transaction(key, effect)
        assert not idempotency.once_in_transaction(key, effect)
        assert runs == [(1,)]
    finally:
        db.close_pool()
