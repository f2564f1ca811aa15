"""Liveness and readiness.

Liveness reads only local files (no Redis, no database, no Dramatiq import):
the progress boards of the worker processes and the supervisor's status. It
fails when a worker process died, when a process's main loop is frozen, when a
handler holds a job and made no progress (job start or ``checkpoint()``) for
longer than ``HEALTH_STALLED_AFTER_S``, or when fewer worker processes than
``WORKER_PROCESSES`` have been live for longer than that (they crash at boot, or
keep dying; counted from the supervisor's first look that found one missing, so a
container whole only between two looks, ``supervisor.WATCH_INTERVAL_S`` apart, counts
as short all along), or when ``WORKER_STATE_DIR`` is read-only or has less free than a
worker process needs (``boards.PROCESS_BYTES``: no process could be replaced, and new
metrics are dropped).
An idle worker, or one whose Redis or database is down, stays live:
restarting it would not help.

Readiness: every worker process of the container is up (no grace period: a pod
whose processes cannot start must not count as available during a rollout), Redis
(and the database) answer within a short timeout, and the Redis node ``REDIS_URL``
leads to is a primary (a replica refuses every write: a plain URL that still names a
demoted primary; through Sentinel the probe asks for the primary again each time),
Redis takes writes (not full: ``maxmemory`` reached under ``noeviction``), no worker
process has an unresolved broker reset (:mod:`.brokerstate`), and none is stopped or
frozen (:func:`frozen_processes`: it would hold its messages until another worker
recovers them); each reason is one line of the body.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .boards import PROCESS_BYTES, read_boards, space_problem

if TYPE_CHECKING:
    from .settings import WorkerSettings

READY_TIMEOUT_S = 2.0
#: Shortest silence of a worker process's main loop (it ticks every second) that readiness
#: calls frozen; otherwise half of ``WORKER_HEARTBEAT_TIMEOUT_MS``.
FROZEN_AFTER_MIN_S = 5.0
SUPERVISOR_STATUS = "supervisor.json"


@dataclass(frozen=True)
class SupervisorStatus:
    """What the supervisor last said about its worker processes.

    Parameters:
      pid: the supervisor's pid (a status left by a dead supervisor is ignored).
      expected: ``WORKER_PROCESSES``.
      live: worker processes running with their progress board written (booted).
      short_since: ``time.monotonic()`` of the first look that found fewer than
        ``expected`` live since the last look that found all of them; None when all are.
      pool: ``WORKER_POOL`` (named when another supervisor finds the folder in use).
    """

    pid: int
    expected: int
    live: int
    short_since: float | None
    pool: str = ""


def write_supervisor_status(state_dir: Path, status: SupervisorStatus) -> None:
    """Replace the status file atomically (a probe never reads half of it)."""
    path = state_dir / SUPERVISOR_STATUS
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(asdict(status)))
        partial.replace(path)
    except OSError:
        partial.unlink(missing_ok=True)  # a full disk: leave no empty file behind
        raise


def read_supervisor_status(state_dir: Path) -> SupervisorStatus | None:
    """The status of this container's running supervisor, or None (none, or it died)."""
    try:
        status = SupervisorStatus(**json.loads((state_dir / SUPERVISOR_STATUS).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return status if process_alive(status.pid) else None


def other_supervisor(state_dir: Path, package: str) -> SupervisorStatus | None:
    """The status of another running supervisor of this service that uses ``state_dir``
    (its pid alive and running ``-m <package> worker``, not a worker process), or None."""
    status = read_supervisor_status(state_dir)
    if status is None or status.pid == os.getpid():
        return None
    try:
        argv = Path(f"/proc/{status.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [word.decode(errors="replace") for word in argv]
    supervises = package in words and "worker" in words and "--process" not in words
    return status if supervises else None


def missing_processes(state_dir: Path, now: float, grace_s: float) -> str | None:
    """A problem when fewer worker processes than expected have been live for over
    ``grace_s`` seconds (0: at once); None otherwise."""
    status = read_supervisor_status(state_dir)
    if status is None or status.short_since is None or now - status.short_since <= grace_s:
        return None
    return (
        f"{status.live} of {status.expected} worker processes live for "
        f"{now - status.short_since:.1f} s (limit {grace_s:g} s; see the worker's log for "
        "why they do not start or keep dying)"
    )


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in ``/proc`` (``R``, ``S``, ``T`` stopped, ``Z``...), None
    when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


def process_alive(pid: int) -> bool:
    """True when ``pid`` runs (a zombie, dead but not yet reaped, is not alive)."""
    return process_state(pid) not in {None, "Z", "X"}


def frozen_processes(state_dir: Path, now: float, limit_s: float) -> list[str]:
    """The worker processes that hold their messages and run nothing: stopped (``SIGSTOP``, a
    debugger), or whose main loop has not ticked for ``limit_s`` (a C call holding the
    interpreter lock freezes every thread). Another worker recovers their messages once
    their heartbeat is older than ``WORKER_HEARTBEAT_TIMEOUT_MS``."""
    problems = []
    for board in read_boards(state_dir):
        state = process_state(board.pid)
        if state in {"T", "t"}:
            problems.append(f"worker process {board.pid} is stopped (SIGSTOP or a debugger)")
        elif state not in {None, "Z", "X"} and now - board.tick > limit_s:
            problems.append(
                f"worker process {board.pid} is frozen: main loop silent for "
                f"{now - board.tick:.1f} s (limit {limit_s:g} s, half of "
                "WORKER_HEARTBEAT_TIMEOUT_MS)"
            )
    return problems


def liveness_problems(
    state_dir: Path, stalled_after_s: float, now: float | None = None
) -> list[str]:
    """Why this container is not live; empty when it is."""
    now = time.monotonic() if now is None else now
    problems = []
    if missing := missing_processes(state_dir, now, stalled_after_s):
        problems.append(missing)
    if space := space_problem(state_dir, PROCESS_BYTES):
        problems.append(space)
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


def readiness_problems(settings: WorkerSettings, timeout_s: float = READY_TIMEOUT_S) -> list[str]:
    """Why this container cannot take work now: Redis or the database not answering, or the
    Redis node a replica (:func:`.redisclient.role_problem`)."""
    import redis

    from . import brokerstate, layout
    from .redisclient import connect, role_problem

    problems = []
    # The scheduler's settings serve no pool (no WORKER_QUEUES): its namespace is the default.
    queues: list[str] = getattr(settings, "worker_queues", None) or []
    namespace = layout.namespace_of(queues[0]) if queues else layout.NAMESPACE
    now = time.monotonic()
    if missing := missing_processes(settings.worker_state_dir, now, 0.0):
        problems.append(missing)
    heartbeat_timeout_ms = getattr(settings, "worker_heartbeat_timeout_ms", None)
    if heartbeat_timeout_ms is not None:
        limit_s = max(FROZEN_AFTER_MIN_S, heartbeat_timeout_ms / 2000)
        problems += frozen_processes(settings.worker_state_dir, now, limit_s)
    client = connect(
        settings.redis_url.get_secret_value(),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )
    try:
        if replica := role_problem(client):
            problems.append(f"redis: {replica}")
        elif full := brokerstate.full_problem(client, namespace):
            problems.append(full)
    except redis.RedisError as error:
        problems.append(f"redis: {error}")
    finally:
        client.close()
    problems += brokerstate.read_reset_notices(settings.worker_state_dir, process_alive)
    if settings.uses_database:
        db = importlib.import_module(f"{__package__}.db")  # absent without the database option
        try:
            db.ping(settings, timeout_s)
        except Exception as error:  # any failure means not ready
            problems.append(f"database: {error}".splitlines()[0])
    return problems
