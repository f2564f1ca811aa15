"""Fixtures shared by the service's tests: a real redis-server of their own."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

#: How long a starting redis-server may take to answer (loading an append-only file).
START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A redis-server on a free port of 127.0.0.1, never snapshotting.

    Parameters:
      directory: its working directory (must exist).
      appendonly: keep every write in an append-only file in ``directory``, synced on each
        write, so that a restart (``stop()`` then ``start()``) loses nothing; default
        False: nothing on disk, a restart starts empty.
    """

    def __init__(self, directory: Path, appendonly: bool = False) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.directory = directory
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and wait until it answers."""
        executable = shutil.which("redis-server")
        if executable is None:
            pytest.skip("redis-server is not installed")
        self.process = subprocess.Popen(
            [
                executable,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                str(self.directory),
                *self._persistence(),
            ],
            stdout=subprocess.DEVNULL,
        )
        with redis.Redis.from_url(self.url) as client:
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:  # not listening yet, or loading its file
                    time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def _persistence(self) -> list[str]:
        """The append-only options: fsync on every write, or no file at all."""
        if self.appendonly:
            return ["--appendonly", "yes", "--appendfsync", "always"]
        return ["--appendonly", "no"]

    def stop(self) -> None:
        """Stop the server (tests may stop it to simulate an outage)."""
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The session's Redis, emptied before each test."""
    if redis_server.process is None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.close()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the session's Redis (emptied before each test)."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
