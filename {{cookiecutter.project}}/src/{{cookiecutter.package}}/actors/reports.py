"""Bulk pool: long, CPU-heavy jobs that stop at a safe point when the worker shuts down."""

from __future__ import annotations

import hashlib

import dramatiq

from ..lifecycle import checkpoint


@dramatiq.actor(queue_name="reports", max_retries=2, time_limit=300_000)
def build_report(report_id: str, rows: int, chunk: int = 10_000) -> str:
    """Digest ``rows`` rows in chunks; each chunk ends at a ``checkpoint()``, which records
    progress for liveness and, after SIGTERM, requeues the job instead of being killed."""
    digest = hashlib.sha256(report_id.encode())
    for start in range(0, rows, chunk):
        for row in range(start, min(start + chunk, rows)):
            digest.update(row.to_bytes(8, "little"))
        checkpoint()
    return digest.hexdigest()
