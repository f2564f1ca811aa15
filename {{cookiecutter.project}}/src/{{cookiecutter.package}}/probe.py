"""Liveness and readiness.

Liveness reads only the local progress boards (no Redis, no database, no
Dramatiq import): it fails when a worker process died, when a process's main
loop is frozen, or when a handler holds a job and made no progress (job start or
``checkpoint()``) for longer than ``HEALTH_STALLED_AFTER_S``. An idle worker, or
one whose Redis or database is down, stays live: restarting it would not help.

Readiness asks Redis (and the database) to answer within a short timeout.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .boards import read_boards

if TYPE_CHECKING:
    from .settings import Settings

READY_TIMEOUT_S = 2.0


def process_alive(pid: int) -> bool:
    """True when ``pid`` runs (a zombie, dead but not yet reaped, is not alive)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in {"Z", "X"}


def liveness_problems(
    state_dir: Path, stalled_after_s: float, now: float | None = None
) -> list[str]:
    """Why this container is not live; empty when it is."""
    now = time.monotonic() if now is None else now
    problems = []
    for board in read_boards(state_dir):
        if not process_alive(board.pid):
            problems.append(f"worker process {board.pid} has died")
            continue
        if now - board.tick > stalled_after_s:
            problems.append(
                f"worker process {board.pid}: main loop silent for "
                f"{now - board.tick:.1f} s (limit {stalled_after_s:g} s)"
            )
        for index, slot in enumerate(board.slots):
            if slot.job_started and now - slot.last_progress > stalled_after_s:
                problems.append(
                    f"worker process {board.pid}, handler {index}: job on queue {slot.queue!r} "
                    f"made no progress for {now - slot.last_progress:.1f} s "
                    f"(limit {stalled_after_s:g} s; long handlers call checkpoint())"
                )
    return problems


def readiness_problems(settings: Settings, timeout_s: float = READY_TIMEOUT_S) -> list[str]:
    """Why this container cannot take work now (Redis or the database not answering)."""
    import redis

    problems = []
    client = redis.Redis.from_url(
        settings.redis_url.get_secret_value(),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )
    try:
        client.ping()
    except redis.RedisError as error:
        problems.append(f"redis: {error}")
    finally:
        client.close()
    if settings.uses_database:
        db = importlib.import_module(f"{__package__}.db")  # absent without the database option
        try:
            db.ping(settings, timeout_s)
        except Exception as error:  # any failure means not ready
            problems.append(f"database: {error}".splitlines()[0])
    return problems
