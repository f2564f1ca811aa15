"""The database option: one psycopg connection pool per worker process.

``DB_POOL_SIZE`` connections (at least ``WORKER_CONCURRENCY``, so no handler waits
for another's connection); the pool opens when the worker process starts and closes
after it drains (the ``DatabasePool`` middleware; it then creates the
``idempotency_keys`` table of :func:`.idempotency.once_in_transaction` if it is
missing). Use it in handlers::

    with db.connection() as conn:
        conn.execute("insert into ...")
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg_pool import ConnectionPool

from .settings import WorkerSettings

_pool: ConnectionPool | None = None


def dsn(settings: WorkerSettings) -> str:
    """``DATABASE_URL``; settings refuse to boot without it when the pool uses the database."""
    if settings.database_url is None:
        raise RuntimeError("DATABASE_URL is not set")
    return settings.database_url.get_secret_value()


def open_pool(settings: WorkerSettings, timeout_s: float = 10.0) -> ConnectionPool:
    """Open this process's pool of ``DB_POOL_SIZE`` connections and wait until it is filled."""
    global _pool
    if _pool is None:
        _pool = ConnectionPool(
            dsn(settings),
            min_size=settings.db_pool_size,
            max_size=settings.db_pool_size,
            name=settings.otel_service_name,
            open=False,
        )
        _pool.open(wait=True, timeout=timeout_s)
    return _pool


def close_pool() -> None:
    """Close this process's pool (after the drain)."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


def pool() -> ConnectionPool:
    """The open pool of this process."""
    if _pool is None:
        raise RuntimeError("the database pool is not open: call open_pool() at process start")
    return _pool


@contextmanager
def connection() -> Iterator[psycopg.Connection]:
    """A connection from the pool, returned to it afterwards (committed unless it raised)."""
    with pool().connection() as conn:
        yield conn


def ping(settings: WorkerSettings, timeout_s: float = 2.0) -> None:
    """Connect and run ``select 1`` within ``timeout_s`` (readiness); raise on failure."""
    with psycopg.connect(dsn(settings), connect_timeout=max(1, int(timeout_s))) as conn:
        conn.execute("select 1")
