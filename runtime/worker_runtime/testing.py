"""The pytest plugin of worker_runtime (entry point ``pytest11``): fixtures for a service's
tests, loaded by installing the runtime.

* ``redis_server`` / ``redis_url`` / ``client``: a private redis-server on a free port of
  127.0.0.1 for the session, emptied before each test;
* ``jobs``: a real Dramatiq worker running the service's actors with the whole middleware
  stack, on that Redis: ``jobs.run(actor, *args)`` enqueues and waits until it is done;
* ``database_url``: the PostgreSQL of ``TEST_DATABASE_URL`` (or ``DATABASE_URL``), else the
  test is skipped;
* :class:`RedisServer` and :class:`Sentinels` for tests that stop, restart or fail over Redis.

A service's first actor test::

    def test_welcome_is_sent_once(jobs: Jobs) -> None:
        from orders_worker.actors.notifications import send_notification

        for _ in range(3):
            jobs.send(send_notification, 7, "welcome", "n-1")
        jobs.wait()
        assert jobs.client.get("idempotency:notification:n-1") == b"done"

The service is the one its package constructs (``worker_runtime.Service``): name the package
in the pytest configuration (``worker_service = "orders_worker"``) or import it first.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis

from .service import Service, current

#: The pytest configuration value that names the service's package.
SERVICE_OPTION = "worker_service"
#: The pytest configuration value that names the pool the ``jobs`` worker runs (default: the
#: first pool of pools.toml whose handlers need no database, so no DATABASE_URL is needed).
POOL_OPTION = "worker_pool"

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
      replica_of: the port of a redis-server on 127.0.0.1 this one replicates (default
        None: a primary).
      options: more ``redis-server`` options, e.g. ``("--maxmemory", "20mb")``.
    """

    def __init__(
        self,
        directory: Path,
        appendonly: bool = False,
        replica_of: int | None = None,
        options: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.directory = directory
        self.appendonly = appendonly
        self.replica_of = replica_of
        self.options = list(options)
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
                *self._replication(),
                *self.options,
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

    def _replication(self) -> list[str]:
        """``--replicaof`` the primary's port, or nothing for a primary."""
        if self.replica_of is None:
            return []
        return ["--replicaof", "127.0.0.1", str(self.replica_of)]

    def stop(self) -> None:
        """Stop the server (tests may stop it to simulate an outage)."""
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def kill(self) -> None:
        """SIGKILL the server: it dies at once, as a crashed or partitioned node does."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


class Sentinels:
    """A primary redis-server, one replica of it and ``count`` redis-sentinel processes that
    monitor it as :attr:`SERVICE`, on free ports of 127.0.0.1, with short failover timings
    (``down-after-milliseconds``, ``failover-timeout``) so a test's failover takes seconds.

    :attr:`url` is the ``REDIS_URL`` that follows the primary through the Sentinels.

    Parameters:
      directory: working directory (must exist): the servers' and Sentinels' files.
      count: Sentinels (default 3, quorum 2).
      down_after_ms: how long the primary must not answer before it is judged down.
      failover_timeout_ms: Sentinel's ``failover-timeout``.
      sentinel_password: the Sentinels' ``requirepass`` (and ``sentinel sentinel-pass``, so
        they talk to each other), carried by :attr:`url` as ``?sentinel_password=``
        (default None: none).
    """

    SERVICE = "primary"

    def __init__(
        self,
        directory: Path,
        count: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 2000,
        sentinel_password: str | None = None,
    ) -> None:
        (directory / "primary").mkdir()
        (directory / "replica").mkdir()
        self.directory = directory
        self.primary = RedisServer(directory / "primary")
        self.replica = RedisServer(directory / "replica", replica_of=self.primary.port)
        self.ports = [free_port() for _ in range(count)]
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.processes: list[subprocess.Popen[bytes]] = []
        self.sentinel_password = sentinel_password
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        self.url = f"redis+sentinel://{hosts}/{self.SERVICE}/0"
        if sentinel_password is not None:
            self.url += f"?sentinel_password={sentinel_password}"

    def start(self) -> None:
        """Start the primary, its replica (synced) and the Sentinels, and wait until every
        Sentinel knows the replica and the other Sentinels (a failover can then happen)."""
        executable = shutil.which("redis-sentinel")
        if executable is None:
            pytest.skip("redis-sentinel is not installed (Debian package redis-sentinel)")
        self.primary.start()
        self.replica.start()
        with redis.Redis(port=self.replica.port) as replica:
            _wait(lambda: replica.info("replication")["master_link_status"] == "up", "sync")
        quorum = len(self.ports) // 2 + 1
        for index, port in enumerate(self.ports):
            config = self.directory / f"sentinel-{index}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
                f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary.port} {quorum}\n"
                f"sentinel down-after-milliseconds {self.SERVICE} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.SERVICE} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.SERVICE} 1\n"
            )
            if self.sentinel_password is not None:
                with config.open("a") as file:
                    file.write(
                        f"requirepass {self.sentinel_password}\n"
                        f"sentinel sentinel-pass {self.sentinel_password}\n"
                    )
            log = (self.directory / f"sentinel-{index}.log").open("ab")
            self.processes.append(
                subprocess.Popen([executable, str(config)], stdout=log, stderr=subprocess.STDOUT)
            )
        for port in self.ports:
            with self.sentinel(port) as sentinel:
                _wait(functools.partial(self._knows_everyone, sentinel), f"sentinel {port}")

    def _knows_everyone(self, sentinel: redis.Redis) -> bool:
        try:
            state = sentinel.sentinel_master(self.SERVICE)
        except redis.RedisError:
            return False
        if not isinstance(state, dict):
            return False
        return bool(
            state["num-slaves"] >= 1 and state["num-other-sentinels"] >= len(self.ports) - 1
        )

    def sentinel(self, port: int, **options: Any) -> redis.Redis:
        """A client of the Sentinel on ``port``, with its password."""
        return redis.Redis(port=port, password=self.sentinel_password, **options)

    def primary_port(self) -> int | None:
        """The port of the primary as the first Sentinel that answers names it (None: none)."""
        for port in self.ports:
            try:
                with self.sentinel(port, socket_timeout=1) as sentinel:
                    address = sentinel.sentinel_get_master_addr_by_name(self.SERVICE)
            except redis.RedisError:
                continue
            if address:
                return int(address[1])
        return None

    def stop(self) -> None:
        """Stop the Sentinels and both servers."""
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait(timeout=10)
        self.processes = []
        self.replica.stop()
        self.primary.stop()


def _wait(predicate: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S * 3
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(SERVICE_OPTION, "the package of the service under test (worker_runtime)")
    parser.addini(POOL_OPTION, "the pool whose settings the jobs fixture's worker runs")


@pytest.fixture(scope="session")
def service(pytestconfig: pytest.Config) -> Service:
    """The service under test: its package (``worker_service``) imported."""
    package = pytestconfig.getini(SERVICE_OPTION)
    if package:
        importlib.import_module(str(package))
    return current()


def _pool(service: Service, configured: str) -> str:
    if configured:
        return configured
    from .pools import load_pools
    from .settings import DATABASE_RESOURCE

    pools = load_pools(service.root / "pools.toml").pools
    return next(name for name, pool in pools.items() if DATABASE_RESOURCE not in pool.uses)


class Jobs:
    """A real Dramatiq worker running the service's actors (its broker and middleware, on the
    test's Redis), and the messages sent to it: :meth:`send`, then :meth:`wait`."""

    def __init__(self, broker: dramatiq.Broker, threads: int = 2) -> None:
        self.broker = broker
        self.client: redis.Redis = broker.client  # type: ignore[attr-defined]
        self.worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=threads)
        self.queues: set[str] = set()

    def send(self, actor: Any, *args: Any, **kwargs: Any) -> dramatiq.Message[Any]:
        """Enqueue ``actor(*args, **kwargs)`` as a producer does; return the message."""
        self.queues.add(actor.queue_name)
        message: dramatiq.Message[Any] = actor.send(*args, **kwargs)
        return message

    def wait(self, timeout_s: float = 10.0) -> None:
        """Wait until every message sent (and what they sent on the same queues) is done."""
        for queue in sorted(self.queues):
            self.broker.join(queue, timeout=int(timeout_s * 1000))
        self.worker.join()

    def run(self, actor: Any, *args: Any, **kwargs: Any) -> dramatiq.Message[Any]:
        """:meth:`send` then :meth:`wait`."""
        message = self.send(actor, *args, **kwargs)
        self.wait()
        return message


@pytest.fixture
def jobs(
    service: Service, redis_url: str, pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Jobs]:
    """A started :class:`Jobs` worker on the test's Redis (the service's broker is built on
    first use, as a worker of the ``worker_pool`` pool)."""
    monkeypatch.setenv("WORKER_POOL", _pool(service, str(pytestconfig.getini(POOL_OPTION))))
    monkeypatch.setenv("REDIS_URL", redis_url)
    from .actors import load

    started = Jobs(load())
    built_for = started.client.connection_pool.connection_kwargs.get("port")
    wanted = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs.get("port")
    if built_for != wanted:
        pytest.fail(
            f"the service's broker was built for another Redis (port {built_for}, not the "
            f"test's {wanted}): something imported the service's actors or broker before the "
            "jobs fixture, with another REDIS_URL; import them inside the tests",
            pytrace=False,
        )
    started.worker.start()
    try:
        yield started
    finally:
        started.worker.stop()


@pytest.fixture
def database_url() -> str:
    """``TEST_DATABASE_URL`` (or ``DATABASE_URL``): a PostgreSQL for the test; skipped without."""
    url = os.environ.get("TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if not url:
        pytest.skip(
            "DATABASE_URL is not set: this test needs a PostgreSQL, e.g. "
            "DATABASE_URL=postgresql://postgres:postgres@localhost:5432/postgres make test"
        )
    return url
