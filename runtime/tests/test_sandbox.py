"""The escape matrix of the sandbox: real child processes, a real redis-server.

Every attempt must end as a status while this process (the "worker") keeps running,
keeps its network and keeps its secrets.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import templateservice
from worker_runtime import sandbox
from worker_runtime.sandbox import Limits, SandboxResult, run_untrusted

FAST = Limits(cpu_seconds=1, wall_seconds=5)
SECRETS = {
    "REDIS_URL": "redis://:hunter2-redis@broker:6379/0",
    "DATABASE_URL": "postgresql://app:hunter2-db@db/app",
    "API_TOKEN": "tok-hunter2-api",
}


def run(source: str, payload: Any = None, limits: Limits = FAST) -> SandboxResult:
    return run_untrusted(textwrap.dedent(source), payload, limits=limits)


def sandbox_processes(marker: str) -> list[int]:
    """Pids of sandbox children of this test (their command line names its directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"sandbox/_child.py" in cmdline and marker.encode() in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.fixture(autouse=True)
def workdirs(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """Private directories of this test's runs go under their own directory, so that
    leftovers (processes or files) are this test's and not a parallel test's. It is
    searchable by anyone (mode 0711, like /tmp), as the snippet's own uid needs."""
    parent = Path(tempfile.mkdtemp(prefix="sandbox-test-", dir="/tmp"))
    parent.chmod(0o711)
    tmp_path_factory.getbasetemp()  # fixed now, before tempfile's directory is redirected
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    yield parent
    try:
        assert sandbox_processes(str(parent)) == []
        assert list(parent.iterdir()) == []
    finally:
        shutil.rmtree(parent, ignore_errors=True)


# -- A well-behaved snippet ---------------------------------------------------------------


def test_well_behaved_snippet_returns_its_json() -> None:
    result = run(
        """
        import os, json
        def main(payload):
            print("working on", payload["n"])
            with open("scratch.txt", "w") as f:  # its private working directory
                f.write("ok")
            return {"square": payload["n"] ** 2, "cwd": os.getcwd(), "items": [1, "a", None]}
        """,
        {"n": 12},
    )
    assert result.status == "ok", result.error
    assert result.ok
    assert result.output["square"] == 144
    assert result.output["items"] == [1, "a", None]
    assert result.error is None
    assert result.logs == "working on 12\n"
    assert not Path(result.output["cwd"]).exists()  # the private directory is gone
    assert Path(result.output["cwd"]).parent == Path(tempfile.gettempdir())
    assert result.wall_seconds > 0 and result.cpu_seconds > 0 and result.max_rss_bytes > 0
    for layer in ("clean-env", "private-tmp", "process-group", "rlimits", "seccomp-allowlist"):
        assert layer in result.layers
    assert result.to_dict()["output"]["square"] == 144


# -- The escape matrix ----------------------------------------------------------------------

MATRIX: list[tuple[str, str, Limits, str]] = [
    (
        "resolve-host-name",
        """
        import socket
        def main(payload):
            return socket.getaddrinfo("example.com", 443)
        """,
        FAST,
        "forbidden",
    ),
    (
        "fork-bomb",
        """
        import os
        def main(payload):
            while True:
                os.fork()
        """,
        FAST,
        "forbidden",
    ),
    (
        "subprocess",
        """
        import subprocess
        def main(payload):
            return subprocess.run(["/bin/true"]).returncode
        """,
        FAST,
        "forbidden",
    ),
    (
        "allocate-2gb",
        """
        def main(payload):
            block = bytearray(2 * 1024**3)
            return len(block)
        """,
        FAST,
        "memory",
    ),
    (
        "infinite-loop",
        """
        def main(payload):
            while True:
                pass
        """,
        Limits(cpu_seconds=1, wall_seconds=30),  # 1 s of CPU may take long on a busy machine
        "cpu",
    ),
    (
        "sleep-past-wall-clock",
        """
        import time
        def main(payload):
            time.sleep(60)
        """,
        Limits(wall_seconds=1),
        "timeout",
    ),
    (
        "print-100mb",
        """
        import sys
        def main(payload):
            chunk = "x" * (1024 * 1024)
            for _ in range(100):
                sys.stdout.write(chunk)
        """,
        FAST,
        "output_too_large",
    ),
    (
        "return-100mb",
        """
        def main(payload):
            return "x" * (100 * 1024 * 1024)
        """,
        Limits(memory_bytes=1024 * 1024 * 1024),
        "output_too_large",
    ),
    (
        "segfault-via-ctypes",
        """
        import ctypes
        def main(payload):
            return ctypes.string_at(0)
        """,
        FAST,
        "crashed",
    ),
    (
        "write-too-large-file",
        """
        def main(payload):
            with open("big.bin", "wb") as f:
                f.write(b"x" * (2 * 1024 * 1024))
        """,
        FAST,
        "forbidden",
    ),
    (
        "open-too-many-files",
        """
        def main(payload):
            return [open("/dev/null") for _ in range(1000)]
        """,
        FAST,
        "forbidden",
    ),
    (
        "raises",
        """
        def main(payload):
            raise ValueError("customer bug")
        """,
        FAST,
        "error",
    ),
    (
        "no-main",
        "x = 1\n",
        FAST,
        "error",
    ),
    (
        "syntax-error",
        "def main(payload) return 1\n",
        FAST,
        "error",
    ),
    (
        "returns-non-json",
        """
        def main(payload):
            return {1, 2}
        """,
        FAST,
        "error",
    ),
    (
        "malformed-result",
        """
        import os
        def main(payload):
            os.write(3, b"this is not json\\n")
            os._exit(0)
        """,
        FAST,
        "error",
    ),
    (
        "exits-without-result",
        """
        import os
        def main(payload):
            os._exit(3)
        """,
        FAST,
        "crashed",
    ),
]


@pytest.mark.parametrize(
    ("source", "limits", "expected"),
    [pytest.param(source, limits, expected, id=name) for name, source, limits, expected in MATRIX],
)
def test_escape_is_contained(source: str, limits: Limits, expected: str) -> None:
    result = run(source, limits=limits)
    assert result.status == expected, (result.error, result.logs[-500:])
    assert result.status == "ok" or result.error


def test_tcp_connection_to_the_local_redis_is_forbidden(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    before = client.info("stats")["total_connections_received"]
    port = urlsplit(redis_url).port
    result = run(
        """
        import socket
        def main(payload):
            with socket.create_connection(("127.0.0.1", payload), timeout=2) as sock:
                sock.sendall(b"PING\\r\\n")
                return sock.recv(100).decode()
        """,
        port,
    )
    assert result.status == "forbidden", result.error
    assert "network" in (result.error or "")
    assert client.info("stats")["total_connections_received"] == before  # nothing arrived
    assert client.ping()  # the worker keeps its own network


def test_socket_syscalls_are_denied_below_python() -> None:
    """ctypes bypasses Python (and its audit hooks): the kernel still says no."""
    result = run(
        """
        import ctypes
        def main(payload):
            libc = ctypes.CDLL(None, use_errno=True)
            out = {}
            for name, family in {"inet": 2, "inet6": 10, "unix": 1, "netlink": 16}.items():
                fd = libc.socket(family, 1 if family != 16 else 3, 0)
                out[name] = [fd, ctypes.get_errno()]
            return out
        """
    )
    assert result.status == "ok", result.error
    for name, (fd, err) in result.output.items():
        assert fd == -1 and err != 0, name


def test_environment_and_secrets_are_not_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    result = run(
        """
        import os
        def main(payload):
            leaks = {"environ": dict(os.environ)}
            for path in (f"/proc/{os.getppid()}/environ", f"/proc/{os.getppid()}/cmdline"):
                try:
                    with open(path, "rb") as f:
                        leaks[path] = f.read().decode(errors="replace")
                except OSError as exc:
                    leaks[path] = repr(exc)
            return leaks
        """
    )
    assert result.status == "ok", result.error
    assert set(result.output["environ"]) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR"}
    text = repr(result.output) + result.logs
    for value in SECRETS.values():
        assert value not in text
    assert "hunter2" not in text


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm", "test-dir", "home"])  # noqa: S108
def test_writing_outside_the_private_directory_is_forbidden(
    where: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    test_dir = tmp_path_factory.mktemp("outside")  # not under the private dirs' parent
    directory = {"test-dir": str(test_dir), "home": str(Path.home())}.get(where, where)
    if not Path(directory).is_dir():
        pytest.fail(f"{directory} is missing on this machine")
    target = Path(directory, f"sandbox-escape-{uuid.uuid4().hex}")
    result = run(
        """
        def main(payload):
            with open(payload, "w") as f:
                f.write("escaped")
        """,
        str(target),
    )
    if "private-mounts" in result.layers and where != "home":  # an empty /tmp, /dev/shm
        assert result.status in ("forbidden", "error"), result.error
    else:
        assert result.status == "forbidden", result.error
    assert not target.exists()


def test_signalling_the_parent_is_forbidden() -> None:
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        result = run(
            """
            import os, signal
            def main(payload):
                os.kill(os.getppid(), signal.SIGUSR1)
            """
        )
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert result.status == "forbidden", result.error
    assert received == []


def test_fork_bomb_leaves_no_process_behind(workdirs: Path) -> None:
    result = run(
        """
        import ctypes
        def main(payload):
            libc = ctypes.CDLL(None, use_errno=True)
            while True:  # raw fork(), below Python's os.fork
                if libc.fork() < 0:
                    raise OSError(ctypes.get_errno(), "fork failed")
        """
    )
    assert result.status == "forbidden", result.error
    assert sandbox_processes(str(workdirs)) == []


def test_several_processes_are_capped_by_the_snippets_own_uid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Above one process, RLIMIT_NPROC of the snippet's own uid caps them (root is never
    the snippet's uid); with the worker's uid nothing could, so the run is refused."""
    bomb = """
    import os
    def main(payload):
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    limits = Limits(max_processes=4, cpu_seconds=1, wall_seconds=3)
    result = run(bomb, limits=limits)
    assert "own-uid" in result.layers
    assert "worker-subreaper" in result.layers
    assert result.status in ("cpu", "timeout")
    if os.geteuid() != 0:
        monkeypatch.setattr(sandbox, "_DISABLED_LAYERS", frozenset({"userns"}))
        with pytest.raises(sandbox.SandboxError, match="max_processes"):
            run(bomb, limits=limits)


# -- Each layer on its own ------------------------------------------------------------------

NETWORK_ATTEMPT = """
import socket
def main(payload):
    socket.create_connection(("127.0.0.1", payload), timeout=2).close()
"""


@pytest.mark.parametrize(
    ("off", "proof"),
    [
        ({"landlock", "netns"}, "seccomp-allowlist"),
        ({"seccomp", "netns"}, "landlock-net"),
        ({"seccomp", "landlock"}, "netns"),
    ],
    ids=["seccomp-only", "landlock-only", "netns-only"],
)
def test_each_network_layer_alone_blocks_redis(
    off: set[str], proof: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "_DISABLED_LAYERS", frozenset(off))
    client = redis.Redis.from_url(redis_url)
    before = client.info("stats")["total_connections_received"]
    result = run(NETWORK_ATTEMPT, urlsplit(redis_url).port)
    if proof not in result.layers:
        pytest.fail(f"{proof} is not available on this kernel: {result.layers}")
    assert result.status == "forbidden", result.error
    assert client.info("stats")["total_connections_received"] == before


def test_landlock_alone_blocks_signals_to_the_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_DISABLED_LAYERS", frozenset({"seccomp", "netns"}))
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        result = run(
            """
            import os, signal
            def main(payload):
                os.kill(os.getppid(), signal.SIGUSR1)
            """
        )
    finally:
        signal.signal(signal.SIGUSR1, previous)
    if "landlock-signal" not in result.layers:
        pytest.fail(f"landlock-signal is not available on this kernel: {result.layers}")
    assert result.status == "forbidden", result.error
    assert received == []


def test_without_landlock_the_worker_environ_stays_unreadable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker makes itself non-dumpable: its /proc/<pid>/environ needs CAP_SYS_PTRACE;
    with a mount namespace the snippet does not even see it (private-proc). Without one:
    test_no_other_process_of_the_pod_is_open_to_a_snippet."""
    monkeypatch.setattr(sandbox, "_DISABLED_LAYERS", frozenset({"landlock"}))
    monkeypatch.setenv("REDIS_URL", SECRETS["REDIS_URL"])
    result = run(
        """
        import os
        def main(payload):
            with open(f"/proc/{os.getppid()}/environ", "rb") as f:
                return f.read().decode(errors="replace")
        """
    )
    assert "worker-nondumpable" in result.layers
    assert "landlock-fs" not in result.layers
    if "private-proc" in result.layers:
        assert result.status == "error", result.error
        assert "FileNotFoundError" in (result.error or ""), result.error
    else:
        assert result.status == "forbidden", result.error
    assert "hunter2" not in repr(result.output) + result.logs


UNIX_ATTACK = """
import array, socket
def attempt(kind, address, fds):
    try:
        left, right = socket.socketpair(socket.AF_UNIX, kind)
    except OSError as exc:
        return ["refused", "socketpair", exc.errno]
    with left, right:
        try:
            if fds:
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                left.sendmsg([b"fds"], rights, 0, address)
            else:
                left.sendto(b"injected log line", address)
        except OSError as exc:
            return ["refused", "send", exc.errno]
    return ["sent"]
def main(p):
    out = {}
    for name, address in (("path", p["path"]), ("abstract", "\\0" + p["abstract"])):
        for kind in ("SOCK_DGRAM", "SOCK_SEQPACKET"):
            family = getattr(socket, kind)
            out[f"{name}-{kind}"] = attempt(family, address, [])
            out[f"{name}-{kind}-fds"] = attempt(family, address, [0, 1, 2, 3])
    left, right = socket.socketpair()  # a stream pair in the run, as asyncio makes one
    with left, right:
        left.sendall(b"ping")
        out["stream-pair"] = right.recv(4).decode()
    return out
"""


@pytest.mark.parametrize("off", [(), ("landlock", "netns")], ids=["all-layers", "seccomp-only"])
def test_no_datagram_or_descriptor_reaches_a_unix_socket_of_the_host(
    off: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #25: socketpair(AF_UNIX, SOCK_DGRAM) then sendto() a filesystem socket reached a
    listener of the host (mode 0666, like /dev/log) and passed it descriptors, the run's
    own result channel included; neither the network namespace nor Landlock stops a send to a
    path. Real listeners here: datagram and seqpacket, at a path (outside the places a run
    gets private) and at an abstract name (which netns alone hides: 'seccomp-only' shows
    the filter is what refuses it)."""
    monkeypatch.setattr(sandbox, "_DISABLED_LAYERS", frozenset(off))
    parent = "/run" if os.access("/run", os.W_OK) else str(Path.home())
    directory = Path(tempfile.mkdtemp(prefix="sandbox-unix-", dir=parent))
    directory.chmod(0o755)
    abstract = f"sandbox-test-{uuid.uuid4().hex}"
    listeners = []
    try:
        for kind in (socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):
            for address in (str(directory / f"{kind}.sock"), f"\0{abstract}-{kind}"):
                listener = socket.socket(socket.AF_UNIX, kind)
                listener.bind(address)
                if kind == socket.SOCK_SEQPACKET:
                    listener.listen()
                if not address.startswith("\0"):
                    os.chmod(address, 0o666)  # noqa: S103 - like /dev/log
                listener.setblocking(False)
                listeners.append(listener)
        path = str(directory / f"{socket.SOCK_DGRAM}.sock")
        result = run(UNIX_ATTACK, {"path": path, "abstract": f"{abstract}-{socket.SOCK_DGRAM}"})
        assert result.status == "ok", (result.error, result.logs[-2000:])
        output = result.output
        assert output.pop("stream-pair") == "ping"
        assert {name: pair for name, pair in output.items() if pair[0] != "refused"} == {}
        for listener in listeners:  # nothing arrived, no connection is waiting
            with pytest.raises(BlockingIOError):
                if listener.type == socket.SOCK_DGRAM:
                    listener.recvmsg(100, 100)
                else:
                    listener.accept()
    finally:
        for listener in listeners:
            listener.close()
        shutil.rmtree(directory, ignore_errors=True)


# -- The worker side --------------------------------------------------------------------------


def test_concurrent_runs_from_worker_threads() -> None:
    results: list[SandboxResult] = []

    def worker(n: int) -> None:
        results.append(run("def main(payload):\n    return payload * 2\n", n))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(r.output for r in results) == [0, 2, 4, 6, 8, 10]


def test_large_payload_round_trips() -> None:
    payload = ["x" * 1000] * 500  # ~0.5 MB through stdin
    result = run("def main(payload):\n    return len(payload)\n", payload)
    assert result.status == "ok", result.error
    assert result.output == 500


ACTOR_SCRIPT = """
import logging
import dramatiq
statuses = []
class Collect(logging.Handler):
    def emit(self, record):
        if record.getMessage() == "sandbox run finished":
            statuses.append(record.sandbox_status)
logging.getLogger().addHandler(Collect())
logging.getLogger().setLevel(logging.INFO)
from service.broker import broker
from service.actors.sandbox import run_customer_code
run_customer_code.send("def main(p):\\n    return p + 1\\n", 41)
run_customer_code.send("def main(p):\\n    while True:\\n        pass\\n", None, {"cpu_seconds": 1})
worker = dramatiq.Worker(broker, queues={"untrusted"}, worker_threads=2)
worker.start()
broker.join("untrusted", timeout=30_000)
worker.join()
worker.stop()
print(sorted(statuses))
"""


def test_sandbox_actor_serves_the_untrusted_queue(redis_url: str) -> None:
    """The actor on a real broker: a breach is a logged result, not a retried failure."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "WORKER_POOL": "sandbox", "REDIS_URL": redis_url}
    env["PYTHONPATH"] = os.pathsep.join([templateservice.pythonpath(), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", ACTOR_SCRIPT],
        env=env,
        cwd=here,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "['cpu', 'ok']"


@pytest.mark.parametrize(
    ("name", "value"),
    [("cpu_seconds", 0), ("memory_bytes", 1024), ("wall_seconds", float("inf")),
     ("wall_seconds", float("nan")), ("wall_seconds", -1.0), ("cpu_seconds", 1.5),
     ("max_open_files", True), ("max_file_bytes", "1024"), ("memory_bytes", 2**70),
     ("cpu_seconds", float("inf"))],
)  # fmt: skip
def test_limits_are_validated(name: str, value: Any) -> None:
    """A bad value is one clear error naming the field, where Limits is built."""
    with pytest.raises(ValueError, match=f"Limits.{name} must be") as refused:
        Limits(**{name: value})
    assert "\n" not in str(refused.value)


def test_limits_that_bypassed_validation_are_an_error_result_not_a_value_error() -> None:
    """Issue #25: NaN raised ValueError out of run_untrusted. Limits built around their
    validation (object.__setattr__ on the frozen dataclass) end as the status error."""
    limits = Limits()
    object.__setattr__(limits, "wall_seconds", float("nan"))
    result = run_untrusted("def main(p):\n    return 1\n", limits=limits)
    assert result.status == "error"
    assert "Limits.wall_seconds" in (result.error or "")


def test_a_result_nested_50000_deep_is_an_error() -> None:
    """Issue #25: it ended crashed (the child's json.dumps raised RecursionError)."""
    result = run(
        """
        def main(payload):
            value = []
            for _ in range(50_000):
                value = [value]
            return value
        """
    )
    assert result.status == "error", (result.error, result.logs[-500:])
    assert "nested" in (result.error or "")


def test_pending_signals_are_capped() -> None:
    """Issue #25: a snippet queued its uid's whole RLIMIT_SIGPENDING (96,363 real-time
    signals), after which another process of that uid failed timer_create."""
    result = run(
        """
        import errno, signal, threading
        def main(payload):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN})
            queued, me = 0, threading.get_ident()
            while queued < 200_000:
                try:  # tgkill: a real-time signal queued with its info, or EAGAIN
                    signal.pthread_kill(me, signal.SIGRTMIN)
                except OSError as exc:
                    return [queued, exc.errno == errno.EAGAIN]
                queued += 1
            return [queued, False]
        """,
        limits=Limits(cpu_seconds=5, wall_seconds=30),
    )
    assert result.status == "ok", result.error
    queued, refused = result.output
    assert refused and queued <= sandbox_child().MAX_PENDING_SIGNALS, result.output


def sandbox_child() -> Any:
    """The launcher module (standard library only: importing it is harmless)."""
    import importlib

    return importlib.import_module("worker_runtime.sandbox._child")


def test_max_rss_is_the_childs_own_peak_not_the_workers() -> None:
    """Issue #25: a trivial snippet reported 319 MiB beside a 300 MiB worker (wait4's
    ru_maxrss counts the memory the child held before its exec); its own peak was 12.5 MiB."""
    ballast = bytearray(b"\x01") * (300 << 20)  # resident in this "worker"
    try:
        trivial = run("def main(payload):\n    return 1\n")
        grown = run(
            """
            def main(payload):
                block = bytearray(b"\\x01") * (150 << 20)
                return len(block)
            """
        )
    finally:
        del ballast
    assert trivial.status == "ok" and grown.status == "ok", (trivial.error, grown.error)
    assert 0 < trivial.max_rss_bytes < 100 << 20, trivial.max_rss_bytes
    assert 150 << 20 <= grown.max_rss_bytes < 290 << 20, grown.max_rss_bytes


# -- The escape matrix, as root and as non-root, checking the worker after each --------------
#
# A driver plays the service: a "supervisor" process starts a "worker" process (same uid),
# which runs the attack through run_untrusted, then a benign snippet. Both record their own
# state (rlimits, and per thread: nice, scheduling policy, affinity, I/O priority; open
# descriptors) before and after. As "nonroot" both run as uid/gid 65534 with no groups.

DRIVER = r"""
import ctypes, json, os, resource, subprocess, sys, tempfile, threading, time
sys.path.insert(0, sys.argv[1])
spec = json.loads(sys.argv[2])
from {package}.cli.main import _nondumpable  # what the real supervisor and worker processes
_nondumpable()  # run first
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
IOPRIO_GET = {"x86_64": 252, "aarch64": 31}.get(os.uname().machine)

def state():
    tids = sorted(int(t) for t in os.listdir("/proc/self/task"))
    return {
        "rlimits": {n: resource.getrlimit(getattr(resource, n))
                    for n in sorted(dir(resource)) if n.startswith("RLIMIT_")},
        "threads": {str(t): [os.getpriority(os.PRIO_PROCESS, t), os.sched_getscheduler(t),
                             sorted(os.sched_getaffinity(t)),
                             libc.syscall(IOPRIO_GET, 1, t) if IOPRIO_GET else None]
                    for t in tids},
        "fds": sorted(os.listdir("/proc/self/fd")),
    }

stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()  # threads to attack
if spec["role"] == "supervisor":
    before = state()
    done = subprocess.run([sys.executable, "-I", __file__, sys.argv[1],
                           json.dumps({**spec, "role": "worker"})],
                          capture_output=True, text=True, timeout=900)
    print(json.dumps({"supervisor": [before, state()], "worker_exit": done.returncode,
                      "worker": done.stdout, "worker_stderr": done.stderr[-3000:]}))
    sys.exit(0)
from {package} import sandbox
tempfile.tempdir = spec["workdirs"]
results = []
for attack in spec["runs"]:
    sandbox._DISABLED_LAYERS = frozenset(attack["off"])
    payload = {"worker": os.getpid(), "supervisor": os.getppid(), **attack.get("payload", {})}
    limits = sandbox.Limits(**attack["limits"])
    before = state()
    sibling = dumpable = None
    if attack.get("dumpable"):  # a process of the same uid that never became non-dumpable
        dumpable = subprocess.Popen(["sleep", "60"], env={"TOKEN": "hunter2"})
        payload["dumpable"] = dumpable.pid
    if attack.get("sibling"):  # another tenant's run, in flight beside the attack
        sibling = threading.Thread(target=sandbox.run_untrusted, args=(attack["sibling"], None),
                                   kwargs={"limits": sandbox.Limits(wall_seconds=30)})
        sibling.start()
    try:
        if attack.get("check"):
            layers = sandbox.check_sandbox()
            result = {"status": "ok", "output": None, "error": None, "logs": "",
                      "layers": list(layers)}
        else:
            result = sandbox.run_untrusted(attack["source"], payload, limits=limits).to_dict()
    except sandbox.SandboxUnavailableError as exc:
        result = {"status": "refused", "output": None, "error": str(exc), "logs": "",
                  "layers": []}
    if dumpable is not None:
        dumpable.kill()
        dumpable.wait()
    if sibling is not None:
        sibling.join()
        while os.path.exists(f"/proc/self/task/{sibling.native_id}"):  # the OS thread's exit
            time.sleep(0.01)
    after = state()
    sandbox._DISABLED_LAYERS = frozenset()
    benign = sandbox.run_untrusted("def main(p):\n    return p + 1\n", 41)
    results.append({"result": result, "state": [before, after],
                    "benign": [benign.status, benign.output]})
print(json.dumps({"results": results}))
"""

NOBODY = 65534

PRELUDE = """
import ctypes, errno, os, signal, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(fn, *args):
    ctypes.set_errno(0)
    return [fn(*args), ctypes.get_errno()]
class RLimit(ctypes.Structure):
    _fields_ = [("cur", ctypes.c_ulong), ("max", ctypes.c_ulong)]
def prlimit(pid, which, value):
    return call(libc.prlimit, pid, which, ctypes.byref(RLimit(value, value)), None)
def tids(pid):
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]
def targets(p):
    return tids(p["worker"]) + tids(p["supervisor"])
"""

DEEP = 100_000

#: name -> (source without the prelude, accepted statuses, every [ret, errno] must be refused)
ESCAPES: dict[str, tuple[str, set[str], bool]] = {
    "prlimit-worker-nofile": ("def main(p):\n    return {'r': prlimit(p['worker'], 7, 4)}",
                              {"ok"}, True),
    "prlimit-worker-cpu": ("def main(p):\n    return {'r': prlimit(p['worker'], 0, 1)}",
                           {"ok"}, True),
    "prlimit-worker-fsize": ("def main(p):\n    return {'r': prlimit(p['worker'], 1, 0)}",
                             {"ok"}, True),
    "prlimit-supervisor-nofile": (
        "def main(p):\n    return {'r': prlimit(p['supervisor'], 7, 4)}", {"ok"}, True),
    "renice-threads-and-uid": (
        "def main(p):\n"
        "    out = {str(t): call(libc.setpriority, 0, t, 19) for t in targets(p)}\n"
        "    out['user'] = call(libc.setpriority, 2, 0, 19)\n"
        "    out['group'] = call(libc.setpriority, 1, p['worker'], 19)\n"
        "    return out", {"ok"}, True),
    "pin-threads": (
        "def main(p):\n"
        "    mask = ctypes.c_ulong(1)\n"
        "    return {str(t): call(libc.sched_setaffinity, t, 8, ctypes.byref(mask))\n"
        "            for t in targets(p)}", {"ok"}, True),
    "sched-idle-threads": (
        "def main(p):\n"
        "    prio = ctypes.c_int(0)\n"
        "    return {str(t): call(libc.sched_setscheduler, t, 5, ctypes.byref(prio))\n"
        "            for t in targets(p)}", {"ok"}, True),
    "ioprio-idle": (
        "def main(p):\n"
        "    nr = {'x86_64': 251, 'aarch64': 30}[os.uname().machine]\n"
        "    out = {str(t): call(libc.syscall, nr, 1, t, 3 << 13) for t in targets(p)}\n"
        "    out['user'] = call(libc.syscall, nr, 3, os.getuid(), 3 << 13)\n"
        "    return out", {"ok"}, True),
    "sysv-shm-msg-sem": (
        "def main(p):\n"
        "    return {'shm': call(libc.shmget, 0x5A5A, 64 << 20, 0o1666),\n"
        "            'shm-private': call(libc.shmget, 0, 64 << 20, 0o1666),\n"
        "            'msg': call(libc.msgget, 0x5A5B, 0o1666),\n"
        "            'sem': call(libc.semget, 0x5A5C, 1, 0o1666)}", {"ok"}, True),
    "posix-mq": (
        "def main(p):\n"
        "    flags = os.O_CREAT | os.O_RDWR\n"
        "    return {'mq': call(libc.mq_open, b'/sandbox-mq', flags, 0o600, None)}",
        {"ok"}, True),
    "posix-shm-and-tmp-files": (  # refused by Landlock, or private: drive() checks
        "def main(p):\n"
        "    for path in ('/dev/shm/escape-left', '/tmp/escape-left', '/var/tmp/escape-left'):\n"
        "        try:\n"
        "            open(path, 'w').write('x')\n"
        "        except OSError:\n"
        "            pass\n"
        "    libc.shm_open(b'/escape-shm', os.O_CREAT | os.O_RDWR, 0o600)", {"ok"}, False),
    "read-etc-shadow": ("def main(p):\n    return open('/etc/shadow').read()", {"forbidden"},
                        False),
    "forge-deep-result": (
        f"DEEP = {DEEP}\n"
        "def main(p):\n"
        "    os.write(3, b'{\"status\": \"ok\", \"output\": ' + b'[' * DEEP + b']' * DEEP"
        " + b'}\\n')\n"
        "    os._exit(0)", {"error"}, False),
    "forge-nan-result": (
        "def main(p):\n"
        "    os.write(3, b'{\"status\": \"ok\", \"output\": [NaN, Infinity]}\\n')\n"
        "    os._exit(0)", {"error"}, False),
    "chmod-private-dir": (
        "def main(p):\n"
        "    for i in range(50):\n"
        "        os.makedirs(f'd{i}/e/f', exist_ok=True)\n"
        "        open(f'd{i}/e/f/x', 'w').write('x' * 1000)\n"
        "        os.chmod(f'd{i}/e/f', 0)\n"
        "        os.chmod(f'd{i}', 0o500)\n"
        "    os.symlink('/etc', 'link-out')\n"
        "    here = os.open('.', os.O_RDONLY)\n"
        "    for _ in range(1500):\n"
        "        os.mkdir('n')\n"
        "        os.chdir('n')\n"
        "    os.fchdir(here)\n"
        "    os.chmod('.', 0o500)\n"
        "    return 'ok'", {"ok"}, False),
    "fsetown-fsetsig-worker": (
        "import fcntl\n"
        "def main(p):\n"
        "    r, w = os.pipe()\n"
        "    pid = ctypes.c_int(p['worker'])\n"
        "    out = {'setown': call(libc.fcntl, r, 8, p['worker']),\n"
        "           'setsig': call(libc.fcntl, r, 10, 9),\n"
        "           'setown_ex': call(libc.fcntl, r, 15, None),\n"
        "           'fiosetown': call(libc.ioctl, r, 0x8901, ctypes.byref(pid)),\n"
        "           'siocspgrp': call(libc.ioctl, r, 0x8902, ctypes.byref(pid))}\n"
        "    fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC)\n"
        "    os.write(w, b'x')\n"
        "    return out", {"ok"}, True),
    "kill-everything": ("def main(p):\n    os.kill(-1, signal.SIGKILL)", {"forbidden"}, False),
    "kill-worker": ("def main(p):\n    os.kill(p['worker'], signal.SIGKILL)", {"forbidden"},
                    False),
    "leave-the-group": ("def main(p):\n    os.setsid()", {"forbidden"}, False),
    "exec-a-shell": ("def main(p):\n    os.execv('/bin/sh', ['sh', '-c', 'true'])",
                     {"forbidden"}, False),
    "x32-syscall": ("def main(p):\n    return call(libc.syscall, 0x40000000 | 39)",
                    {"forbidden"}, False),
    "kernel-interfaces": (
        "def main(p):\n"
        "    if os.uname().machine != 'x86_64':\n"
        "        return {}\n"
        "    buf = ctypes.create_string_buffer(64)\n"
        "    w = p['worker']\n"
        "    return {'ptrace': call(libc.syscall, 101, 16, w, 0, 0),\n"
        "            'process_vm_readv': call(libc.syscall, 310, w, buf, 1, buf, 1, 0),\n"
        "            'pidfd_open': call(libc.syscall, 434, w, 0),\n"
        "            'pidfd_getfd': call(libc.syscall, 438, 0, 0, 0),\n"
        "            'perf_event_open': call(libc.syscall, 298, buf, w, -1, -1, 0),\n"
        "            'bpf': call(libc.syscall, 321, 0, buf, 64),\n"
        "            'keyctl': call(libc.syscall, 250, 0, -3, 0),\n"
        "            'unshare': call(libc.syscall, 272, 0x10000000),\n"
        "            'mount': call(libc.syscall, 165, b'none', b'/tmp', b'tmpfs', 0, None),\n"
        "            'io_uring_setup': call(libc.syscall, 425, 8, buf),\n"
        "            'userfaultfd': call(libc.syscall, 323, 0),\n"
        "            'socket': call(libc.syscall, 41, 2, 1, 0),\n"
        "            'memfd_create': call(libc.syscall, 319, b'x', 0),\n"
        "            'setuid0': call(libc.syscall, 105, 0)}", {"ok"}, True),
    "threads-work": (
        "def main(p):\n"
        "    done = []\n"
        "    threads = [threading.Thread(target=done.append, args=(i,)) for i in range(8)]\n"
        "    [t.start() for t in threads]\n"
        "    [t.join() for t in threads]\n"
        "    return len(done)", {"ok"}, False),
    "thread-bomb": (
        "import time\n"
        "def main(p):\n"
        "    stop = threading.Event()\n"
        "    while True:\n"
        "        threading.Thread(target=stop.wait, daemon=True).start()\n"
        "        time.sleep(0.001)", {"forbidden"}, False),
}  # fmt: skip

#: The older attacks of MATRIX, through the driver too.
#: Limits of an attack other than FAST.
ESCAPE_LIMITS: dict[str, Limits] = {
    "chmod-private-dir": Limits(cpu_seconds=5, wall_seconds=20),  # Landlock checks every level
}
for _name, _source, _limits, _expected in MATRIX:
    if _name not in ("return-100mb",):  # 1 GiB address space: in-process only
        ESCAPES[f"matrix-{_name}"] = (textwrap.dedent(_source), {_expected}, False)
        ESCAPE_LIMITS[f"matrix-{_name}"] = _limits

#: Layer configurations: (identity, layers switched off).
#: The one configuration without a file wall: its runs are refused (SandboxUnavailableError),
#: always (issue #25 removed the opt-in): test_no_file_wall_is_refused. The matrices run WALLED.
NO_FILE_WALL = "nonroot-no-userns-no-landlock"
CONFIGS: dict[str, tuple[str, frozenset[str]]] = {
    "root": ("root", frozenset()),
    "nonroot": ("nonroot", frozenset()),
    "root-no-landlock": ("root", frozenset({"landlock"})),
    "nonroot-no-userns": ("nonroot", frozenset({"userns"})),  # a restricted pod
    "nonroot-no-userns-no-landlock": ("nonroot", frozenset({"userns", "landlock"})),
    "nonroot-no-landlock": ("nonroot", frozenset({"landlock"})),  # gVisor: userns, no Landlock
}
WALLED = [config for config in CONFIGS if config != NO_FILE_WALL]


def driver_python() -> str | None:
    """An interpreter uid 65534 can run (the test's own may live under /root)."""
    candidates = (os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3")
    for candidate in candidates:
        try:
            done = subprocess.run(
                [candidate, "-I", "-c", "import ctypes, json, selectors, resource"],
                user=NOBODY,
                group=NOBODY,
                extra_groups=[],
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return candidate
    return None


@pytest.fixture(scope="module")
def driver_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The package and pyseccomp, copied where uid 65534 can read them."""
    import pyseccomp  # type: ignore[import-untyped]

    tree = Path(tempfile.mkdtemp(prefix="sandbox-driver-", dir="/tmp"))
    try:
        package = Path(sandbox.__file__).parent.parent  # worker_runtime
        shutil.copytree(package, tree / package.name, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(pyseccomp.__file__, tree / "pyseccomp.py")
        (tree / "driver.py").write_text(DRIVER.replace("{package}", package.name))
        for path in [tree, *tree.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield tree
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def ipc_objects() -> dict[str, list[str]]:
    """IPC objects and shared files of sandbox uids (65534, or a root worker's own uids)."""

    def sandboxed(uid: int) -> bool:
        return uid == NOBODY or uid >= 2_000_000_000

    found: dict[str, list[str]] = {}
    for kind, column in (("shm", 7), ("msg", 7), ("sem", 4)):
        lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        found[kind] = sorted(
            line.split()[0] for line in lines if sandboxed(int(line.split()[column]))
        )
    for directory in ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue"):  # noqa: S108
        entries = list(os.scandir(directory)) if os.path.isdir(directory) else []
        names = []
        for entry in entries:
            try:
                uid = entry.stat(follow_symlinks=False).st_uid
            except FileNotFoundError:  # another process's, gone meanwhile
                continue
            if sandboxed(uid) and not entry.name.startswith("sandbox-"):  # parallel runs'
                names.append(entry.name)
        found[directory] = sorted(names)
    return found


def own_state() -> dict[str, Any]:
    return {
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "policy": os.sched_getscheduler(0),
        "affinity": sorted(os.sched_getaffinity(0)),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
    }


def drive(
    tree: Path, config: str, runs: list[dict[str, Any]], workdirs: Path
) -> list[dict[str, Any]]:
    """Run ``runs`` one after the other in a fresh supervisor and worker of ``config``.

    After each run: the worker's state is unchanged and a benign snippet returns ok; after
    all: the supervisor's (and this process's) state is unchanged, and no process, private
    directory, IPC object or shared file of theirs is left. Returns the runs' results.
    """
    identity, off = CONFIGS[config]
    kwargs: dict[str, Any] = {}
    python = sys.executable
    if identity == "root" and os.geteuid() != 0:
        pytest.skip("the root configurations need a root test run")
    if identity == "nonroot" and os.geteuid() == 0:
        found = driver_python()
        if found is None:
            pytest.fail("no Python interpreter that uid 65534 can run")
        python = found
        kwargs = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
        os.chown(workdirs, NOBODY, NOBODY)
    for attack in runs:
        attack["off"] = sorted(off | set(attack.get("off", ())))
    ipc_before, mine_before = ipc_objects(), own_state()
    spec = {"role": "supervisor", "workdirs": str(workdirs), "runs": runs}
    done = subprocess.run(
        [python, "-I", str(tree / "driver.py"), str(tree), json.dumps(spec)],
        capture_output=True, text=True, timeout=1200, env={**os.environ, **SECRETS}, **kwargs,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["worker_exit"] == 0, report["worker_stderr"]
    reports = json.loads(report["worker"])["results"]
    problems = []
    for attack, run_report in zip(runs, reports, strict=True):
        name = attack.get("name", "run")
        before, after = run_report["state"]
        if after != before:
            problems.append(f"{name}: the worker was changed: {before} -> {after}")
        if run_report["benign"] != ["ok", 42]:
            problems.append(f"{name}: a benign snippet no longer runs: {run_report['benign']}")
    assert problems == []
    before, after = report["supervisor"]
    assert after == before, "the supervisor was changed"
    assert own_state() == mine_before
    assert sandbox_processes(str(workdirs)) == []
    assert list(workdirs.iterdir()) == [], "a private directory outlived its run"
    assert ipc_objects() == ipc_before, "an IPC object outlived its run"
    return [run_report["result"] for run_report in reports]


LEFT_BEHIND = [
    f"{directory}/{name}"
    for directory in ("/tmp", "/var/tmp", "/dev/shm")  # noqa: S108
    for name in ("tenant-a", "escape-left", "escape-shm")
]


@functools.cache
def world_writable_dirs() -> list[str]:
    """Every world-writable directory of this machine (find(1), not the sandbox's own walk),
    what lies below one left out; /proc and /sys too."""
    found = subprocess.run(
        ["find", "/", "(", "-path", "/proc", "-o", "-path", "/sys", ")", "-prune", "-o",
         "-type", "d", "-perm", "-0002", "-print", "-prune"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    return sorted(line for line in found.stdout.splitlines() if line)


def _listing(place: str) -> list[str]:
    """The names in ``place``; none when it is gone (a world-writable directory of another
    program, e.g. a container build's layer, may vanish while a test runs)."""
    try:
        return os.listdir(place)
    except FileNotFoundError:
        return []


@pytest.fixture
def files_left_behind() -> Iterator[None]:
    """Removes what the attacks try to leave in shared directories, after the test (they
    do, in the one configuration without any filesystem wall), so no later test sees it."""
    yield
    for path in LEFT_BEHIND + [f"{place}/tenant-a" for place in world_writable_dirs()]:
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(path)


def refused(output: Any) -> list[str]:
    """The [ret, errno] pairs of an attack's output that the kernel did not refuse."""
    return [f"{name}: {pair}" for name, pair in output.items() if pair[0] != -1]


def attack_runs(names: list[str]) -> list[dict[str, Any]]:
    return [
        {"name": name, "source": PRELUDE + ESCAPES[name][0],
         "limits": asdict(ESCAPE_LIMITS.get(name, FAST))}
        for name in names
    ]  # fmt: skip


def failed_attacks(names: list[str], results: list[dict[str, Any]]) -> list[str]:
    """Attacks whose status was not the expected one, or that the kernel did not refuse."""
    failures = []
    for name, result in zip(names, results, strict=True):
        _, expected, check_refused = ESCAPES[name]
        if result["status"] not in expected:
            failures.append(f"{name}: {result['status']} {result['error']} {result['logs'][-300:]}")
        elif check_refused and refused(result["output"]):
            failures.append(f"{name}: not refused: {refused(result['output'])}")
        elif name == "threads-work" and result["output"] != 8:
            failures.append(f"{name}: {result['output']} threads ran")
    return failures


@pytest.mark.parametrize("config", ["root", "nonroot"])
def test_escapes_leave_the_worker_unaffected(
    config: str, driver_tree: Path, workdirs: Path
) -> None:
    """Every attack, one after the other in one worker, which is checked after each."""
    names = list(ESCAPES)
    results = drive(driver_tree, config, attack_runs(names), workdirs)
    assert failed_attacks(names, results) == []


WITHOUT_SOME_LAYERS = [
    "fsetown-fsetsig-worker", "threads-work", "thread-bomb", "posix-mq",
    "posix-shm-and-tmp-files", "sysv-shm-msg-sem", "prlimit-worker-nofile",
    "prlimit-supervisor-nofile", "renice-threads-and-uid", "pin-threads", "kill-everything",
    "kill-worker", "read-etc-shadow", "forge-deep-result", "chmod-private-dir",
]  # fmt: skip


@pytest.mark.parametrize("config", ["root-no-landlock", "nonroot-no-userns", "nonroot-no-landlock"])
@pytest.mark.usefixtures("files_left_behind")
def test_escapes_without_some_layers(config: str, driver_tree: Path, workdirs: Path) -> None:
    """The kernel of a restricted pod (no user namespaces), or one without Landlock (the
    configuration without either is refused: test_no_file_wall_is_refused)."""
    names = list(WITHOUT_SOME_LAYERS)
    results = drive(driver_tree, config, attack_runs(names), workdirs)
    assert failed_attacks(names, results) == []


@pytest.mark.parametrize("config", WALLED)
def test_threads_work_up_to_max_threads(config: str, driver_tree: Path, workdirs: Path) -> None:
    source = PRELUDE + (
        "import time\n"
        "def main(p):\n"
        "    stop, started = threading.Event(), 0\n"
        "    try:\n"
        "        for _ in range(p['want']):\n"
        "            threading.Thread(target=stop.wait, daemon=True).start()\n"
        "            started += 1\n"
        "        time.sleep(0.2)\n"
        "    finally:\n"
        "        stop.set()\n"
        "    return started\n"
    )
    limits = {**asdict(FAST), "max_threads": 6}
    runs = [
        {"source": source, "limits": limits, "payload": {"want": 5}},  # 6 with the main one
        {"source": source, "limits": limits, "payload": {"want": 50}},
        {"source": source, "limits": limits, "payload": {"want": 5}, "off": ["seccomp"]},
    ]
    fits, bomb, unfiltered = drive(driver_tree, config, runs, workdirs)
    assert (fits["status"], fits["output"]) == ("ok", 5), fits["error"]
    assert bomb["status"] == "forbidden", bomb["error"]
    assert "thread limit" in bomb["error"]
    assert (unfiltered["status"], unfiltered["output"]) == ("ok", 5), unfiltered["error"]


#: Another tenant's run, in flight while PROC_ATTACK runs.
SIBLING = "import time\ndef main(p):\n    time.sleep(6)\n"

#: Reads the environment and writes the memory of the supervisor, the worker and a sibling
#: run (found by its command line once its seccomp filter is loaded, that is, once set up),
#: and lists their working directory and descriptors. Every one must be refused.
PROC_ATTACK = (
    PRELUDE
    + """
import time
def probe(path, flags):
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        return ["refused", exc.errno]
    try:
        return ["opened", os.read(fd, 4096).decode(errors="replace")]
    except OSError as exc:
        return ["opened", repr(exc)]
    finally:
        os.close(fd)
def listing(path):
    try:
        return ["opened", os.listdir(path)]
    except OSError as exc:
        return ["refused", exc.errno]
def find_sibling(marker):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not any(name.isdigit() for name in os.listdir("/proc")):
            return None  # a /proc of its own (private-proc): no process to find
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{name}/status") as f:
                    status = f.read()
            except OSError:
                continue
            if b"sandbox/_child.py" in cmdline and marker.encode() in cmdline \\
                    and "Seccomp:\\t2" in status:
                return int(name)
        time.sleep(0.02)
    return None
def main(p):
    out = {"proc": sorted(os.listdir("/proc"))}
    sibling = find_sibling(p["marker"])
    for role, pid in (("supervisor", p["supervisor"]), ("worker", p["worker"]),
                      ("sibling", sibling), ("dumpable", p.get("dumpable"))):
        if pid is None:
            out[role] = "not found"
            continue
        out[role + "-environ"] = probe(f"/proc/{pid}/environ", os.O_RDONLY)
        out[role + "-mem"] = probe(f"/proc/{pid}/mem", os.O_RDWR)
        out[role + "-cwd"] = listing(f"/proc/{pid}/cwd")
        out[role + "-fd"] = listing(f"/proc/{pid}/fd")
        out[role + "-fd0"] = probe(f"/proc/{pid}/fd/0", os.O_RDONLY)
    return out
"""
)


@pytest.mark.parametrize("config", WALLED)
@pytest.mark.usefixtures("files_left_behind")
def test_no_other_process_of_the_pod_is_open_to_a_snippet(
    config: str, driver_tree: Path, workdirs: Path
) -> None:
    """Issue #25: with the worker's uid (no user namespaces, or no Landlock), a snippet read
    the supervisor's secrets from /proc/<pid>/environ, wrote code into it through
    /proc/<pid>/mem, and listed a sibling run's private directory through /proc/<pid>/cwd.
    Every process of the pod but the snippet is non-dumpable (the supervisor and the worker
    processes from __main__'s first lines, the launcher from its own), so each is refused;
    where the run has a mount namespace its /proc shows itself alone (private-proc), which
    also hides processes in their first milliseconds, still dumpable. A process of the
    worker's uid that stays dumpable (``sleep``: what any process is from its exec until its
    first lines run) is refused too, in every configuration that runs: private-proc, or
    Landlock's ptrace scope (the one with neither is refused: test_no_file_wall_is_refused)."""
    limits = asdict(Limits(cpu_seconds=5, wall_seconds=30))
    runs = [{"source": PROC_ATTACK, "limits": limits, "sibling": SIBLING, "dumpable": True,
             "payload": {"marker": str(workdirs)}}]  # fmt: skip
    (result,) = drive(driver_tree, config, runs, workdirs)
    assert result["status"] == "ok", (result["error"], result["logs"][-2000:])
    output = result["output"]
    visible = output.pop("proc")
    if "private-proc" in result["layers"]:  # it sees itself alone: not the sibling either
        assert visible == ["self"], visible
        assert output.pop("sibling") == "not found"
    else:
        assert "sibling" not in output, "the sibling run was not found"
    # Listing /proc/<pid>/fd checks the directory's owner and mode only: where Landlock is the
    # wall, a process of the same uid still dumpable shows its descriptor numbers (never what
    # they are: dumpable-fd0 is refused, as are its environ, mem and cwd).
    listed = output.pop("dumpable-fd")
    assert listed[0] == "refused" or all(name.isdigit() for name in listed[1]), listed
    opened = {name: pair for name, pair in output.items() if pair[0] != "refused"}
    assert opened == {}
    assert "hunter2" not in json.dumps(output)


TENANT_A = (
    PRELUDE
    + """
def main(p):
    secret = "tenant-a-secret"
    left = {}
    places = p.get("places", ["/tmp", "/dev/shm", "/var/tmp"])
    for path in [f"{place}/tenant-a" for place in places] + ["left.txt"]:
        try:
            with open(path, "w") as f:
                f.write(secret)
            left[path] = True
        except OSError:
            left[path] = False
    left["shm"] = call(libc.shmget, 0x7E7A, 4096, 0o1666)
    left["msg"] = call(libc.msgget, 0x7E7B, 0o1666)
    left["mq"] = call(libc.mq_open, b"/tenant-a", os.O_CREAT | os.O_RDWR, 0o666, None)
    return left
"""
)

TENANT_B = (
    PRELUDE
    + """
def main(p):
    found = {}
    places = p.get("places", ["/tmp", "/dev/shm", "/var/tmp"])
    for path in [f"{place}/tenant-a" for place in places] + [
            "left.txt", os.path.join(os.path.dirname(os.getcwd()))]:
        try:
            found[path] = os.listdir(path) if os.path.isdir(path) else open(path).read()
        except OSError as exc:
            found[path] = None
    found["shm"] = call(libc.shmget, 0x7E7A, 0, 0)[0] != -1
    found["msg"] = call(libc.msgget, 0x7E7B, 0)[0] != -1
    found["mq"] = call(libc.mq_open, b"/tenant-a", os.O_RDONLY, 0, None)[0] != -1
    return found
"""
)


@pytest.mark.parametrize("config", WALLED)
@pytest.mark.usefixtures("files_left_behind")
def test_tenant_b_finds_nothing_of_tenant_a(config: str, driver_tree: Path, workdirs: Path) -> None:
    """Tenant A writes into every world-writable directory of the machine (found by find(1):
    /tmp, /var/tmp, /dev/shm, /run/lock here), B looks there. Issue #25: /run/lock (1777)
    was not private for a root worker without Landlock; A's file reached B and stayed."""
    limits = asdict(FAST)
    places = {"places": world_writable_dirs()}
    assert "/tmp" in places["places"], places  # noqa: S108
    runs = [{"source": TENANT_A, "limits": limits, "payload": places},
            {"source": TENANT_B, "limits": limits, "payload": places}]  # fmt: skip
    a, b = drive(driver_tree, config, runs, workdirs)
    assert a["status"] == "ok", a["error"]
    assert b["status"] == "ok", b["error"]
    assert "tenant-a-secret" not in json.dumps(b["output"])
    assert not (b["output"]["shm"] or b["output"]["msg"] or b["output"]["mq"]), b["output"]
    for place in places["places"]:
        assert not os.path.exists(f"{place}/tenant-a"), f"tenant A left {place}/tenant-a"


#: Tenant A appends to a file of the host, B reads it back.
PLANTED_A = """
def main(p):
    try:
        with open(p["file"], "a") as f:
            f.write("tenant-a-secret")
    except OSError as exc:
        return ["refused", exc.errno]
    return ["written"]
"""

PLANTED_B = """
def main(p):
    try:
        with open(p["file"]) as f:
            return f.read()
    except OSError as exc:
        return exc.errno
"""


@pytest.fixture
def planted_file() -> Iterator[Path]:
    """A world-writable file (0666) in a directory only root may write (0755): the walk for
    writable directories does not find it."""
    if os.geteuid() != 0:
        pytest.skip("planting a root-owned file needs a root test run")
    directory = Path(tempfile.mkdtemp(prefix="sandbox-planted-", dir="/var/lib"))
    try:
        directory.chmod(0o755)
        planted = directory / "shared.txt"
        planted.write_text("")
        planted.chmod(0o666)
        yield planted
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize(
    ("config", "off"),
    [(config, []) for config in WALLED]
    + [("root-no-landlock", ["mount_setattr"]), ("nonroot-no-landlock", ["mount_setattr"])],
    ids=lambda value: "-".join(value) if isinstance(value, list) else value,
)
def test_a_world_writable_file_is_no_channel(
    config: str, off: list[str], driver_tree: Path, workdirs: Path, planted_file: Path
) -> None:
    """Issue #25: the walk found world-writable directories only; a world-writable file
    elsewhere was a channel between tenants (and to the host) without Landlock. Every mount
    of the run's namespace is now read-only but its own tmpfs (mount_setattr, or one mount
    at a time on an older kernel: off=mount_setattr), so A's write is refused everywhere
    (Landlock: EACCES; read-only: EROFS) and the host's file stays empty."""
    limits = asdict(FAST)
    payload = {"file": str(planted_file)}
    runs = [{"source": PLANTED_A, "limits": limits, "payload": payload, "off": off},
            {"source": PLANTED_B, "limits": limits, "payload": payload, "off": off}]  # fmt: skip
    a, b = drive(driver_tree, config, runs, workdirs)
    assert a["status"] == "ok", a["error"]
    assert b["status"] == "ok", b["error"]
    assert a["output"][0] == "refused", a["output"]
    assert "tenant-a-secret" not in json.dumps(b["output"])
    assert planted_file.read_text() == ""


DISK_BYTES = """
import errno
def main(p):
    n = 0
    while True:  # in the private directory and in every shared place, 512 KiB at a time
        for place in [".", *p["places"]]:
            try:
                with open(f"{place}/fill-{n}", "wb") as f:
                    f.write(b"x" * (512 * 1024))
            except OSError as exc:  # refused by Landlock, or a read-only place
                if exc.errno == errno.ENOSPC:
                    raise
            n += 1
"""

DISK_FILES = """
def main(p):
    n = 0
    while True:
        open(f"empty-{n}", "w").close()
        n += 1
"""


@pytest.mark.parametrize("config", WALLED)
@pytest.mark.usefixtures("files_left_behind")
def test_what_a_run_writes_is_bounded_in_total(
    config: str, driver_tree: Path, workdirs: Path
) -> None:
    """Issue #25: one run wrote 700 MiB to the worker's temp directory in under 2 s (only
    the per-file limit applied) and 93,500 files. Now a run's writes, all files and places
    together, stop at Limits.max_disk_bytes and max_files: the status disk. With a mount
    namespace the run's own tmpfs bounds them; without one the worker measures the private
    directory every 20 ms (where Landlock keeps the writes)."""
    limits = asdict(Limits(cpu_seconds=10, wall_seconds=30, max_disk_bytes=4 << 20,
                           max_files=200))  # fmt: skip
    places = {"places": world_writable_dirs()}
    runs = [{"source": DISK_BYTES, "limits": limits, "payload": places},
            {"source": DISK_FILES, "limits": limits}]  # fmt: skip
    started = time.monotonic()
    by_bytes, by_files = drive(driver_tree, config, runs, workdirs)
    for result in (by_bytes, by_files):
        assert result["status"] == "disk", (result["status"], result["error"])
        assert "disk limit" in result["error"]
    assert time.monotonic() - started < 120
    for place in places["places"]:
        assert not [name for name in _listing(place) if name.startswith("fill-")], place


@pytest.mark.usefixtures("files_left_behind")
def test_no_file_wall_is_refused(driver_tree: Path, workdirs: Path) -> None:
    """A non-root worker with neither Landlock nor user namespaces: the snippet would keep the
    worker uid's file rights (other runs' private directories, the pod's state files, files
    that outlive the run) and see processes of the pod still dumpable at their start, so
    every run and the boot check are refused before the snippet starts, naming the missing
    layers. Issue #25: there is no opt-in any more (it ran the snippet, which read the
    supervisor's secrets in that configuration). The worker stays as it was (drive checks)."""
    limits = asdict(FAST)
    runs: list[dict[str, Any]] = [
        {"source": TENANT_A, "limits": limits},
        {"source": PROC_ATTACK, "limits": limits, "payload": {"marker": str(workdirs)}},
        {"source": "", "limits": limits, "check": True},
    ]
    for result in drive(driver_tree, NO_FILE_WALL, runs, workdirs):
        assert result["status"] == "refused", result
        for named in ("landlock-fs", "private-mounts", "gVisor"):
            assert named in result["error"]
        assert "SANDBOX_ALLOW_UNCONTAINED_WRITES" not in result["error"]
    for path in ("/tmp/tenant-a", "/dev/shm/tenant-a", "/var/tmp/tenant-a"):  # noqa: S108
        assert not os.path.exists(path), f"the refused snippet ran: {path}"


@pytest.mark.usefixtures("jobs")  # the service's broker built on the test's Redis first
def test_the_sandbox_pool_refuses_to_boot_where_the_sandbox_cannot_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sandbox pool's worker process reports a refusal once, at boot: one line, exit 78
    (EX_CONFIG, which its supervisor exits with too), instead of failing every job. (Its
    actor module is imported in this process: after the ``jobs`` fixture built the broker,
    which a later test's ``jobs`` reuses.)"""
    from service.actors import sandbox as actor
    from worker_runtime.exitcodes import EX_CONFIG
    from worker_runtime.settings import ConfigRefused

    asked: list[bool] = []

    def refuse_here() -> tuple[str, ...]:
        asked.append(True)
        raise sandbox.SandboxUnavailableError("refused: no layer contains\nthe writes")

    monkeypatch.setattr(actor, "check_sandbox", refuse_here)
    actor._check_at_boot(False)  # not a worker of the sandbox pool: nothing to check
    assert asked == []
    with pytest.raises(ConfigRefused) as refused:
        actor._check_at_boot(True)
    assert refused.value.code == EX_CONFIG and asked == [True]
    assert refused.value.lines == [
        "the sandbox cannot run here: refused: no layer contains the writes"
    ]
    assert capsys.readouterr().err.count("\n") == 1
    monkeypatch.setattr(actor, "check_sandbox", lambda: ("rlimits",))
    actor._check_at_boot(True)  # the real check passes: no refusal


#: Runs the worker command under a seccomp filter that plays a node without Landlock
#: (``landlock_create_ruleset`` fails with ENOSYS) whose container runtime refuses
#: ``unshare`` (no user, mount, IPC or network namespace): no file wall, whoever runs it.
NO_WALL_NODE = """
import errno, os, sys
import pyseccomp as seccomp
node = seccomp.SyscallFilter(seccomp.ALLOW)
node.add_rule(seccomp.ERRNO(errno.EPERM), "unshare")
node.add_rule(seccomp.ERRNO(errno.ENOSYS), "landlock_create_ruleset")
node.load()
os.execv(sys.executable, [sys.executable, "-m", sys.argv[1], "worker"])
"""


def worker_on_a_node_without_walls(
    redis_url: str, state: Path, **env: str
) -> subprocess.Popen[str]:
    """The sandbox pool's real ``worker`` command (supervisor and one worker process)."""
    here = Path(__file__).resolve().parent
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "SANDBOX_"))},
        "PYTHONPATH": templateservice.pythonpath(),
        "WORKER_POOL": "sandbox",
        "WORKER_PROCESSES": "1",
        "WORKER_STATE_DIR": str(state),
        "METRICS_PORT": str(port),
        "REDIS_URL": redis_url,
        **env,
    }
    package = "service"
    return subprocess.Popen(
        [sys.executable, "-c", NO_WALL_NODE, package], env=environ, cwd=here,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def test_the_sandbox_pool_exits_78_at_boot_on_a_node_without_a_file_wall(
    redis_url: str, tmp_path: Path
) -> None:
    """End to end: the worker command on such a node refuses to boot, one line, exit 78, and
    takes no job; SANDBOX_ALLOW_UNCONTAINED_WRITES=true is refused too (issue #25: that
    opt-in booted and ran snippets that read the supervisor's secrets through /proc)."""
    client = redis.Redis.from_url(redis_url)
    from worker_runtime import layout
    from worker_runtime.exitcodes import EX_CONFIG

    here = Path(__file__).resolve().parent
    send = (
        "from service.producer import enqueue\n"
        "enqueue('run_customer_code', 'def main(p):\\n    return p + 1\\n', 41)\n"
    )
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": templateservice.pythonpath()}
    env.pop("WORKER_POOL", None)
    sent = subprocess.run([sys.executable, "-c", send], env=env, cwd=here,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert sent.returncode == 0, sent.stderr[-2000:]
    ready = layout.queue_key(layout.SANDBOX_QUEUE)
    assert client.llen(ready) == 1
    expected = {
        "plain": ("config error: the sandbox cannot run here: no layer keeps",
                  ("landlock-fs", "private-mounts", "gVisor")),
        "opt-in": ("config error: SANDBOX_ALLOW_UNCONTAINED_WRITES",
                   ("no longer accepted", "gVisor")),
    }  # fmt: skip
    try:
        for name, (start, named) in expected.items():
            extra = {"SANDBOX_ALLOW_UNCONTAINED_WRITES": "true"} if name == "opt-in" else {}
            refused = worker_on_a_node_without_walls(redis_url, tmp_path / name, **extra)
            try:
                _, err = refused.communicate(timeout=120)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(refused.pid, signal.SIGKILL)
            assert refused.returncode == EX_CONFIG, (name, err[-3000:])
            # the worker process's line, repeated by its supervisor (as for every refusal)
            (line,) = {line for line in err.splitlines() if line.startswith("config error:")}
            assert line.startswith(start), line
            for word in named:
                assert word in line, (word, line)
            records = [json.loads(r) for r in err.splitlines() if r.startswith("{")]
            assert not [r for r in records if r.get("event") == "process_died"], "no restart"
            assert "Traceback" not in err
            assert client.llen(ready) == 1, f"the refused pool took a job ({name})"
    finally:
        client.delete(ready, layout.bodies_key(layout.SANDBOX_QUEUE))


def test_only_the_sandbox_pool_walks_the_filesystem(redis_url: str, tmp_path: Path) -> None:
    """The walk for the places a snippet could write (seconds on a big root filesystem) runs
    in the sandbox pool's worker processes alone, once, at their boot check: a worker of
    another pool (``external``: no database needed), fully booted (its consumer's heartbeat
    is in Redis), never logs it."""
    from worker_runtime import layout

    client = redis.Redis.from_url(redis_url)
    here = Path(__file__).resolve().parent
    package = "service"
    walks = {}
    for pool, namespace in (("external", layout.NAMESPACE),
                            ("sandbox", layout.SANDBOX_NAMESPACE)):  # fmt: skip
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        environ = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "SANDBOX_"))},
            "PYTHONPATH": templateservice.pythonpath(),
            "WORKER_POOL": pool,
            "WORKER_PROCESSES": "1",
            "WORKER_STATE_DIR": str(tmp_path / pool),
            "METRICS_PORT": str(port),
            "REDIS_URL": redis_url,
            "LOG_FORMAT": "json",
        }
        before = client.zcard(layout.heartbeats_key(namespace))
        worker = subprocess.Popen(
            [sys.executable, "-m", package, "worker"], env=environ, cwd=here,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while client.zcard(layout.heartbeats_key(namespace)) <= before:
                assert worker.poll() is None, worker.communicate()[1][-3000:]
                assert time.monotonic() < deadline, f"the {pool} pool did not start consuming"
                time.sleep(0.1)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGTERM)
            out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err[-3000:]
        records = [json.loads(line) for line in (out + err).splitlines() if line.startswith("{")]
        walks[pool] = [r for r in records if r.get("event") == "sandbox_places_walked"]
    assert walks["external"] == []
    assert len(walks["sandbox"]) == 1, walks["sandbox"]
    assert walks["sandbox"][0]["directories"] > 0


# -- The result channel cannot hurt the worker ----------------------------------------------

JSONISH = st.text(alphabet='[]{}",:0123456789.eE+-NaInfitynulrs \\u\n\x00\xff', max_size=300)
NASTY = st.one_of(
    st.binary(max_size=2000),
    JSONISH.map(str.encode),
    st.integers(1, 20_000).map(lambda n: b'{"status": "ok", "output": ' + b"[" * n + b"]" * n
                               + b"}"),
    st.sampled_from([b'{"status": "ok", "output": NaN}', b'{"status": "ok", "output": 1e999}',
                     b'{"status": "ok", "output": -Infinity}', b'{"status": "ok", "output": '
                     + b"9" * 5000 + b"}", b'{"status": ["ok"]}', b'{"status": "cpu"}', b"[]",
                     b'{"status": "ok"}\n{"status": "ok"}', b"\xff\xfe"]),
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(NASTY)
def test_any_result_line_decodes_or_is_refused(data: bytes) -> None:
    layers = b'{"layers": ["rlimits"]}\n'
    _, result, problem = sandbox._docs(layers + data + b"\n")
    assert (result is None) or (problem is None)
    if result is not None:
        json.dumps(result, allow_nan=False)  # what to_dict() will need


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(NASTY)
def test_run_untrusted_never_raises_for_a_forged_result(data: bytes) -> None:
    result = run(
        """
        import os
        def main(payload):
            os.write(3, bytes.fromhex(payload) + b"\\n")
            os._exit(0)
        """,
        data.hex(),
        limits=Limits(cpu_seconds=2, wall_seconds=10),
    )
    assert result.status in sandbox.STATUSES
    json.dumps(result.to_dict(), allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, (1 << 22) - 1), st.sampled_from([1, 4]))
def test_the_cached_filter_with_a_pid_written_in_is_the_filter_built_for_it(
    pid: int, max_processes: int
) -> None:
    from worker_runtime.sandbox._seccomp import build_filter, compile_filter

    assert build_filter(pid, max_processes) == compile_filter(pid, max_processes)
