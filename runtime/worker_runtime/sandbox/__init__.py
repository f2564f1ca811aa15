"""Run untrusted, customer-supplied Python in a confined child process.

Only the sandbox pool (queue ``untrusted``) calls this. The worker keeps its own
network, environment and files; the child gets none of them::

    from worker_runtime.sandbox import Limits, run_untrusted

    result = run_untrusted(
        "def main(payload):\\n    return sum(payload['numbers'])\\n",
        {"numbers": [1, 2, 3]},
        limits=Limits(cpu_seconds=2),
    )
    assert result.status == "ok" and result.output == 6

The snippet contract: the source defines ``main(payload)``; ``payload`` is the
JSON-decoded value passed here; ``main`` returns JSON-serialisable data, which
becomes :attr:`SandboxResult.output`. The snippet sees only the standard library
(Python runs with ``-I -S``); what it prints is returned in :attr:`SandboxResult.logs`.

A breach of a limit or a policy is a result, never an exception: see
:data:`STATUSES`. Only a failure of the sandbox itself (it could not be set up)
raises :class:`SandboxError`, so the message is retried. Where no layer can keep the
snippet from the worker's files and processes (a non-root worker on a kernel with neither
Landlock nor user namespaces) every run raises :class:`SandboxUnavailableError` before the
snippet starts; the sandbox pool checks it once at boot (:func:`check_sandbox`) and refuses
to start (exit 78). There is no opt-in (issue #25).

The layers (reported in :attr:`SandboxResult.layers` as far as the kernel supports
them) are described in ``docs/sandbox.md`` of worker-template and in
:mod:`._child`, the launcher that runs as the child.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import math
import os
import secrets
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from ..exitcodes import EX_CONFIG, EX_SOFTWARE

logger = logging.getLogger(__name__)

__all__ = [
    "STATUSES",
    "Limits",
    "SandboxError",
    "SandboxResult",
    "SandboxUnavailableError",
    "Status",
    "check_sandbox",
    "run_untrusted",
]

Status = Literal["ok", "error", "timeout", "memory", "cpu", "output_too_large", "crashed",
                 "forbidden", "disk"]  # fmt: skip

#: Every status a run can end with.
#:
#: * ``ok``: ``main(payload)`` returned; ``output`` holds its value.
#: * ``error``: the snippet raised (or has no ``main``, or returned non-JSON data, or
#:   wrote a malformed result); ``error`` holds the reason and the traceback.
#: * ``timeout``: the wall-clock limit passed; the process group was killed.
#: * ``memory``: the address-space limit was hit (``MemoryError``/``ENOMEM``) or the
#:   child was killed by the out-of-memory killer.
#: * ``cpu``: the CPU-time limit was hit.
#: * ``output_too_large``: stdout plus stderr exceeded the output limit.
#: * ``crashed``: the child died of a signal (e.g. ``SIGSEGV``) or exited without a result.
#: * ``forbidden``: the snippet tried something the sandbox denies (network, signals to
#:   other processes, fork, writes outside its directory, file size or open files limit).
#: * ``disk``: what the run wrote, all files together, reached ``Limits.max_disk_bytes`` or
#:   ``Limits.max_files``.
STATUSES: Final[tuple[Status, ...]] = ("ok", "error", "timeout", "memory", "cpu",
                                       "output_too_large", "crashed", "forbidden",
                                       "disk")  # fmt: skip

_LAUNCHER = Path(__file__).with_name("_child.py")
_SETUP_FAILED = EX_SOFTWARE  # _child.SETUP_FAILED (a test checks they agree)
_UNCONTAINED = EX_CONFIG  # _child.UNCONTAINED (a test checks they agree)
_MAX_LOG_BYTES = 64 * 1024
#: Largest value of a :class:`Limits` field: what a resource limit (``rlim_t``) can hold.
_MAX_LIMIT: Final = 2**62
#: Deepest nesting of arrays and objects a result may have; deeper is the status ``error``.
MAX_RESULT_DEPTH: Final = 100
#: How often the worker counts a snippet's threads where the snippet has the worker's uid
#: (no RLIMIT_NPROC of its own can cap them; docs/sandbox.md says why and what it bounds).
_POLL_SECONDS = 0.02
#: How often, at most, the worker measures a run's private directory where the run has no
#: tmpfs of its own (no mount namespace: a restricted pod on runc); never more than a fifth
#: of the time (a walk of 4096 files takes milliseconds). At 0.1 s a writer of 1 MiB files
#: got 33 MiB (median, 53 at most) past a 16 MiB limit; at 0.02 s, 7.5 (16): docs/sandbox.md.
_DISK_POLL_SECONDS = _POLL_SECONDS
_DISK_POLL_SHARE = 5
_NOT_WALKED = frozenset({"/proc", "/sys"})
_CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
# Tests only: layers to leave out ("netns", "landlock", "seccomp", "userns"; "mount_setattr":
# make the mounts read-only one by one, as on a kernel before 5.12), to prove each of the
# others on its own or to play a kernel without them. Never set in production.
_DISABLED_LAYERS: frozenset[str] = frozenset()
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                  signal.SIGABRT, signal.SIGTRAP}  # fmt: skip


_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36


def _protect_worker() -> tuple[str, ...]:
    """Make the worker process non-dumpable (idempotent, cheap: called for every run).

    A process of the same uid can otherwise read the worker's ``/proc/<pid>/environ``
    (``REDIS_URL`` and every other secret) where Landlock is missing; non-dumpable, only
    ``CAP_SYS_PTRACE`` can, and the sandbox has no capabilities. Side effect: no core
    dumps of the worker and no ptrace-based profilers without that capability.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return ()
    return ("worker-nondumpable",)


def _become_subreaper() -> tuple[str, ...]:
    """Adopt the orphans of this process's descendants (idempotent; only for runs with
    ``max_processes > 1``): a snippet's forked processes, orphaned when the group is
    killed, are reaped by :meth:`_Run.finish` instead of piling up as zombies under
    PID 1 (in a container, the supervisor)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        return ()
    return ("worker-subreaper",)


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start or set up its layers).

    Raised, unlike a breach by the snippet, so that the message is retried.
    """


class SandboxUnavailableError(SandboxError):
    """The sandbox refuses to run here: no layer keeps the snippet from the worker's files
    and processes (neither ``landlock-fs`` nor ``private-mounts``). The message names the
    missing layers; nothing of the snippet ran."""


@dataclass(frozen=True)
class Limits:
    """Caps for one sandboxed run.

    Parameters:
      cpu_seconds(int): CPU time of the child (``RLIMIT_CPU``); breach: ``cpu``.
        Defaults to 5.
      memory_bytes(int): address space of the child (``RLIMIT_AS``); breach: ``memory``.
        Defaults to 256 MiB.
      max_processes(int): processes the snippet may have, itself included. With the
        default of 1, seccomp denies fork/vfork/clone of processes (threads stay
        allowed); above 1, ``max_threads`` caps processes and threads together, which
        needs a uid of the snippet's own (a root worker, or user namespaces); with the
        worker's uid the run raises :class:`SandboxError`. Breach: ``forbidden``.
      max_threads(int): threads of the snippet, its main thread included, across its
        processes (``RLIMIT_NPROC`` of its own uid; with the worker's uid, the worker
        counts them every 20 ms and kills the run above the cap). Breach: ``forbidden``.
        Defaults to 16; at least ``max_processes``.
      max_open_files(int): file descriptors (``RLIMIT_NOFILE``); breach: ``forbidden``.
        Defaults to 64.
      max_file_bytes(int): size of a file the snippet writes (``RLIMIT_FSIZE``);
        breach: ``forbidden``. Defaults to 1 MiB.
      max_output_bytes(int): stdout plus stderr of the child, result included;
        breach: ``output_too_large``. Defaults to 1 MiB.
      wall_seconds(float): wall-clock time from start to exit; breach: ``timeout``.
        Defaults to 10.
      max_disk_bytes(int): everything the run writes, all files and places together (a
        tmpfs of this size, the run's own, where it gets a mount namespace; else the
        worker measures its private directory every 20 ms); breach: ``disk``. Memory of
        the pod, like the snippet's own. Defaults to 16 MiB; at least 1 MiB.
      max_files(int): files and directories the run creates, counted like
        ``max_disk_bytes`` (the tmpfs's ``nr_inodes``); breach: ``disk``. Defaults to 4096;
        at least 64.
    """

    cpu_seconds: int = 5
    memory_bytes: int = 256 * 1024 * 1024
    max_processes: int = 1
    max_threads: int = 16
    max_open_files: int = 64
    max_file_bytes: int = 1024 * 1024
    max_output_bytes: int = 1024 * 1024
    wall_seconds: float = 10.0
    max_disk_bytes: int = 16 * 1024 * 1024
    max_files: int = 4096

    def __post_init__(self) -> None:
        problem = next(iter(self.problems()), None)
        if problem is not None:
            raise ValueError(problem)

    def problems(self) -> list[str]:
        """What is wrong with these limits, one line each (empty when they are valid)."""
        problems = []
        for name, value in asdict(self).items():
            whole = name != "wall_seconds"
            kind = "a whole number" if whole else "a finite number"
            if (
                isinstance(value, bool)
                or not isinstance(value, int if whole else int | float)
                or not math.isfinite(value)
                or not 0 < value <= _MAX_LIMIT
            ):
                problems.append(
                    f"Limits.{name} must be {kind} above 0 and at most {_MAX_LIMIT}, got {value!r}"
                )
        if problems:
            return problems
        if self.max_open_files < 8:
            problems.append("Limits.max_open_files must be at least 8 (Python needs a few)")
        if self.memory_bytes < 64 * 1024 * 1024:
            problems.append("Limits.memory_bytes must be at least 64 MiB (Python needs it)")
        if self.max_threads < self.max_processes:
            problems.append("Limits.max_threads must be at least Limits.max_processes")
        if self.max_disk_bytes < 1024 * 1024:
            problems.append("Limits.max_disk_bytes must be at least 1 MiB")
        if self.max_files < 64:
            problems.append("Limits.max_files must be at least 64 (the run's own directories)")
        return problems


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one :func:`run_untrusted` call.

    Parameters:
      status(str): one of :data:`STATUSES`.
      output(Any): what ``main(payload)`` returned (``None`` unless ``status == "ok"``).
      error(str|None): why the run did not end ``ok``, with the snippet's traceback.
      cpu_seconds(float): user plus system CPU time of the child.
      max_rss_bytes(int): peak resident memory of the child itself (its ``VmHWM``; not
        the worker's memory it shared before its exec).
      wall_seconds(float): wall-clock time of the run, start-up included.
      layers(tuple[str, ...]): the isolation layers that were active, e.g.
        ``("clean-env", "private-tmp", "process-group", "netns", "landlock-fs",
        "rlimits", "seccomp-allowlist")``.
      logs(str): what the snippet printed (stdout and stderr), truncated to 64 KiB.
    """

    status: Status
    output: Any = None
    error: str | None = None
    cpu_seconds: float = 0.0
    max_rss_bytes: int = 0
    wall_seconds: float = 0.0
    layers: tuple[str, ...] = field(default_factory=tuple)
    logs: str = ""

    @property
    def ok(self) -> bool:
        """Whether ``main(payload)`` returned normally."""
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-serialisable data (e.g. an actor's return value)."""
        data = asdict(self)
        data["layers"] = list(self.layers)
        return data


class _Run:
    """One child process: feeds stdin, drains stdout/stderr under the caps, reaps it."""

    def __init__(
        self, process: subprocess.Popen[bytes], stdin: bytes, limits: Limits, workdir: str
    ) -> None:
        self.process = process
        self.workdir = workdir
        self.disk_due = 0.0  # monotonic time of the next walk of workdir
        self.limits = limits
        self.stdin_data = stdin
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.total = 0
        self.breach: Status | None = None
        self.breach_reason = ""
        self.status = 0
        self.rusage: Any = None
        #: The child's own peak resident memory (VmHWM, bytes) as last read; wait4's
        #: ru_maxrss also counts the worker's memory the child had before its exec.
        self.peak_rss = 0
        self.layers: list[str] | None = None  # from the child's first line, once it came

    def communicate(self, deadline: float) -> None:
        process = self.process
        assert process.stdin and process.stdout and process.stderr
        with selectors.DefaultSelector() as selector:
            os.set_blocking(process.stdin.fileno(), False)
            selector.register(process.stdin, selectors.EVENT_WRITE)
            selector.register(process.stdout, selectors.EVENT_READ, self.stdout)
            selector.register(process.stderr, selectors.EVENT_READ, self.stderr)
            while selector.get_map() and self.breach is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.breach = "timeout"
                    break
                for key, _ in selector.select(min(remaining, _POLL_SECONDS)):
                    if key.fileobj is process.stdin:
                        self._feed(selector)
                    else:
                        self._drain(selector, key)
                self._watch()
        if self.breach is None:
            self._wait_exit(deadline)

    def _watch(self) -> None:
        """Read the child's peak memory, and count the snippet's threads where no
        ``RLIMIT_NPROC`` of its own caps them."""
        if self.layers is None and b"\n" in self.stdout:
            self.layers = _layers(bytes(self.stdout.split(b"\n", 1)[0]))
        count_threads = self.layers is not None and "own-uid" not in self.layers
        if self.layers is not None and "disk-quota" not in self.layers:
            now = time.monotonic()
            if now >= self.disk_due:
                problem = _disk_breach(self.workdir, self.limits)
                spent = time.monotonic() - now
                self.disk_due = now + max(_DISK_POLL_SECONDS, _DISK_POLL_SHARE * spent)
                if problem:
                    self.breach, self.breach_reason = "disk", problem
                    return
        try:
            with open(f"/proc/{self.process.pid}/status", "rb") as handle:
                for line in handle:
                    if line.startswith(b"VmHWM:"):
                        self.peak_rss = max(self.peak_rss, int(line.split()[1]) * 1024)
                    elif count_threads and line.startswith(b"Threads:"):
                        if int(line.split()[1]) > self.limits.max_threads:
                            self.breach = "forbidden"
                            self.breach_reason = (
                                f"thread limit of {self.limits.max_threads} reached"
                            )
                        return
        except (OSError, ValueError, IndexError):
            return  # exited, or a zombie: its exit status tells

    def _feed(self, selector: selectors.BaseSelector) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        try:
            written = os.write(stdin.fileno(), self.stdin_data[:65536])
            self.stdin_data = self.stdin_data[written:]
        except BrokenPipeError:  # the child exited early: its status tells why
            self.stdin_data = b""
        if not self.stdin_data:
            selector.unregister(stdin)
            stdin.close()

    def _drain(self, selector: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        fd = key.fd
        chunk = os.read(fd, 65536)
        if not chunk:
            selector.unregister(key.fileobj)
            return
        self.total += len(chunk)
        if self.total > self.limits.max_output_bytes:
            self.breach = "output_too_large"
            return
        buffer: bytearray = key.data
        if buffer is self.stdout or len(buffer) < _MAX_LOG_BYTES:
            buffer += chunk

    def _wait_exit(self, deadline: float) -> None:
        """Wait, without reaping, until the child exits (it may linger after closing its pipes)."""
        pause = 0.0005
        while True:
            info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                return
            if time.monotonic() >= deadline:
                self.breach = "timeout"
                return
            self._watch()
            if self.breach is not None:
                return
            time.sleep(pause)
            pause = min(pause * 2, _POLL_SECONDS)

    def finish(self) -> None:
        """Kill the whole process group, then reap the child (in that order: until it is
        reaped, its pid, which is the group's id, cannot be reused)."""
        process = self.process
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        _, self.status, self.rusage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(self.status)
        while True:  # its processes, orphaned to this subreaper: every one was SIGKILLed
            try:
                os.waitpid(-process.pid, 0)
            except ChildProcessError:
                break


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise ValueError(f"{text[:40]} is out of range")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of decoded JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            if depth > MAX_RESULT_DEPTH:
                return depth
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _decode(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One line of the result channel: (a JSON object, None) or (None, the problem).

    Strict JSON only (no ``NaN``/``Infinity``/``1e999``), nested at most :data:`MAX_RESULT_DEPTH`
    deep; nothing in ``line`` can make this raise.
    """
    try:
        doc = json.loads(line, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        return None, f"the result is nested deeper than {MAX_RESULT_DEPTH} levels"
    except (ValueError, TypeError, OverflowError) as exc:  # UnicodeDecodeError is a ValueError
        return None, f"the result is not valid JSON ({str(exc)[:200]})"
    if not isinstance(doc, dict):
        return None, "the result is not a JSON object"
    if _depth(doc) > MAX_RESULT_DEPTH:
        return None, f"the result is nested deeper than {MAX_RESULT_DEPTH} levels"
    return doc, None


def _layers(line: bytes) -> list[str]:
    """The layers the launcher reported on its first line (empty when malformed)."""
    doc, _ = _decode(line)
    layers = doc.get("layers") if doc is not None else None
    return [str(layer) for layer in layers] if isinstance(layers, list) else []


def _docs(stdout: bytes) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str | None]:
    """(layers document, result document, problem) from the child's result channel."""
    lines = stdout.split(b"\n", 2)
    docs: list[dict[str, Any]] = []
    for line in lines[:2]:
        if not line:
            break
        doc, problem = _decode(line)
        if doc is None:
            return (docs[0] if docs else None), None, problem
        docs.append(doc)
    if len(docs) < 2:
        return (docs[0] if docs else None), None, None
    if len(lines) > 2 and lines[2]:
        return docs[0], None, "unexpected data after the result"
    return docs[0], docs[1], None


def _peak_rss(run: _Run, result_doc: dict[str, Any] | None) -> int:
    """The child's own peak resident memory: the highest ``VmHWM`` the worker read while it
    ran (every 20 ms at most) or the launcher's last reading of it, whichever is higher; the
    latter is the child's word, so never above ``ru_maxrss`` (which also counts the worker's
    memory the child held before its exec: what this used to report)."""
    reported = result_doc.get("max_rss_bytes") if result_doc is not None else None
    if isinstance(reported, bool) or not isinstance(reported, int) or reported < 0:
        reported = 0
    return max(run.peak_rss, min(reported, int(run.rusage.ru_maxrss) * 1024))


def _status_from_exit(status: int, cpu: float, limits: Limits) -> tuple[Status, str]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals.__members__.values() else sig
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_seconds):
            return "cpu", f"CPU time limit of {limits.cpu_seconds} s reached"
        if sig == signal.SIGKILL:
            return "memory", "killed by SIGKILL (the out-of-memory killer)"
        if sig == signal.SIGXFSZ:
            return "forbidden", f"file size limit of {limits.max_file_bytes} bytes reached"
        if sig == signal.SIGSYS:
            return "forbidden", "a system call of another architecture was refused (SIGSYS)"
        if sig in _CRASH_SIGNALS:
            return "crashed", f"the child crashed ({name})"
        return "crashed", f"the child was killed by {name}"
    return "crashed", f"the child exited with code {os.WEXITSTATUS(status)} and no result"


def _disk_breach(workdir: str, limits: Limits) -> str:
    """Why what the run wrote under ``workdir`` is above its disk limits ("" when it is not).

    Walks at most ``Limits.max_files`` entries (it stops at the first one above), reading
    each one's allocated size; a directory the snippet made unreadable is skipped (it
    cannot be counted, and stays removable by the owner at the end).
    """
    entries, used, stack = 0, 0, [workdir]
    while stack:
        try:
            with os.scandir(stack.pop()) as listing:
                for entry in listing:
                    entries += 1
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    used += info.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    if entries > limits.max_files or used > limits.max_disk_bytes:
                        return (
                            f"disk limit reached: more than {limits.max_files} files or "
                            f"{limits.max_disk_bytes} bytes written"
                        )
        except OSError:
            continue
    return ""


@functools.cache
def _writable_places() -> dict[str, list[str]]:
    """Every directory a snippet's identity could write, found by walking the filesystem
    once per worker process (about 2 s for 27,000 directories on a loaded 2-core machine,
    far less on a container image with a read-only root).

    A root worker's snippet has a uid of its own and no groups: the world-writable
    directories. A non-root worker's snippet keeps its uid (user namespace or not): every
    directory the worker may write. Read-only filesystems, ``/proc`` and ``/sys`` are left
    out, and so is what lies below a directory found (it is covered with it) or below one
    the snippet cannot search. Returns ``{"private": [...], "readonly": [...]}``: the
    launcher covers the first with its run's tmpfs and binds the second read-only (those
    holding the Python installation the snippet imports from; the launcher's own directory
    is not needed once it runs). Logs one line, ``sandbox places walked``, when it is done
    (only a process that runs a snippet walks: the sandbox pool's, at its boot check).
    """
    started, walked = time.monotonic(), 0
    root = os.geteuid() == 0
    python = os.path.dirname(os.path.realpath(sys.executable))
    needed = {os.path.realpath(path) for path in (sys.base_prefix, sys.base_exec_prefix, python)}
    places: dict[str, list[str]] = {"private": [], "readonly": []}
    stack = ["/"]
    while stack:
        try:
            listing = os.scandir(stack.pop())
        except OSError:
            continue
        with listing:
            for entry in listing:
                try:
                    if not entry.is_dir(follow_symlinks=False) or entry.path in _NOT_WALKED:
                        continue
                    walked += 1
                    mode = entry.stat(follow_symlinks=False).st_mode
                    if root:
                        writable = bool(mode & stat.S_IWOTH) and not (
                            os.statvfs(entry.path).f_flag & os.ST_RDONLY
                        )
                        searchable = bool(mode & stat.S_IXOTH)
                    else:
                        writable = os.access(entry.path, os.W_OK)  # False on a read-only fs
                        searchable = os.access(entry.path, os.X_OK)
                except OSError:
                    continue
                if writable:
                    inside = any(path == entry.path or path.startswith(entry.path + "/")
                                 for path in needed)  # fmt: skip
                    places["readonly" if inside else "private"].append(entry.path)
                elif searchable:
                    stack.append(entry.path)
    logger.info(
        "sandbox places walked",
        extra={
            "event": "sandbox_places_walked",
            "directories": walked,
            "seconds": round(time.monotonic() - started, 3),
            "private_places": places["private"],
        },
    )
    return places


def _remove_private_dir(path: str) -> None:
    """Remove ``path`` whatever the snippet did inside it (modes, depth, symlinks).

    Runs after every process of the snippet is dead. Subdirectories are moved up to
    ``path`` one level at a time, so no recursion, no long paths and two descriptors
    at most; each directory is made ``0o700`` before it is read (the owner may always
    do that); symbolic links are removed, never followed.
    """
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    except PermissionError:
        os.chmod(path, 0o700)
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(top, 0o700)
        pending: list[str | None] = [None]  # None: the top itself; else a name right under it
        moved, token = 0, secrets.token_hex(8)
        while pending:
            name = pending.pop()
            if name is None:
                fd = os.dup(top)
            else:
                os.chmod(name, 0o700, dir_fd=top, follow_symlinks=False)
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
            try:
                with os.scandir(fd) as entries:
                    children = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
                for child, is_dir in children:
                    if not is_dir:
                        os.unlink(child, dir_fd=fd)
                    elif name is None:
                        pending.append(child)
                    else:
                        moved += 1
                        flat = f".sandbox-rm-{token}-{moved}"
                        os.chmod(child, 0o700, dir_fd=fd, follow_symlinks=False)  # to move it
                        os.rename(child, flat, src_dir_fd=fd, dst_dir_fd=top)
                        pending.append(flat)
            finally:
                os.close(fd)
            if name is not None:
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)


def run_untrusted(
    source: str,
    payload: Any = None,
    *,
    limits: Limits | None = None,
) -> SandboxResult:
    """Run ``main(payload)`` from ``source`` in a confined child process.

    Parameters:
      source(str): Python source that defines ``main(payload)``.
      payload(Any): JSON-serialisable data passed to ``main`` (via the child's stdin).
      limits(Limits): the caps; defaults to ``Limits()``.

    Returns:
      SandboxResult: the status, the output and the resources used. Every breach by
      the snippet ends here as a status; nothing the snippet does raises.

    Raises:
      ValueError: if the payload is not JSON-serialisable.
      SandboxError: if the sandbox could not be started or set up (for example
        ``libseccomp`` is missing, or ``max_processes > 1`` without a uid of its own).
      SandboxUnavailableError: if no layer keeps the snippet from the worker's files and
        processes (neither Landlock nor a mount namespace).
    """
    limits = limits or Limits()
    problems = limits.problems()
    if problems:  # built around __post_init__ (object.__setattr__, pickle): never ValueError
        return SandboxResult("error", error=f"invalid limits: {'; '.join(problems)}")
    payload_bytes = json.dumps(payload, allow_nan=False).encode()
    if not sys.executable:
        raise SandboxError("no Python executable to start the sandbox with")
    worker_layers = _protect_worker()
    if limits.max_processes > 1:
        worker_layers += _become_subreaper()
    places = _writable_places()  # walked once per process, before the run's clock starts
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="sandbox-")
    try:
        Path(workdir, "snippet.py").write_text(source, encoding="utf-8")
        config = json.dumps(
            {
                "workdir": workdir,
                "limits": asdict(limits),
                "off": sorted(_DISABLED_LAYERS),
                "places": places,
            }
        )
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_LAUNCHER), config],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd="/",  # the launcher moves to workdir once it is non-dumpable
                env=_CHILD_ENV,
                start_new_session=True,  # own process group: killed as a whole at the end
                close_fds=True,
            )
        except OSError as exc:
            raise SandboxError(f"cannot start the sandbox: {exc}") from exc
        run = _Run(process, b"", limits, workdir)
        try:
            # Built while the child's interpreter starts: its pid is part of the rules.
            program = _seccomp_program(process.pid, limits)
            run.stdin_data = len(program).to_bytes(4, "big") + program + payload_bytes
            run.communicate(started + limits.wall_seconds)
        finally:
            run.finish()
        wall = time.monotonic() - started
        return _result(run, limits, wall, worker_layers)
    finally:
        _remove_private_dir(workdir)


def check_sandbox() -> tuple[str, ...]:
    """Run a trivial snippet once, as a worker of the sandbox pool does at boot.

    Returns:
      tuple[str, ...]: the layers a run gets on this machine.

    Raises:
      SandboxUnavailableError: no layer keeps the snippet from the worker's files.
      SandboxError: the sandbox cannot be set up, or the trivial snippet did not run.
    """
    result = run_untrusted("def main(payload):\n    return payload\n", 1)
    if result.status != "ok" or result.output != 1:
        raise SandboxError(f"a trivial snippet ended {result.status}: {result.error}")
    return result.layers


def _seccomp_program(pid: int, limits: Limits) -> bytes:
    """The child's syscall allowlist as BPF (empty when tests switched seccomp off)."""
    if "seccomp" in _DISABLED_LAYERS:
        return b""
    try:
        from ._seccomp import build_filter
    except (ImportError, RuntimeError) as exc:  # pyseccomp, or libseccomp, is missing
        raise SandboxError(f"cannot build the seccomp filter: {exc}") from exc
    try:
        return build_filter(pid, limits.max_processes)
    except OSError as exc:
        raise SandboxError(f"cannot build the seccomp filter: {exc}") from exc


def _result(
    run: _Run, limits: Limits, wall: float, worker_layers: tuple[str, ...]
) -> SandboxResult:
    cpu = run.rusage.ru_utime + run.rusage.ru_stime
    layers_doc, result_doc, problem = _docs(bytes(run.stdout))
    if layers_doc is None and run.breach is None:
        stderr = run.stderr.decode(errors="replace")
        if os.WIFEXITED(run.status) and os.WEXITSTATUS(run.status) == _UNCONTAINED:
            raise SandboxUnavailableError(stderr.strip() or "sandbox refused")
        if os.WIFEXITED(run.status) and os.WEXITSTATUS(run.status) == _SETUP_FAILED:
            raise SandboxError(stderr.strip() or "sandbox setup failed")
        if not os.WIFSIGNALED(run.status):
            raise SandboxError(f"the sandbox exited before its set-up was done: {stderr[-2000:]}")
    layers: tuple[str, ...] = ("clean-env", "private-tmp", "process-group", *worker_layers)
    if layers_doc is not None:
        reported = layers_doc.get("layers")
        if isinstance(reported, list):
            layers += tuple(str(layer) for layer in reported)
    common: dict[str, Any] = {
        "cpu_seconds": round(cpu, 4),
        "max_rss_bytes": _peak_rss(run, result_doc),
        "wall_seconds": round(wall, 4),
        "layers": layers,
        "logs": run.stderr[:_MAX_LOG_BYTES].decode(errors="replace"),
    }
    if run.breach == "timeout":
        error = f"wall-clock limit of {limits.wall_seconds} s reached"
        return SandboxResult("timeout", error=error, **common)
    if run.breach == "output_too_large":
        error = f"output limit of {limits.max_output_bytes} bytes reached"
        return SandboxResult("output_too_large", error=error, **common)
    if run.breach in ("forbidden", "disk"):
        return SandboxResult(run.breach, error=run.breach_reason, **common)
    if problem is not None:
        return SandboxResult(
            "error", error=f"malformed result from the sandbox: {problem}", **common
        )
    if result_doc is None or not os.WIFEXITED(run.status) or os.WEXITSTATUS(run.status) != 0:
        status, error = _status_from_exit(run.status, cpu, limits)
        return SandboxResult(status, error=error, **common)
    reported = result_doc.get("status")
    if reported == "ok":
        return SandboxResult("ok", output=result_doc.get("output"), **common)
    for status in STATUSES:
        if reported == status:
            return SandboxResult(status, error=str(result_doc.get("error") or status), **common)
    error = f"malformed result: status {str(reported)[:200]!r}"
    return SandboxResult("error", error=error, **common)
