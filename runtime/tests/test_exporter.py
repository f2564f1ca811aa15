"""The exporter's registry against a real Redis."""

from __future__ import annotations

from pathlib import Path

import redis
from prometheus_client import generate_latest

from worker_runtime.exporter import build_registry


def test_scrape_skips_a_worker_file_still_being_created(tmp_path: Path, redis_url: str) -> None:
    # A worker process creates its metrics file empty and sizes it a moment later.
    (tmp_path / "counter_4242.db").write_bytes(b"")
    registry = build_registry(redis.Redis.from_url(redis_url), ["notifications"], str(tmp_path))
    text = generate_latest(registry).decode()
    assert 'queue_depth{queue="notifications"} 0.0' in text
