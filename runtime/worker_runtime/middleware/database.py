"""DatabasePool: opens this process's connection pool at boot (creating the idempotency table
if it is missing) and closes it after the drain."""

from __future__ import annotations

from dramatiq import Broker, Middleware
from dramatiq.worker import Worker

from .. import db, idempotency
from ..settings import WorkerSettings


class DatabasePool(Middleware):
    """One psycopg pool of ``DB_POOL_SIZE`` connections per worker process.

    The pool opens in ``before_worker_boot``: Dramatiq starts the consumers and handler
    threads before ``after_worker_boot``, so a job already waiting in Redis would run
    before a pool opened there, fail on its first attempt and wait out a retry backoff.

    Parameters:
      settings: supplies ``DATABASE_URL`` and ``DB_POOL_SIZE``.
    """

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        db.open_pool(self.settings)
        with db.connection() as conn:
            idempotency.create_table(conn)

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        db.close_pool()
