"""Shared pieces of the lifecycle tests (shutdown, liveness, crash-safe attempts).

A session fixture copies a bake (``database="none"``) and adds ``actors/lc_test.py``,
actors that record every start and end in Redis (``test:start:<job>`` and
``test:done:<job>`` lists of ``"<pid> <time>"``), so tests can prove exactly-once.
:class:`ServiceProcess` runs ``python -m orders_worker <subcommand>`` in its own session
(process group), logging to a file; :class:`Worker` is the worker with its own state dir and
metrics port. Fixtures kill whatever they started at teardown (:func:`started`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from signal import SIGTERM
from typing import Any, Self

import dramatiq
import pytest
import redis
from bakery import PYTHON, copy_project, free_port, package_of, project_env, wait_for
from dramatiq.brokers.redis import RedisBroker

QUEUE = "notifications"
# A Worker's drain window unless its env says otherwise (WORKER_SHUTDOWN_TIMEOUT_MS).
DRAIN_WINDOW_S = 25
NS = "dramatiq"

TEST_ACTORS = '''\
"""Actors of the lifecycle tests: each records its starts and ends in Redis."""

from __future__ import annotations

import os
import re
import time

import dramatiq
import redis
from dramatiq.middleware.time_limit import TimeLimitExceeded

from ..lifecycle import checkpoint

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


def _record(kind: str, job_id: str) -> None:
    _client.rpush(f"test:{kind}:{job_id}", f"{os.getpid()} {time.time()}")


def _nap(seconds: float, step: float = 0.05, check: bool = False) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(step, left))
        if check:
            checkpoint()


@dramatiq.actor(queue_name="notifications", max_retries=4)
def lc_sleep(job_id: str, seconds: float) -> None:
    """Sleeps in short naps (interruptible between them), never calling checkpoint()."""
    _record("start", job_id)
    _nap(seconds)
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", max_retries=4, time_limit=600_000)
def lc_long(job_id: str, seconds: float) -> None:
    """Like lc_sleep, with its own time limit far beyond the worker's shutdown window."""
    _record("start", job_id)
    _nap(seconds)
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", max_retries=4, time_limit=600_000)
def lc_block(job_id: str, seconds: float) -> None:
    """Blocks in one C call: no exception can reach it until the call returns."""
    _record("start", job_id)
    time.sleep(seconds)
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", max_retries=4, time_limit=600_000)
def lc_checkpoint(job_id: str, seconds: float) -> None:
    """Works in 50 ms steps and calls checkpoint() after each."""
    _record("start", job_id)
    _nap(seconds, check=True)
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", max_retries=4, time_limit=600_000)
def lc_stubborn(job_id: str, seconds: float) -> None:
    """Like lc_long, but shrugs off the time limit: only the drain can stop it."""
    _record("start", job_id)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            _nap(deadline - time.monotonic())
        except TimeLimitExceeded:
            continue
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", min_backoff=100, max_backoff=200)
def lc_overrun(job_id: str, seconds: float) -> None:
    """Naps without checkpoints, retried quickly: for the time-limit tests."""
    _record("start", job_id)
    _nap(seconds)
    _record("done", job_id)


@dramatiq.actor(
    queue_name="notifications", min_backoff=100, max_backoff=200, time_limit=600_000
)
def lc_overrun_declared(job_id: str, seconds: float) -> None:
    """Like lc_overrun, declaring a time limit far above the worker's."""
    _record("start", job_id)
    _nap(seconds)
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", min_backoff=100, max_backoff=200)
def lc_swallow(job_id: str, seconds: float, always: bool = False) -> None:
    """Works in 50 ms steps with checkpoints inside a bare ``except:``: swallows the first
    interruption and works on (``always``: swallows every one, for ``seconds``)."""
    _record("start", job_id)
    deadline = time.monotonic() + seconds
    while always and time.monotonic() < deadline:
        try:
            _nap(deadline - time.monotonic(), check=True)
        except:  # noqa: E722
            pass
    if always:
        _record("done", job_id)
        return
    try:
        _nap(seconds, check=True)
    except:  # noqa: E722
        _record("swallowed", job_id)
    _nap(seconds, check=True)
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", min_backoff=100, max_backoff=200)
def lc_regex(job_id: str, size: int) -> None:
    """A catastrophic regular expression: one C call that holds the interpreter lock for
    about 2**size steps."""
    _record("start", job_id)
    re.match(r"(a+)+$", "a" * size + "b")
    _record("done", job_id)


@dramatiq.actor(queue_name="notifications", max_retries=4)
def lc_poison(job_id: str) -> None:
    """Kills its worker process, once another job runs beside it in that process (or after
    3 s): a crash that takes bystanders down, however the fetches fell under load."""
    _record("start", job_id)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not _running_beside(job_id):
        time.sleep(0.01)
    os._exit(1)


def _running_beside(job_id: str) -> bool:
    """Whether a job other than ``job_id`` started in this process and has not ended."""
    pid = f"{os.getpid()} "
    for key in _client.scan_iter(match="test:start:*"):
        other = key.decode().removeprefix("test:start:")
        if other == job_id:
            continue
        started = sum(e.decode().startswith(pid) for e in _client.lrange(key, 0, -1))
        ended = sum(e.decode().startswith(pid) for e in _client.lrange(f"test:done:{other}", 0, -1))
        if started > ended:
            return True
    return False


@dramatiq.actor(queue_name="notifications", max_retries=4)
def lc_quick(job_id: str) -> None:
    _record("start", job_id)
    _record("done", job_id)
'''


def make_test_project(base: Path, target: Path, **actors: str) -> Path:
    """Copy the bake ``base`` to ``target`` with the lifecycle test actors and ``actors``
    (module name -> source)."""
    return copy_project(base, target, lc_test=TEST_ACTORS, **actors)


def bake_with_actors(bake: Callable[..., Path], factory: pytest.TempPathFactory, name: str,
              **actors: str) -> Path:
    """A ``database="none"`` bake with the test actors and ``actors``, in a folder ``name``."""
    base = bake(database="none")
    return make_test_project(base, factory.mktemp(name) / base.name, **actors)


@pytest.fixture(scope="session")
def lc_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``database="none"`` bake with the test actors."""
    return bake_with_actors(bake, tmp_path_factory, "lc")


def get(url: str, timeout: float = 10) -> tuple[int, str]:
    """GET ``url``: its status and body, an HTTP error's too (``OSError`` when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


class ServiceProcess:
    """``python -m <package> <subcommand>`` in its own process group (session), logging to
    ``<directory>/<subcommand>.log``; :meth:`kill` ends the whole group whatever happens.

    Parameters:
      project: the baked project (run from its src/ in this venv).
      subcommand: the CLI subcommand (``worker``, ``scheduler``).
      directory: its directory (created if missing), where the log goes.
      env: its whole environment (see :func:`bakery.project_env`); ``METRICS_PORT`` is the
        port :meth:`metrics` scrapes.
    """

    def __init__(self, project: Path, subcommand: str, directory: Path, env: dict[str, str],
                 ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.project = project
        self.subcommand = subcommand
        self.directory = directory
        self.log_path = directory / f"{subcommand}.log"
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None
        self.signalled_at = 0.0

    def start(self) -> Self:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [PYTHON, "-m", package_of(self.project), self.subcommand], cwd=self.project,
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def port(self) -> int:
        """Its metrics port (``METRICS_PORT``)."""
        return int(self.env["METRICS_PORT"])

    def signal(self, signum: int = signal.SIGTERM, group: bool = False) -> float:
        """Send ``signum`` to the process (or its whole group); return when (monotonic)."""
        self.signalled_at = time.monotonic()
        if group:
            os.killpg(self.pid, signum)
        else:
            os.kill(self.pid, signum)
        return self.signalled_at

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self, signum: int = SIGTERM, timeout: float = 15) -> int:
        """Send ``signum`` (default SIGTERM) and return the exit code (within ``timeout`` s)."""
        self.signal(signum)
        return self.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def records(self, event: str | None = None) -> list[dict[str, Any]]:
        """Its JSON log records, only those of ``event`` when given (default None: all)."""
        found = [json.loads(line) for line in self.log().splitlines() if line.startswith("{")]
        return [r for r in found if event is None or r.get("event") == event]

    def metrics(self) -> str:
        """The text of its /metrics."""
        return get(f"http://127.0.0.1:{self.port}/metrics")[1]

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGCONT)
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=10)


class Worker(ServiceProcess):
    """The worker (its supervisor) on ``redis_url`` with its own state dir and metrics port:
    pool ``interactive``, 1 process of 4 threads, 20 s job and 25 s shutdown timeouts
    unless ``env`` says otherwise."""

    def __init__(self, project: Path, redis_url: str, directory: Path, **env: str) -> None:
        self.state_dir = directory / "state"
        settings = {
            "WORKER_POOL": "interactive", "REDIS_URL": redis_url,
            "WORKER_STATE_DIR": str(self.state_dir), "METRICS_PORT": str(free_port()),
            "WORKER_PROCESSES": "1", "WORKER_CONCURRENCY": "4",
            "WORKER_JOB_TIMEOUT_MS": "20000",
            "WORKER_SHUTDOWN_TIMEOUT_MS": str(DRAIN_WINDOW_S * 1000),
        }
        settings.update(env)
        super().__init__(project, "worker", directory, project_env(project, **settings))

    def children(self) -> list[int]:
        """Pids of the supervisor's worker processes."""
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:
            return []
        return [int(pid) for pid in text.split()]

    def healthcheck(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``healthcheck <args>`` with this worker's environment."""
        return subprocess.run(
            [PYTHON, "-m", package_of(self.project), "healthcheck", *args], cwd=self.project,
            env=self.env, capture_output=True, text=True, timeout=30, check=False)


def started(factory: Callable[..., ServiceProcess]) -> Iterator[Callable[..., Any]]:
    """``factory`` wrapped to start what it makes; everything started is killed when the
    generator is closed (a fixture's teardown)."""
    running: list[ServiceProcess] = []

    def _start(*args: Any, **kwargs: Any) -> Any:
        process = factory(*args, **kwargs)
        running.append(process)
        return process.start()

    try:
        yield _start
    finally:
        for process in running:
            process.kill()


def workers_of(project: Path, redis_url: str, folder: Path) -> Iterator[Callable[..., Worker]]:
    """``workers(**env)`` starts a worker of ``project`` on ``redis_url``, each in a folder
    of its own under ``folder``; all are killed when the generator is closed."""
    count = iter(range(1_000))
    yield from started(
        lambda **env: Worker(project, redis_url, folder / f"w{next(count)}", **env))


@pytest.fixture
def workers(lc_project: Path, redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """``workers(**env)`` starts a worker on the test's Redis; all are killed at teardown."""
    yield from workers_of(lc_project, redis_url, tmp_path)


class Jobs:
    """Enqueues test jobs and reads what happened to them from Redis."""

    def __init__(self, redis_url: str) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.broker = RedisBroker(url=redis_url)

    def enqueue(self, actor: str, *args: Any, **options: Any) -> dramatiq.Message[Any]:
        message: dramatiq.Message[Any] = dramatiq.Message(
            queue_name=QUEUE, actor_name=actor, args=args, kwargs={}, options=options)
        return self.broker.enqueue(message)

    def many(self, actor: str, count: int, *args: Any, prefix: str = "j") -> list[str]:
        ids = [f"{prefix}{index}" for index in range(count)]
        for job_id in ids:
            self.enqueue(actor, job_id, *args)
        return ids

    def _entries(self, kind: str, job_id: str) -> list[tuple[int, float]]:
        entries = []
        for raw in self.client.lrange(f"test:{kind}:{job_id}", 0, -1):
            pid, stamp = raw.decode().split()
            entries.append((int(pid), float(stamp)))
        return entries

    def starts(self, job_id: str) -> list[tuple[int, float]]:
        return self._entries("start", job_id)

    def dones(self, job_id: str) -> list[tuple[int, float]]:
        return self._entries("done", job_id)

    def started_count(self) -> int:
        return sum(1 for _ in self.client.scan_iter(match="test:start:*", count=1000))

    def done_count(self) -> int:
        return sum(1 for _ in self.client.scan_iter(match="test:done:*", count=1000))

    def queued(self, queue: str = QUEUE) -> list[dramatiq.Message[Any]]:
        """Messages waiting in ``queue`` (in order)."""
        messages = []
        for redis_id in self.client.lrange(f"{NS}:{queue}", 0, -1):
            body = self.client.hget(f"{NS}:{queue}.msgs", redis_id)
            assert body is not None, f"queued id {redis_id!r} has no body"
            messages.append(dramatiq.Message.decode(body))
        return messages

    def queued_ids(self, queue: str = QUEUE) -> list[str]:
        return [str(message.args[0]) for message in self.queued(queue)]

    def dead_letters(self) -> list[dramatiq.Message[Any]]:
        ids = self.client.zrange(f"{NS}:{QUEUE}.XQ", 0, -1)
        bodies = [self.client.hget(f"{NS}:{QUEUE}.XQ.msgs", redis_id) for redis_id in ids]
        return [dramatiq.Message.decode(body) for body in bodies if body is not None]

    def stranded(self) -> dict[str, int]:
        """Non-empty acks sets (messages held by some worker) and their sizes."""
        return {key.decode(): int(self.client.scard(key))
                for key in self.client.scan_iter(match=f"{NS}:__acks__.*", count=1000)
                if self.client.scard(key)}

    def delayed(self) -> int:
        """Messages on the delay queue (a retry would land there)."""
        return int(self.client.llen(f"{NS}:{QUEUE}.DQ"))

    def assert_exactly_once_or_queued(self, ids: list[str]) -> tuple[int, int]:
        """Each job ran to completion once and is not queued, or did not complete and is
        queued exactly once; nothing is held in an acks set. Returns (done, queued)."""
        queued = self.queued_ids()
        assert len(queued) == len(set(queued)), f"a job is queued twice: {sorted(queued)}"
        done = 0
        for job_id in ids:
            completions = len(self.dones(job_id))
            assert completions <= 1, f"{job_id} completed {completions} times"
            assert (completions == 1) != (job_id in queued), (
                f"{job_id}: completed={completions} queued={job_id in queued}")
            done += completions
        assert not self.stranded(), f"stranded in acks sets: {self.stranded()}"
        return done, len(queued)


@pytest.fixture
def jobs(redis_url: str) -> Iterator[Jobs]:
    helper = Jobs(redis_url)
    yield helper
    helper.client.close()
    helper.broker.close()


def wait_ready(jobs: Jobs, count: int = 1, timeout: float = 20) -> None:
    """Wait until ``count`` worker processes sent a heartbeat (their consumers run)."""
    wait_for(lambda: jobs.client.zcard(f"{NS}:__heartbeats__") >= count, timeout,
             f"{count} worker heartbeat(s)")
