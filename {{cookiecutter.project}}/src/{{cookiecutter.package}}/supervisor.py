"""The ``worker`` command: a supervisor that runs ``WORKER_PROCESSES`` worker processes.

The supervisor (PID 1's child in the container, or PID 1 itself) starts each
worker process with ``python -m <package> worker --process``, serves /metrics,
/livez and /readyz on ``METRICS_PORT``, and forwards SIGTERM/SIGINT. A worker
process that dies outside a shutdown (segfault, ``os._exit``, OOM kill) is
replaced at once; the messages it held are recovered immediately, the one it
was running counted as a crash (see :mod:`.recovery`). Exit code 0 after a
clean drain of every process.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType

import redis

from . import layout, recovery
from .boards import progress_dir, read_board
from .exitcodes import EX_FAILURE, EX_OK
from .settings import PROJECT, VERSION, Settings

logger = logging.getLogger(__name__)
RESTART_BACKOFF_S = (0.2, 30.0)
STABLE_AFTER_S = 60.0


@dataclass
class Child:
    """One worker process slot: its process and its restart history."""

    index: int
    process: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)
    backoff: float = RESTART_BACKOFF_S[0]
    restart_at: float | None = None
    buried: bool = False

    def clean_exit(self) -> bool:
        """The slot ended without losing work: its process drained (exit 0), was stopped
        by our SIGTERM before it could install its handler (it held nothing yet), or it
        died earlier and was already buried while waiting for its replacement."""
        code = self.process.returncode
        return code in (0, -signal.SIGTERM) or (self.buried and self.restart_at is not None)


class Supervisor:
    """Starts, watches and stops the worker processes of one container.

    Parameters:
      settings: validated settings; ``worker_processes`` children are started.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.children: list[Child] = []
        self.stopping = False
        self._signals = 0
        self._last_signal = 0.0
        self.metrics_dir = settings.worker_state_dir / "metrics"
        self.redis = redis.Redis.from_url(
            settings.redis_url.get_secret_value(), socket_timeout=5, socket_connect_timeout=2
        )

    def run(self) -> int:
        self._prepare_state_dir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)
        from . import exporter

        exporter.start_exporter(self.settings)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.children = [
            Child(index, self._spawn()) for index in range(self.settings.worker_processes)
        ]
        logger.info(
            "worker started",
            extra={
                "event": "start",
                "version": VERSION,
                "project": PROJECT,
                "pool": self.settings.worker_pool,
                "config": self.settings.masked(),
            },
        )
        while not self._all_exited():
            self._watch()
            time.sleep(0.1)
        self._watch()  # recover the messages of a child that died in the last round
        codes = [child.process.returncode for child in self.children]
        code = EX_OK if all(child.clean_exit() for child in self.children) else EX_FAILURE
        logger.info(
            "worker stopped",
            extra={
                "event": "stop",
                "version": VERSION,
                "pool": self.settings.worker_pool,
                "exit_codes": codes,
                "config": self.settings.masked(),
            },
        )
        return code

    def _prepare_state_dir(self) -> None:
        """Start from empty progress and metrics folders (files of a previous run are stale)."""
        for folder in (progress_dir(self.settings.worker_state_dir), self.metrics_dir):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)

    def _spawn(self) -> subprocess.Popen[bytes]:
        package = __name__.rpartition(".")[0]
        return subprocess.Popen([sys.executable, "-m", package, "worker", "--process"])

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        first = not self.stopping
        self.stopping = True
        if first or now - self._last_signal >= 1.0:
            self._last_signal = now
            for child in self.children:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)

    def _all_exited(self) -> bool:
        return self.stopping and all(child.process.poll() is not None for child in self.children)

    def _watch(self) -> None:
        """Replace children that died outside a shutdown, recovering their messages first.

        During a shutdown nothing is replaced, but a child that dies without draining
        (killed, crashed mid-drain) still has its messages recovered at once.
        """
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at and not self.stopping:
                    child.process, child.started, child.restart_at = self._spawn(), now, None
                    child.buried = False
                continue
            code = child.process.poll()
            if code is None or child.buried:
                continue
            if self.stopping:
                if not child.clean_exit():
                    self._bury(child.process.pid, code)
                child.buried = True
                continue
            self._bury(child.process.pid, code)
            child.buried = True
            if now - child.started > STABLE_AFTER_S:
                child.backoff = RESTART_BACKOFF_S[0]
            child.restart_at = now + child.backoff
            child.backoff = min(child.backoff * 2, RESTART_BACKOFF_S[1])

    def _bury(self, pid: int, code: int) -> None:
        """Recover a dead child's messages and forget its progress board and metrics."""
        board_path = progress_dir(self.settings.worker_state_dir) / f"{pid}.bin"
        board = read_board(board_path)
        requeued = dead = 0
        if board is not None:
            running = {slot.message_id for slot in board.slots if slot.job_started}
            try:
                requeued, dead = recovery.recover_worker(
                    self.redis,
                    board.broker_id,
                    self.settings.worker_queues,
                    self.settings.worker_max_attempts,
                    running,
                )
                self.redis.zrem(layout.HEARTBEATS, board.broker_id)
            except redis.RedisError as error:
                logger.warning("could not recover now; the heartbeat timeout will: %s", error)
        board_path.unlink(missing_ok=True)
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(self.metrics_dir))
        logger.error(
            "worker process died; replacing it",
            extra={"pid": pid, "exit_code": code, "requeued": requeued, "dead_lettered": dead},
        )
