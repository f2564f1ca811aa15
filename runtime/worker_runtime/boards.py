"""Progress board: what each worker process and handler thread last did, in shared memory.

Each worker process owns one small file ``<state dir>/progress/<pid>.bin``, mapped
into memory, so recording progress costs a few bytes written and no system call.
``healthcheck live`` and the supervisor read the files; nothing here touches the
network, and this module imports neither Dramatiq nor the actors.

Each board's space is reserved when it is created (``posix_fallocate``): a write to a
mapped page the file system cannot back kills the process with SIGBUS, so a
``WORKER_STATE_DIR`` that is full or read-only fails the board's creation instead, with
one line (:class:`StateDirError`). :func:`space_problem` is the check the supervisor
runs at boot and liveness runs all along.

Layout: a header ``(started, tick, broker id)`` then one slot per handler thread
``(job started, last progress, redis message id, queue, deadline)``; times are
``time.monotonic()`` seconds (one clock for every process of the host), 0 = idle (a
deadline of 0: none). The deadline is the job's time limit: ``checkpoint()`` raises past it,
and the supervisor kills a process whose main loop stopped ticking with a job past it (a
handler holding the interpreter lock).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from . import contract
from .service import current

HEADER = struct.Struct("<dd36s")
SLOT = struct.Struct("<dd36s64sd")
#: Where a slot's deadline is, from the slot's start.
_DEADLINE_AT = SLOT.size - 8
ENV_STATE_DIR = "WORKER_STATE_DIR"
ENV_STALLED_AFTER = "HEALTH_STALLED_AFTER_S"
#: Defaults of the two variables, here so ``healthcheck live`` need not import the settings.
DEFAULT_STALLED_AFTER_S = contract.STALLED_AFTER_S
#: Bytes a worker process needs in the state dir: its board (at most 256 handler threads:
#: 32 KiB) and its metric files (prometheus-client maps 64 KiB per file: counters,
#: histograms, gauges), rounded up. The supervisor refuses to boot with less free than its
#: processes need; liveness fails with less than one process needs.
PROCESS_BYTES = 256 * 1024


def default_state_dir() -> Path:
    """``WORKER_STATE_DIR`` when unset: ``/tmp/<project>`` (an emptyDir in Kubernetes)."""
    return Path("/tmp") / current().project  # noqa: S108


class StateDirError(Exception):
    """``WORKER_STATE_DIR`` cannot hold a file a process needs (full, read-only, not a
    folder); ``str()`` is the one line that says so."""


def unwritable(state_dir: Path, error: OSError) -> StateDirError:
    """The :class:`StateDirError` of ``error``, raised writing into ``state_dir``."""
    reason = error.strerror or str(error)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space or give it a bigger volume (the pod's emptyDir sizeLimit)"
    elif error.errno == errno.EROFS:
        fix = "point it at a writable folder (an emptyDir in Kubernetes)"
    else:
        fix = "point it at a folder this user can write"
    where = f" ({error.filename})" if error.filename else ""
    return StateDirError(f"{ENV_STATE_DIR}={state_dir}: {reason}{where}; {fix}")


def space_problem(state_dir: Path, need_bytes: int) -> str | None:
    """Why ``state_dir`` cannot take ``need_bytes`` more (read-only, or less free than
    that), or None; None too when it does not exist yet (the supervisor creates it)."""
    try:
        stat = os.statvfs(state_dir)
    except OSError:
        return None
    if stat.f_flag & os.ST_RDONLY:
        return f"{ENV_STATE_DIR}={state_dir} is read-only: no worker process can start"
    free = stat.f_bavail * stat.f_frsize
    if free < need_bytes:
        return (
            f"{ENV_STATE_DIR}={state_dir} is full: {free} bytes free, {need_bytes} needed "
            "(progress boards and metric files); free space or give it a bigger volume"
        )
    return None


def progress_dir(state_dir: Path) -> Path:
    return state_dir / "progress"


@dataclass(frozen=True)
class Slot:
    """One handler thread: when its job started, when it last made progress (0 = idle)."""

    job_started: float
    last_progress: float
    message_id: str
    queue: str
    deadline: float = 0.0


@dataclass(frozen=True)
class Snapshot:
    """What one worker process last wrote on its board."""

    pid: int
    started: float
    tick: float
    broker_id: str
    slots: tuple[Slot, ...]


class ProgressBoard:
    """The board of the current worker process, with ``slots`` handler threads.

    Parameters:
      state_dir: ``WORKER_STATE_DIR``; the board lives in its ``progress/`` folder.
      slots: one per handler thread (``WORKER_CONCURRENCY``).
      broker_id: this process's Dramatiq broker id (its acks set in Redis).

    Raises :class:`StateDirError` when the board's space cannot be reserved.
    """

    def __init__(self, state_dir: Path, slots: int, broker_id: str) -> None:
        folder = progress_dir(state_dir)
        self.path = folder / f"{os.getpid()}.bin"
        size = HEADER.size + SLOT.size * slots
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with self.path.open("w+b") as file:
                os.posix_fallocate(file.fileno(), 0, size)
                self._map = mmap.mmap(file.fileno(), size)
        except OSError as error:
            with contextlib.suppress(OSError):  # read-only: there is nothing to remove
                self.path.unlink(missing_ok=True)
            raise unwritable(state_dir, error) from None
        self.slots = slots
        now = time.monotonic()
        HEADER.pack_into(self._map, 0, now, now, broker_id.encode())

    def tick(self) -> None:
        """The process's main loop is alive."""
        struct.pack_into("<d", self._map, 8, time.monotonic())

    def start(self, slot: int, message_id: str, queue: str) -> None:
        """Handler thread ``slot`` started a job."""
        now = time.monotonic()
        SLOT.pack_into(
            self._map, self._offset(slot), now, now, message_id.encode(), queue.encode(), 0.0
        )

    def set_deadline(self, slot: int, deadline: float) -> None:
        """The job of handler thread ``slot`` must end by ``deadline`` (0: none)."""
        struct.pack_into("<d", self._map, self._offset(slot) + _DEADLINE_AT, deadline)

    def past_deadline(self, slot: int) -> bool:
        """True when the job of handler thread ``slot`` ran past its deadline."""
        deadline: float = struct.unpack_from("<d", self._map, self._offset(slot) + _DEADLINE_AT)[0]
        return 0 < deadline <= time.monotonic()

    def progress(self, slot: int) -> None:
        """Handler thread ``slot`` made progress (a ``checkpoint()``)."""
        struct.pack_into("<d", self._map, self._offset(slot) + 8, time.monotonic())

    def finish(self, slot: int) -> None:
        """Handler thread ``slot`` is idle again."""
        SLOT.pack_into(self._map, self._offset(slot), 0.0, time.monotonic(), b"", b"", 0.0)

    def close(self) -> None:
        """Remove the board (the process is exiting cleanly)."""
        self._map.close()
        self.path.unlink(missing_ok=True)

    def _offset(self, slot: int) -> int:
        return HEADER.size + SLOT.size * (slot % self.slots)


def read_board(path: Path) -> Snapshot | None:
    """The board at ``path``, or None when it vanished or is being written."""
    try:
        data = path.read_bytes()
        pid = int(path.stem)
    except (OSError, ValueError):
        return None
    if len(data) < HEADER.size or (len(data) - HEADER.size) % SLOT.size:
        return None
    started, tick, broker_id = HEADER.unpack_from(data, 0)
    slots = tuple(
        Slot(job, last, message.rstrip(b"\0").decode(), queue.rstrip(b"\0").decode(), deadline)
        for job, last, message, queue, deadline in (
            SLOT.unpack_from(data, offset) for offset in range(HEADER.size, len(data), SLOT.size)
        )
    )
    return Snapshot(pid, started, tick, broker_id.rstrip(b"\0").decode(), slots)


def read_boards(state_dir: Path) -> list[Snapshot]:
    """Every board in ``state_dir``."""
    folder = progress_dir(state_dir)
    if not folder.is_dir():
        return []
    return [snap for path in sorted(folder.glob("*.bin")) if (snap := read_board(path))]
