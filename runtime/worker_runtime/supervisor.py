"""The ``worker`` command: a supervisor that runs ``WORKER_PROCESSES`` worker processes.

The supervisor (PID 1's child in the container, or PID 1 itself) starts each
worker process with ``python -m <package> worker --process``, serves /metrics,
/livez and /readyz on ``METRICS_PORT``, and forwards SIGTERM/SIGINT.

Each worker process slot is in one :class:`ChildState`:

* a process that dies outside a shutdown (segfault, ``os._exit``, OOM kill) has
  the messages it held recovered at once (the one it was running counted as a
  crash, see :mod:`.recovery`) and is replaced after a back-off that doubles from
  0.2 s to at most 30 s, and starts again from 0.2 s once a process ran a minute;
* a process that exits ``EX_REPLACE`` (75) gave up a handler that would not stop after
  its time limit (it drained the rest and charged that job, :mod:`.overrun`): it is
  replaced at once, without a crash's back-off;
* a process whose main loop stopped ticking its progress board while one of its jobs is
  past its deadline (a handler holding the interpreter lock, :func:`.overrun.overdue`) is
  killed: that job is charged as a time limit (not a crash), the others it held are
  requeued uncharged, and the process is replaced;
* a process that exits ``EX_CONFIG`` (78) cannot boot (a bad setting, an actor
  module that does not import, an actor on a queue no pool serves): replacing it
  would fail the same way forever, so the supervisor logs the child's one-line
  reason, drains the other processes and exits 78 itself;
* during a shutdown nothing is replaced.

Before anything starts, the supervisor waits for Redis to answer (:mod:`.outage`: one line
naming ``REDIS_URL`` and how to start Redis, then a quiet retry with a backoff and a line a
minute; SIGTERM ends the wait, exit 0), then checks that Redis (and, through Sentinel, the
Sentinels) take ``REDIS_URL``'s credentials (:func:`.redisclient.credentials_problem`:
refused, exit 78 and one line; not answering, it goes on and waits), then Redis's configuration
(:func:`.brokerstate.check_config`): a Redis that evicts keys refuses to boot, exit 78,
unless ``REDIS_ALLOW_EVICTION=true``; with ``REDIS_REQUIRE_PERSISTENCE=true``, so does a
Redis that persists nothing (neither AOF nor RDB save points).

The supervisor also records, in ``<WORKER_STATE_DIR>/supervisor.json``, how many
worker processes run and since when fewer than ``WORKER_PROCESSES`` do: liveness
fails when that lasts longer than ``HEALTH_STALLED_AFTER_S``, readiness at once
(:mod:`.probe`).

``WORKER_STATE_DIR`` faults: a folder that is read-only, not writable, or has less free
than the processes need (``boards.PROCESS_BYTES`` each) refuses to boot (one line, 78),
and so does one in use by another running supervisor (a second pool started beside the
first with the same folder would wipe the first one's boards and metrics). Filled while
running, the supervisor goes on (the processes reserved their files' space at boot):
a status it cannot write is logged once and retried, and liveness names the full folder.
Exit code 0 after a clean drain of every process, 1 when a
process did not drain, 78 when one could not boot.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import redis

from . import accounting as recovery
from . import brokerstate, outage, overrun, probe, redisclient
from .boards import PROCESS_BYTES, progress_dir, read_board, space_problem, unwritable
from .exitcodes import EX_CONFIG, EX_FAILURE, EX_OK, EX_REPLACE
from .service import current
from .settings import WorkerSettings, refuse
from .stopsignals import SIGNAL_DEBOUNCE_S
from .timing import KILL_AFTER_DRAIN_S

if TYPE_CHECKING:
    from .exporter import Mounts
    from .oomkills import OomKills

logger = logging.getLogger(__name__)
#: First and longest pause before a crashed worker process is replaced.
RESTART_BACKOFF_S = (0.2, 30.0)
#: A process that ran this long before dying restarts after the first pause again.
STABLE_AFTER_S = 60.0
#: Seconds between two looks at the children.
WATCH_INTERVAL_S = 0.1


class ChildState(enum.Enum):
    """Where a worker process slot is in its life."""

    #: Its process was started and has not been seen to exit.
    RUNNING = "running"
    #: Its process died outside a shutdown; its messages were recovered; it restarts later.
    WAITING = "waiting"
    #: Its process exited during the shutdown (drained, or its messages were recovered).
    STOPPED = "stopped"
    #: Its process exited EX_CONFIG: it cannot boot, and would not on a restart either.
    FAILED = "failed"


def next_backoff(backoff: float, ran_for_s: float) -> tuple[float, float]:
    """The pause before replacing a process that died after ``ran_for_s`` seconds, and the
    pause after that: doubling from ``RESTART_BACKOFF_S[0]`` up to ``RESTART_BACKOFF_S[1]``,
    back to the first after a process ran ``STABLE_AFTER_S``."""
    first, cap = RESTART_BACKOFF_S
    pause = first if ran_for_s > STABLE_AFTER_S else backoff
    return pause, min(pause * 2, cap)


@dataclass
class Child:
    """One worker process slot: its process, its state and its restart history."""

    index: int
    process: subprocess.Popen[bytes]
    report: Path
    state: ChildState = ChildState.RUNNING
    started: float = field(default_factory=time.monotonic)
    backoff: float = RESTART_BACKOFF_S[0]
    restart_at: float = 0.0
    #: Redis ids of the jobs past their time limit it was killed for (none: not killed so).
    timed_out: set[str] = field(default_factory=set)

    def clean_exit(self) -> bool:
        """The slot ended without losing work: its process drained (exit 0), was stopped
        by our SIGTERM before it could install its handler (it held nothing yet), or it had
        died earlier and its messages were recovered while it waited for its replacement."""
        if self.state is ChildState.WAITING:
            return True
        return self.process.returncode in (EX_OK, EX_REPLACE, -signal.SIGTERM)

    def boot_failure(self) -> str:
        """The one-line reason the process gave for refusing to boot."""
        try:
            lines = self.report.read_text().splitlines()
        except OSError:
            lines = []
        return "; ".join(lines) or f"exit code {EX_CONFIG} without a reason"


class Supervisor:
    """Starts, watches and stops the worker processes of one container.

    Parameters:
      settings: validated settings; ``worker_processes`` children are started.
    """

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.children: list[Child] = []
        self.stopping = False
        #: ``time.monotonic()`` after which a process still running is killed (once stopping).
        self.kill_at: float | None = None
        self.failure: str | None = None
        self._last_signal = 0.0
        self._short_since: float | None = time.monotonic()
        self._live = -1
        #: Why the state dir last refused a write (logged once), None while it takes them.
        self._unwritable: str | None = None
        self.metrics_dir = settings.worker_state_dir / "metrics"
        self.reports_dir = settings.worker_state_dir / "boot"
        self.redis = redisclient.connect(
            settings.redis_url.get_secret_value(), socket_timeout=5, socket_connect_timeout=2
        )
        #: The container's OOM kills (exported; a SIGKILLed process is judged by them), from
        #: the boot on (made once ``PROMETHEUS_MULTIPROC_DIR`` is set: it imports the client).
        self.oom: OomKills | None = None
        self._oom_seen = 0

    def _refuse_credentials(self, url: str) -> None:
        """Exit 78 in one line when Redis or its Sentinels refuse the credentials of ``url``."""
        refused = redisclient.credentials_problem(url, self.redis)
        if refused is not None:
            refuse([refused])

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        url = self.settings.redis_url.get_secret_value()
        # Credentials first: Sentinels that refuse them make the primary look unreachable,
        # and that is a configuration error (78), not an outage to wait out. Nothing
        # answering is no refusal, so they are checked again once Redis answers.
        self._refuse_credentials(url)
        if not outage.wait_until_answering(self.redis, outage.Outage(url), lambda: self.stopping):
            return self._stopped_before_start("before Redis answered")
        self._refuse_credentials(url)
        refusals = brokerstate.check_config(
            self.redis,
            self.settings.redis_allow_eviction,
            self.settings.redis_require_persistence,
        )
        if refusals:
            refuse(refusals)
        self._prepare_state_dir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)
        from . import exporter
        from .oomkills import OomKills

        self.oom = OomKills()
        exporter.start_exporter(self.settings, mounts=self._mounts(), collectors=[self.oom])
        if self.stopping:  # a signal during the checks: nothing to drain
            return self._stopped_before_start("during the boot's checks")
        self.children = [self._start(index) for index in range(self.settings.worker_processes)]
        logger.info(
            "worker started",
            extra={
                "event": "start",
                "version": current().version,
                "project": current().project,
                "pool": self.settings.worker_pool,
                "config": self.settings.masked(),
            },
        )
        while not self._all_exited():
            self._watch()
            time.sleep(WATCH_INTERVAL_S)
        self._watch()  # recover the messages of a child that died in the last round
        codes = [child.process.returncode for child in self.children]
        if self.failure is not None:
            code = EX_CONFIG
        else:
            code = EX_OK if all(child.clean_exit() for child in self.children) else EX_FAILURE
        logger.info(
            "worker stopped",
            extra={
                "event": "stop",
                "version": current().version,
                "pool": self.settings.worker_pool,
                "exit_code": code,
                "exit_codes": codes,
                "config": self.settings.masked(),
            },
        )
        return code

    def _stopped_before_start(self, when: str) -> int:
        """A stop signal came before any worker process started: exit 0, said once."""
        logger.info(
            f"worker stopped {when}; no worker process was started",
            extra={
                "event": "stop",
                "version": current().version,
                "pool": self.settings.worker_pool,
            },
        )
        return EX_OK

    def _mounts(self) -> Mounts:
        """What the exporter serves besides its own paths: the console under /console/ with
        ``CONSOLE_IN_EXPORTER`` (default: nothing)."""
        if not self.settings.console_in_exporter:
            return {}
        from .console.server import exporter_mount

        return exporter_mount(self.settings)

    def _prepare_state_dir(self) -> None:
        """Start from empty progress, metrics and boot folders (files of a previous run are
        stale), and say at once that no worker process runs yet; refuse to boot (78, one
        line) on a folder that cannot hold them or that another supervisor uses."""
        state_dir = self.settings.worker_state_dir
        package = current().package
        if other := probe.other_supervisor(state_dir, package):
            refuse(
                [
                    f"WORKER_STATE_DIR={state_dir} is in use by the supervisor of pool "
                    f"{other.pool or '?'} (pid {other.pid}); give each pool its own "
                    "WORKER_STATE_DIR"
                ]
            )
        try:
            resets = brokerstate.reset_notices_dir(state_dir)
            for folder in (progress_dir(state_dir), resets, self.metrics_dir, self.reports_dir):
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
            need = PROCESS_BYTES * self.settings.worker_processes
            if problem := space_problem(state_dir, need):
                refuse([problem])
            self._write_status(0)
        except OSError as error:
            refuse([str(unwritable(state_dir, error))])
        self._live = 0

    def _start(self, index: int) -> Child:
        report = self.reports_dir / f"{index}.txt"
        return Child(index, self._spawn(report), report)

    def _spawn(self, report: Path) -> subprocess.Popen[bytes]:
        package = current().package
        report.unlink(missing_ok=True)
        return subprocess.Popen(
            [sys.executable, "-m", package, "worker", "--process", "--boot-report", str(report)]
        )

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        first = not self.stopping
        if first or now - self._last_signal >= SIGNAL_DEBOUNCE_S:
            self._last_signal = now
            self._stop_children()

    def _stop_children(self) -> None:
        """Stop replacing processes and ask every running one to drain (the first call sets
        the deadline after which :meth:`_watch` kills what still runs)."""
        self.stopping = True
        if self.kill_at is None:
            window_s = self.settings.worker_shutdown_timeout_ms / 1000
            self.kill_at = time.monotonic() + window_s + KILL_AFTER_DRAIN_S
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)

    def _all_exited(self) -> bool:
        return self.stopping and all(child.process.poll() is not None for child in self.children)

    def _watch(self) -> None:
        """Move each slot along its states; record how many processes are live."""
        now = time.monotonic()
        if self.kill_at is not None and now >= self.kill_at:
            self._kill_overdue()
        for child in self.children:
            if child.state is ChildState.WAITING:
                if now >= child.restart_at and not self.stopping:
                    child.process = self._spawn(child.report)
                    child.state, child.started = ChildState.RUNNING, now
                    child.timed_out = set()
                    if self.stopping:  # the signal came while it was spawned: not told yet
                        child.process.send_signal(signal.SIGTERM)
                continue
            code = child.process.poll()
            if child.state is ChildState.RUNNING and code is None and not self.stopping:
                self._kill_past_limit(child, now)  # stopping: the drain window kills it
            if child.state is not ChildState.RUNNING or code is None:
                continue
            if code == EX_CONFIG:
                self._refuse(child)
            elif self.stopping:
                child.state = ChildState.STOPPED
                if not child.clean_exit():
                    self._bury(child, code)
            elif code == EX_REPLACE:
                child.state, child.restart_at = ChildState.WAITING, now
                self._bury(child, code, restart_in_s=0.0)
            else:
                pause, child.backoff = next_backoff(child.backoff, now - child.started)
                child.state, child.restart_at = ChildState.WAITING, now + pause
                self._bury(child, code, restart_in_s=pause)
        self._record_live()

    def _kill_past_limit(self, child: Child, now: float) -> None:
        """Kill ``child`` when one of its jobs is past its deadline and its main loop stopped
        ticking (:func:`.overrun.overdue`: the interpreter lock is held, nothing in the
        process can stop the job); :meth:`_bury` charges that job as a time limit."""
        if child.timed_out:
            return
        board = read_board(
            progress_dir(self.settings.worker_state_dir) / f"{child.process.pid}.bin"
        )
        late = overrun.overdue(board, now) if board is not None else []
        if not late:
            return
        child.timed_out = {slot.message_id for slot in late}
        logger.error(
            "a job holds its worker process past its time limit (its interpreter does not "
            "answer); killing the process",
            extra={
                "event": "time_limit_kill",
                "slot": child.index,
                "pid": child.process.pid,
                "redis_ids": sorted(child.timed_out),
                "past_limit_s": round(max(now - slot.deadline for slot in late), 1),
            },
        )
        child.process.kill()

    def _kill_overdue(self) -> None:
        """Kill every process still running past :attr:`kill_at` (a drain that cannot end:
        a stopped or hung process); :meth:`_watch` then recovers its messages."""
        self.kill_at = None
        for child in self.children:
            if child.state is ChildState.RUNNING and child.process.poll() is None:
                logger.error(
                    "a worker process did not exit within its drain window; killing it",
                    extra={"event": "drain_overrun", "slot": child.index, "pid": child.process.pid},
                )
                child.process.kill()

    def _refuse(self, child: Child) -> None:
        """A process cannot boot: stop the others and exit EX_CONFIG with its reason."""
        child.state = ChildState.FAILED
        self._bury(child, EX_CONFIG)
        if self.failure is None:
            self.failure = child.boot_failure()
            logger.error(
                "a worker process cannot boot; stopping",
                extra={"event": "boot_failed", "reason": self.failure, "exit_code": EX_CONFIG},
            )
            print(f"config error: {self.failure}", file=sys.stderr, flush=True)
        self._stop_children()

    def _record_live(self) -> None:
        """Tell the probes how many worker processes are live (booted, board written)."""
        boards = progress_dir(self.settings.worker_state_dir)
        live = sum(
            1
            for child in self.children
            if child.state is ChildState.RUNNING
            and child.process.poll() is None
            and (boards / f"{child.process.pid}.bin").exists()
        )
        expected = self.settings.worker_processes
        if live >= expected:
            self._short_since = None
        elif self._short_since is None:
            self._short_since = time.monotonic()
        if live != self._live:
            try:
                self._write_status(live)
            except OSError as error:  # full: keep running, say it once, write it next look
                reason = str(unwritable(self.settings.worker_state_dir, error))
                if reason != self._unwritable:
                    logger.error(
                        "cannot write the supervisor status; liveness may be stale",
                        extra={"event": "state_dir_unwritable", "reason": reason},
                    )
                self._unwritable = reason
                return
            if self._unwritable is not None:
                logger.info("the state dir takes writes again", extra={"event": "state_dir_ok"})
                self._unwritable = None
            self._live = live

    def _write_status(self, live: int) -> None:
        probe.write_supervisor_status(
            self.settings.worker_state_dir,
            probe.SupervisorStatus(
                os.getpid(),
                self.settings.worker_processes,
                live,
                self._short_since,
                self.settings.worker_pool,
            ),
        )

    def _oom_killed(self) -> bool:
        """True when the container's OOM kills rose since the last look: a worker process
        that died of SIGKILL then was the kernel's pick. The kernel counts the kill before it
        sends the signal (``__oom_kill_process``: "raise event before sending signal: task
        reaper must see this"), so the count has risen by the time the process is reaped."""
        total = 0 if self.oom is None else self.oom.total()
        rose, self._oom_seen = total > self._oom_seen, total
        return rose

    def _bury(self, child: Child, code: int, restart_in_s: float | None = None) -> None:
        """Recover a dead child's messages and forget its progress board and metrics.

        Parameters:
          restart_in_s: when it is replaced, after how long (None: it is not).
        """
        pid = child.process.pid
        board_path = progress_dir(self.settings.worker_state_dir) / f"{pid}.bin"
        board = read_board(board_path)
        requeued = dead = 0
        if board is not None:
            # Killed for a job past its time limit: that job is charged as one, the others
            # it held did not kill it (requeued uncharged).
            running = (
                set() if child.timed_out else {s.message_id for s in board.slots if s.job_started}
            )
            try:
                requeued, dead = recovery.recover_worker(
                    self.redis,
                    board.broker_id,
                    self.settings.worker_queues,
                    self.settings.worker_max_attempts,
                    running,
                    timed_out=child.timed_out,
                )
                recovery.forget_worker(self.redis, board.broker_id, self.settings.worker_queues)
            except redis.RedisError as error:
                logger.warning("could not recover now; the heartbeat timeout will: %s", error)
        board_path.unlink(missing_ok=True)
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(self.metrics_dir))
        if code == EX_CONFIG:
            return
        if code == EX_REPLACE:
            what, event = (
                "worker process replaced: a job would not stop after its time limit",
                "process_replaced",
            )
        elif child.timed_out:
            what, event = "worker process killed for a job past its time limit", "time_limit_killed"
        elif code == -signal.SIGKILL and self._oom_killed():
            what, event = (
                "worker process killed by the kernel's OOM killer: the container reached its "
                "memory limit (worker_oom_kills_total)",
                "process_oom_killed",
            )
        else:
            what, event = "worker process died", "process_died"
        logger.error(
            what + ("" if restart_in_s is None else "; replacing it"),
            extra={
                "event": event,
                "slot": child.index,
                "pid": pid,
                "exit_code": code,
                "restart_in_s": restart_in_s,
                "requeued": requeued,
                "dead_lettered": dead,
            },
        )
