"""``worker --watch``: run the worker, and run it again when its source changes.

For a desk (``make run``, ``make dev``), never for production. The worker runs as a child
process in a process group of its own, sent SIGTERM by the kernel if this process dies
(:mod:`.parentdeath`); every ``interval_s`` (default 0.5 s) the modification times of the
package's ``.py`` files and of pools.toml are compared with the last look. On a change the
child gets SIGTERM, as Kubernetes sends it: the worker drains (its jobs finish within
``WORKER_SHUTDOWN_TIMEOUT_MS`` or are requeued), exits, and is started again.

A worker that exits by itself after a reload (a syntax error, a bad pools.toml: exit 78) is
started again after the next change: the edit in progress is not finished. One that exits
78 at its first start ends the watch with 78 (its one line says why: a busy
``METRICS_PORT``, a state folder another pool uses, a setting of the environment); no
edit of the watched files is awaited for what the command line or the machine must change.
Ctrl-C, SIGTERM or SIGHUP (the terminal closed) stops the child the same way (one SIGTERM)
and then this process, with the child's exit code.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType

from .exitcodes import EX_CONFIG
from .parentdeath import stop_with_parent

logger = logging.getLogger(__name__)

#: Seconds between two looks at the files.
INTERVAL_S = 0.5


def snapshot(roots: Iterable[Path]) -> dict[Path, int]:
    """Each watched file (a root file, or the ``.py`` files under a root directory) and
    its modification time in nanoseconds."""
    files: dict[Path, int] = {}
    for root in roots:
        paths = root.rglob("*.py") if root.is_dir() else [root]
        for path in paths:
            try:
                files[path] = path.stat().st_mtime_ns
            except OSError:  # removed between the listing and the look
                continue
    return files


def changed(before: dict[Path, int], after: dict[Path, int]) -> list[Path]:
    """The files added, removed or modified between two snapshots."""
    paths = before.keys() | after.keys()
    return sorted(path for path in paths if before.get(path) != after.get(path))


class Watcher:
    """Runs ``command`` and restarts it on a change of ``roots`` (see the module docstring).

    Parameters:
      command: the worker's command line (``python -m <package> worker``).
      roots: directories (their ``.py`` files) and files to watch.
      interval_s: seconds between two looks (default :data:`INTERVAL_S`).
    """

    def __init__(self, command: list[str], roots: list[Path], interval_s: float = INTERVAL_S):
        self.command = command
        self.roots = roots
        self.interval_s = interval_s
        self.stopping = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _wait_for_change(
        self, files: dict[Path, int], child: subprocess.Popen[bytes] | None
    ) -> tuple[list[Path], dict[Path, int]]:
        """Until a change (returned with the new snapshot), the child's exit or a stop."""
        while not self.stopping and (child is None or child.poll() is None):
            time.sleep(self.interval_s)
            now = snapshot(self.roots)
            if diff := changed(files, now):
                return diff, now
        return [], files

    def run(self) -> int:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self._on_signal)
        files = snapshot(self.roots)
        code = 0
        first = True
        while not self.stopping:
            # Its own process group: Ctrl-C reaches this process only, which sends one
            # SIGTERM (a second signal would cut the worker's drain short).
            child = subprocess.Popen(
                self.command, process_group=0, preexec_fn=stop_with_parent(os.getpid())
            )
            # Debug only: a worker refused at once leaves its one line alone on stderr.
            logger.debug("watching for changes", extra={"child": child.pid, "files": len(files)})
            diff, files = self._wait_for_change(files, child)
            if child.poll() is None:
                if diff:
                    shown = [str(path) for path in diff[:5]]
                    logger.info("source changed: reloading", extra={"changed": shown})
                child.send_signal(signal.SIGTERM)
            code = child.wait()
            if self.stopping or (first and not diff and code == EX_CONFIG):
                break
            first = False
            if not diff:  # it exited by itself: start it again after the next change
                logger.warning("worker exited: waiting for a change", extra={"exit_code": code})
                diff, files = self._wait_for_change(files, None)
        return code
