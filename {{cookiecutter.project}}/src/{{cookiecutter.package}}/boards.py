"""Progress board: what each worker process and handler thread last did, in shared memory.

Each worker process owns one small file ``<state dir>/progress/<pid>.bin``, mapped
into memory, so recording progress costs a few bytes written and no system call.
``healthcheck live`` and the supervisor read the files; nothing here touches the
network, and this module imports neither Dramatiq nor the actors.

Layout: a header ``(started, tick, broker id)`` then one slot per handler thread
``(job started, last progress, redis message id, queue)``; times are
``time.monotonic()`` seconds (one clock for every process of the host), 0 = idle.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

HEADER = struct.Struct("<dd36s")
SLOT = struct.Struct("<dd36s64s")
ENV_STATE_DIR = "WORKER_STATE_DIR"
ENV_STALLED_AFTER = "HEALTH_STALLED_AFTER_S"
#: Defaults of the two variables, here so ``healthcheck live`` need not import the settings.
#: The state dir is an emptyDir in Kubernetes.
DEFAULT_STATE_DIR = Path("/tmp/{{ cookiecutter.project }}")  # noqa: S108
DEFAULT_STALLED_AFTER_S = 60.0


def progress_dir(state_dir: Path) -> Path:
    return state_dir / "progress"


@dataclass(frozen=True)
class Slot:
    """One handler thread: when its job started, when it last made progress (0 = idle)."""

    job_started: float
    last_progress: float
    message_id: str
    queue: str


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
    """

    def __init__(self, state_dir: Path, slots: int, broker_id: str) -> None:
        folder = progress_dir(state_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{os.getpid()}.bin"
        size = HEADER.size + SLOT.size * slots
        with self.path.open("wb") as file:
            file.truncate(size)
        with self.path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), size)
        self.slots = slots
        now = time.monotonic()
        HEADER.pack_into(self._map, 0, now, now, broker_id.encode())

    def tick(self) -> None:
        """The process's main loop is alive."""
        struct.pack_into("<d", self._map, 8, time.monotonic())

    def start(self, slot: int, message_id: str, queue: str) -> None:
        """Handler thread ``slot`` started a job."""
        now = time.monotonic()
        SLOT.pack_into(self._map, self._offset(slot), now, now, message_id.encode(), queue.encode())

    def progress(self, slot: int) -> None:
        """Handler thread ``slot`` made progress (a ``checkpoint()``)."""
        struct.pack_into("<d", self._map, self._offset(slot) + 8, time.monotonic())

    def finish(self, slot: int) -> None:
        """Handler thread ``slot`` is idle again."""
        SLOT.pack_into(self._map, self._offset(slot), 0.0, time.monotonic(), b"", b"")

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
        Slot(job, last, message.rstrip(b"\0").decode(), queue.rstrip(b"\0").decode())
        for job, last, message, queue in (
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
