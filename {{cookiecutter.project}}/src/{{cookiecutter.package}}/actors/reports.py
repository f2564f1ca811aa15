"""Bulk pool: long, CPU-heavy jobs that stop at a safe point when the worker shuts down."""

from __future__ import annotations

import hashlib
import logging

from pydantic import Field
from worker_runtime import checkpoint
from worker_runtime.typed import JobArguments, actor

logger = logging.getLogger(__name__)


class Report(JobArguments):
    """The arguments of :func:`build_report` (schema version 1)."""

    report_id: str = Field(min_length=1, max_length=200)
    rows: int = Field(ge=0)
    chunk: int = Field(default=10_000, gt=0)


@actor(queue_name="reports", max_retries=2, time_limit=300_000, store_results=True)
def build_report(job: Report) -> str:
    """Digest ``job.rows`` rows in chunks; each chunk ends at a ``checkpoint()``, which
    records progress for liveness and, after SIGTERM, requeues the job instead of being
    killed. Its digest is the message's result (``store_results=True``)::

        message = build_report.send("r-1", 100_000)
        digest = message.get_result(block=True, timeout=60_000)
    """
    digest = hashlib.sha256(job.report_id.encode())
    for start in range(0, job.rows, job.chunk):
        for row in range(start, min(start + job.chunk, job.rows)):
            digest.update(row.to_bytes(8, "little"))
        checkpoint()
    return digest.hexdigest()


class ReportBatch(JobArguments):
    """The arguments of :func:`reports_ready` (schema version 1)."""

    batch_id: str = Field(min_length=1, max_length=200)


@actor(queue_name="reports", max_retries=2, time_limit=60_000)
async def reports_ready(job: ReportBatch) -> None:
    """A group's completion callback, and an ``async def`` actor: it runs once, after every
    report of the batch was built, however often one was delivered and whichever worker
    died meanwhile::

        import dramatiq

        batch = dramatiq.group([build_report.message(f"r-{n}", 10_000) for n in range(3)])
        batch.add_completion_callback(reports_ready.message(batch_id="b-1"))
        batch.run()

    As an ``async def`` handler it runs on the process's event loop: await your async
    clients here; the time limit, a cancel and the drain cancel the coroutine.
    """
    logger.info("report batch ready", extra={"batch_id": job.batch_id})
