"""The escape matrix of the sandbox: real child processes, a real redis-server.

Every attempt must end as a status while this process (the "worker") keeps running,
keeps its network and keeps its secrets.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from {{ cookiecutter.package }} import sandbox
from {{ cookiecutter.package }}.sandbox import Limits, SandboxResult, run_untrusted

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
            if b"_sandbox_child.py" in cmdline and marker.encode() in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.fixture(autouse=True)
def workdirs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Private directories of this test's runs go under their own directory, so that
    leftovers (processes or files) are this test's and not a parallel test's. It is
    searchable by anyone (mode 0711, like /tmp), as the snippet's own uid needs."""
    parent = Path(tempfile.mkdtemp(prefix="sandbox-test-", dir="/tmp"))
    parent.chmod(0o711)
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
        FAST,
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
def test_writing_outside_the_private_directory_is_forbidden(where: str, tmp_path: Path) -> None:
    directory = {"test-dir": str(tmp_path), "home": str(Path.home())}.get(where, where)
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
    """The worker makes itself non-dumpable: its /proc/<pid>/environ needs CAP_SYS_PTRACE."""
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
    assert result.status == "forbidden", result.error
    assert "hunter2" not in repr(result.output) + result.logs


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
from {{ cookiecutter.package }}.broker import broker
from {{ cookiecutter.package }}.actors.sandbox import run_customer_code
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
    project = Path(__file__).resolve().parents[1]
    env = {**os.environ, "WORKER_POOL": "sandbox", "REDIS_URL": redis_url}
    env["PYTHONPATH"] = os.pathsep.join([str(project / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", ACTOR_SCRIPT],
        env=env,
        cwd=project,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "['cpu', 'ok']"


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="cpu_seconds"):
        Limits(cpu_seconds=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        Limits(memory_bytes=1024)
