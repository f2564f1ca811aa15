"""The database option: a pool of DB_POOL_SIZE connections to a real PostgreSQL."""

from __future__ import annotations

import os

import pytest

from {{ cookiecutter.package }} import db
from {{ cookiecutter.package }}.settings import Settings

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://localhost:5432/postgres")


def test_pool_opens_with_db_pool_size_and_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_POOL", "interactive")
    monkeypatch.setenv("DATABASE_URL", DATABASE_URL)
    monkeypatch.setenv("DB_POOL_SIZE", "9")
    settings = Settings()  # type: ignore[call-arg]
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
