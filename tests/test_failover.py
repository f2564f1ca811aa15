"""Failover: the worker and producers follow a promoted replica through Sentinel, and readiness
says when the node is a replica.

Real processes only: a primary redis-server, its replica and three redis-sentinel processes
(``Sentinels``, the baked conftest's fixture; ``down-after-milliseconds`` 1000), the worker
(its supervisor and one process of 4 threads) and a producer process, both on
``REDIS_URL=redis+sentinel://...``, and a separate redis-server that records each job's
start and end, so that the failover cannot erase the count. The primary is SIGKILLed while
jobs run and the producer sends; the worker follows the promoted replica by itself; every
job whose send Redis acknowledged runs; what runs twice is at most what was in flight (the
worker's prefetch); the old primary restarted empty comes back as a replica (Sentinel) and
loses nothing. A worker whose plain ``REDIS_URL`` names a replica is not ready, says why,
and fails no job. Redis's FAILOVER under a plain URL whose name then moves: READONLY is a
reconnect, not a job's error.

Sentinels that need a password (``requirepass`` in sentinel.conf, ``?sentinel_password=`` in
``REDIS_URL``): the worker and a producer follow a failover through them, the password is
masked in the config the worker logs; a wrong or missing one stops the worker at boot, exit
78, one line, the password not in it.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from _lifecycle import NS, QUEUE, Jobs, Worker, get, wait_for
from bakery import (
    PYTHON,
    RedisServer,
    copy_project,
    package_of,
    project_env,
    run_cli,
)
from worker_runtime import testing
from test_malformed import counted

pytestmark = pytest.mark.slow
Sentinels = testing.Sentinels

FAILOVER_ACTORS = '''\
"""An actor that records its starts and ends in a Redis of its own (EFFECTS_URL)."""

from __future__ import annotations

import os
import time

import dramatiq
import redis

_effects = redis.Redis.from_url(os.environ["EFFECTS_URL"])


@dramatiq.actor(queue_name="notifications", max_retries=4, min_backoff=100, max_backoff=300)
def fo_work(job_id: str) -> None:
    _effects.rpush(f"start:{job_id}", f"{os.getpid()} {time.time()}")
    time.sleep(0.02)
    _effects.rpush(f"done:{job_id}", f"{os.getpid()} {time.time()}")


@dramatiq.actor(queue_name="notifications", max_retries=4, min_backoff=100, max_backoff=300)
def fo_write(job_id: str) -> None:
    """Also writes to the broker's Redis, as handlers do (an enqueue, a lease)."""
    _effects.rpush(f"start:{job_id}", f"{os.getpid()} {time.time()}")
    dramatiq.get_broker().client.incr("test:writes")  # type: ignore[attr-defined]
    time.sleep(0.01)
    _effects.rpush(f"done:{job_id}", f"{os.getpid()} {time.time()}")
'''

#: The producer: sends ``fo_work`` jobs through ``<package>.producer`` at a steady pace until
#: the file STOP exists, printing "sent <id>" once the send returned (Redis acknowledged it)
#: and "refused <id> <error>" when it raised (a new id is used for the next try).
PRODUCER = """\
import os, sys, time
from pathlib import Path
from {package}.producer import enqueue

stop = Path(sys.argv[1])
number = 0
while not stop.exists():
    job_id = f"p{{number}}"
    number += 1
    try:
        enqueue("fo_work", job_id)
    except Exception as error:
        print("refused", job_id, type(error).__name__, flush=True)
        time.sleep(0.05)
        continue
    print("sent", job_id, flush=True)
    time.sleep(0.01)
"""

WORKER_PROCESSES = 1
CONCURRENCY = 4


@pytest.fixture(scope="session")
def failover_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = bake(database="none")
    return copy_project(base, tmp_path_factory.mktemp("failover") / base.name,
                        fo_test=FAILOVER_ACTORS)


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[object]:
    directory = tmp_path / "sentinels"
    directory.mkdir()
    group = Sentinels(directory)
    group.start()
    yield group
    group.stop()


SENTINEL_PASSWORD = "s3ntinel-Pass"


@pytest.fixture
def guarded_sentinels(tmp_path: Path) -> Iterator[object]:
    """Sentinels with ``requirepass`` (:data:`SENTINEL_PASSWORD`)."""
    directory = tmp_path / "sentinels"
    directory.mkdir()
    group = Sentinels(directory, sentinel_password=SENTINEL_PASSWORD)
    group.start()
    yield group
    group.stop()


@pytest.fixture
def effects(tmp_path: Path) -> Iterator[redis.Redis]:
    directory = tmp_path / "effects"
    directory.mkdir()
    server = RedisServer(directory)
    server.start()
    client = redis.Redis.from_url(server.url)
    client.config_set("save", "")
    yield client
    client.close()
    server.stop()


def effects_url(client: redis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/0"


def stamps(effects: redis.Redis, kind: str) -> dict[str, list[float]]:
    """Job id -> the times it started (``kind="start"``) or ended (``"done"``)."""
    found: dict[str, list[float]] = {}
    for key in effects.scan_iter(match=f"{kind}:*", count=1000):
        job_id = key.decode().split(":", 1)[1]
        found[job_id] = [float(raw.split()[1]) for raw in effects.lrange(key, 0, -1)]
    return found


class Producer:
    """The producer process (:data:`PRODUCER`) and what it printed."""

    def __init__(self, project: Path, env: dict[str, str], directory: Path) -> None:
        self.stop_file = directory / "STOP"
        code = PRODUCER.format(package=package_of(project))
        self.log = directory / "producer.log"
        self.process = subprocess.Popen(
            [PYTHON, "-c", code, str(self.stop_file)], cwd=project, env=env,
            stdout=subprocess.PIPE, stderr=self.log.open("ab"), text=True)
        self.sent: list[str] = []
        self.refused: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            kind, job_id, *_ = line.split()
            (self.sent if kind == "sent" else self.refused).append(job_id)

    def stop(self) -> None:
        self.stop_file.touch()
        self.process.wait(timeout=30)
        self.reader.join(timeout=10)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def test_worker_follows_a_promoted_replica_through_sentinel_losing_nothing_acknowledged(
        failover_project: Path, sentinels: object, effects: redis.Redis, tmp_path: Path) -> None:
    group = sentinels
    env = {"EFFECTS_URL": effects_url(effects)}
    worker = Worker(failover_project, group.url, tmp_path / "w",  # type: ignore[attr-defined]
                    WORKER_PROCESSES=str(WORKER_PROCESSES),
                    WORKER_CONCURRENCY=str(CONCURRENCY), **env).start()
    producer_env = project_env(failover_project, REDIS_URL=group.url, **env)  # type: ignore[attr-defined]
    producer = Producer(failover_project, producer_env, tmp_path)
    old_port = group.primary.port  # type: ignore[attr-defined]
    try:
        wait_for(lambda: len(stamps(effects, "done")) >= 50, 60, "50 jobs done before the kill")
        killed_at = time.time()
        group.primary.kill()  # type: ignore[attr-defined]
        wait_for(lambda: group.primary_port() not in (None, old_port), 60,  # type: ignore[attr-defined]
                 "a Sentinel to name the promoted replica")
        promoted_after = time.time() - killed_at
        wait_for(lambda: any(t > killed_at + promoted_after for ts in stamps(effects, "done").values()
                             for t in ts), 60, "a job done on the promoted replica")
        first_done = min(t for ts in stamps(effects, "done").values() for t in ts
                         if t > killed_at + promoted_after)
        # The old primary comes back empty (no persistence): Sentinel makes it a replica.
        group.primary.start()  # type: ignore[attr-defined]
        wait_for(lambda: len(stamps(effects, "done")) >= 50 + 100, 60, "100 more jobs done")
        producer.stop()
        sent = set(producer.sent)
        wait_for(lambda: sent <= set(stamps(effects, "done")), 60,
                 "every acknowledged job to be done")

        new_primary = redis.Redis(port=group.primary_port())  # type: ignore[attr-defined]
        wait_for(lambda: not new_primary.llen(f"{NS}:{QUEUE}"), 30, "the queue to drain")
        started, done = stamps(effects, "start"), stamps(effects, "done")
        lost = sent - set(done)
        twice = sorted(job for job, times in started.items() if len(times) > 1)
        assert not lost, f"acknowledged sends never done: {sorted(lost)[:20]}"
        assert len(twice) <= WORKER_PROCESSES * CONCURRENCY, (
            f"{len(twice)} jobs ran twice, more than the {WORKER_PROCESSES * CONCURRENCY} "
            f"in flight: {twice}")
        assert not new_primary.zcard(f"{NS}:{QUEUE}.XQ"), "nothing dead-lettered"
        metrics = worker.metrics()
        assert counted(metrics, "failure") == 0 and counted(metrics, "retry") == 0, metrics
        ready = worker.healthcheck("ready")
        assert ready.returncode == 0, ready.stderr
        assert get(f"http://127.0.0.1:{worker.port}/readyz")[0] == 200
        old = redis.Redis(port=old_port)
        wait_for(lambda: old.info("replication")["role"] == "slave", 60,
                 "Sentinel to make the restarted old primary a replica")
        print(f"failover: promoted {promoted_after:.2f} s after the kill, first job done "
              f"{first_done - killed_at:.2f} s after it; {len(sent)} sent, "
              f"{len(producer.refused)} refused, 0 lost, {len(twice)} ran twice")
        assert worker.stop(timeout=40) == 0, worker.log()[-3000:]
    finally:
        producer.kill()
        worker.kill()


def test_a_worker_on_a_replica_is_not_ready_and_fails_no_job(
        failover_project: Path, effects: redis.Redis, tmp_path: Path) -> None:
    (tmp_path / "primary").mkdir()
    (tmp_path / "replica").mkdir()
    primary = RedisServer(tmp_path / "primary")
    primary.start()
    replica = RedisServer(tmp_path / "replica", replica_of=primary.port)
    replica.start()
    env = {"EFFECTS_URL": effects_url(effects)}
    worker = Worker(failover_project, replica.url, tmp_path / "w", **env)
    try:
        client = redis.Redis.from_url(primary.url)
        jobs = Jobs(primary.url)
        jobs.enqueue("fo_work", "r1")
        worker.start()
        status, body = wait_for(lambda: _readyz(worker, 503), 60, "/readyz to answer 503")
        assert "replica" in body and f"127.0.0.1:{primary.port}" in body, body
        ready = worker.healthcheck("ready")
        assert ready.returncode == 1
        assert "connected to a replica" in ready.stderr, ready.stderr
        time.sleep(3)  # the worker's consumers tried and were refused (READONLY)
        metrics = worker.metrics()
        assert counted(metrics, "failure") == 0 and counted(metrics, "retry") == 0
        assert not stamps(effects, "start"), "nothing ran on a replica"
        assert client.llen(f"{NS}:{QUEUE}") == 1, "the job still waits on the primary"
        assert worker.stop(timeout=40) == 0, worker.log()[-3000:]
        jobs.client.close()
        jobs.broker.close()
    finally:
        worker.kill()
        replica.stop()
        primary.stop()


def _readyz(worker: Worker, status: int) -> tuple[int, str] | None:
    """/readyz's answer when its status is ``status``, else None (also while not serving)."""
    try:
        answer = get(f"http://127.0.0.1:{worker.port}/readyz", timeout=5)
    except OSError:
        return None
    return answer if answer[0] == status else None


class SocketRedis(RedisServer):
    """A RedisServer also listening on the unix socket ``<directory>/redis.sock``."""

    def __init__(self, directory: Path, replica_of: int | None = None) -> None:
        super().__init__(directory, replica_of=replica_of)
        self.socket = directory / "redis.sock"

    def _persistence(self) -> list[str]:
        return [*super()._persistence(), "--unixsocket", str(self.socket)]


def test_readonly_after_a_failover_is_a_reconnect_not_a_job_failure(
        failover_project: Path, effects: redis.Redis, tmp_path: Path) -> None:
    """A plain ``REDIS_URL`` whose name moves to the new primary on a failover (a managed
    Redis's primary endpoint; here a unix socket path, a symlink flipped): the connections
    still open to the demoted primary get READONLY, reconnect, and land on the new one.
    Redis's own FAILOVER command swaps the roles without losing a write, while handlers
    write to the broker's Redis."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    first = SocketRedis(tmp_path / "a")
    first.start()
    second = SocketRedis(tmp_path / "b", replica_of=first.port)
    second.start()
    link = tmp_path / "redis.sock"
    link.symlink_to(first.socket)
    jobs = Jobs(first.url)
    ids = jobs.many("fo_write", 600, prefix="f")
    worker = Worker(failover_project, f"unix://{link}?db=0", tmp_path / "w",
                    WORKER_CONCURRENCY=str(CONCURRENCY), EFFECTS_URL=effects_url(effects))
    old, new = redis.Redis.from_url(first.url), redis.Redis.from_url(second.url)
    try:
        wait_for(lambda: new.info("replication")["master_link_status"] == "up", 30, "sync")
        worker.start()
        wait_for(lambda: len(stamps(effects, "done")) >= 50, 60, "50 jobs done before")
        old.execute_command("FAILOVER", "TO", "127.0.0.1", second.port)
        wait_for(lambda: old.info("replication")["role"] == "slave", 30, "the swap",
                 step=0.005)
        flipped = tmp_path / "redis.sock.new"
        flipped.symlink_to(second.socket)
        flipped.replace(link)
        done_before = len(stamps(effects, "done"))
        wait_for(lambda: set(ids) <= set(stamps(effects, "done")), 90, "every job done")
        assert done_before < len(ids), "the failover happened while jobs ran"
        started = stamps(effects, "start")
        twice = sorted(job for job, times in started.items() if len(times) > 1)
        assert len(twice) <= CONCURRENCY, twice
        metrics = worker.metrics()
        assert counted(metrics, "failure") == 0 and counted(metrics, "retry") == 0, (
            "READONLY failed a job", [r for r in worker.records() if r.get("outcome")
                                      not in (None, "success")][:3])
        assert int(new.get("test:writes") or 0) >= len(ids), "every handler's write landed"
        ready = worker.healthcheck("ready")
        assert ready.returncode == 0, ready.stderr
        assert worker.stop(timeout=40) == 0, worker.log()[-3000:]
        assert not new.llen(f"{NS}:{QUEUE}") and not new.zcard(f"{NS}:{QUEUE}.XQ")
        print(f"READONLY failover: {done_before} of {len(ids)} done at the swap, "
              f"{len(twice)} ran twice, 0 failed")
    finally:
        worker.kill()
        jobs.client.close()
        jobs.broker.close()
        second.stop()
        first.stop()


ENQUEUE_ONE = """
import sys
from {package}.producer import enqueue
enqueue("fo_work", sys.argv[1])
"""


def test_sentinels_with_a_password_are_followed_through_a_failover(
        failover_project: Path, guarded_sentinels: object, effects: redis.Redis,
        tmp_path: Path) -> None:
    group = guarded_sentinels
    with redis.Redis(port=group.ports[0]) as bare, pytest.raises(redis.AuthenticationError):  # type: ignore[attr-defined]
        bare.ping()  # the premise: the Sentinels refuse a client without the password
    env = {"EFFECTS_URL": effects_url(effects)}
    url: str = group.url  # type: ignore[attr-defined]
    worker = Worker(failover_project, url, tmp_path / "w", **env).start()
    producer_env = project_env(failover_project, REDIS_URL=url, **env)

    def send(job_id: str) -> None:
        done = subprocess.run(
            [PYTHON, "-c", ENQUEUE_ONE.format(package=package_of(failover_project)), job_id],
            cwd=failover_project, env=producer_env, capture_output=True, text=True,
            timeout=60, check=False)
        assert done.returncode == 0, done.stderr[-3000:]

    old_port = group.primary.port  # type: ignore[attr-defined]
    try:
        send("before")
        wait_for(lambda: "before" in stamps(effects, "done"), 60, "a job before the failover")
        group.primary.kill()  # type: ignore[attr-defined]
        wait_for(lambda: group.primary_port() not in (None, old_port), 60,  # type: ignore[attr-defined]
                 "a Sentinel to name the promoted replica")
        send("after")
        wait_for(lambda: "after" in stamps(effects, "done"), 60, "a job after the failover")
        ready = worker.healthcheck("ready")
        assert ready.returncode == 0, ready.stderr
        log = worker.log()
        assert SENTINEL_PASSWORD not in log, "the Sentinels' password is in the worker's log"
        started = worker.records("start")
        assert started and "sentinel_password=***" in started[0]["config"]["REDIS_URL"], started
        assert worker.stop(timeout=40) == 0, worker.log()[-3000:]
    finally:
        worker.kill()


@pytest.mark.parametrize("password", [None, "not-the-password"], ids=["missing", "wrong"])
def test_a_refused_sentinel_password_is_one_line_at_boot(
        failover_project: Path, guarded_sentinels: object, tmp_path: Path,
        password: str | None) -> None:
    group = guarded_sentinels
    url = group.url.split("?")[0]  # type: ignore[attr-defined]
    if password is not None:
        url += f"?sentinel_password={password}"
    # EFFECTS_URL lets the actors import (no connection is made), so that only the password
    # can stop the boot.
    worker = Worker(failover_project, url, tmp_path / "w", EFFECTS_URL="redis://127.0.0.1:9/0")
    done = run_cli(failover_project, "worker", env=worker.env, timeout=60)
    assert done.returncode == 78, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("config error: REDIS_URL: the Sentinels refuse"), lines
    assert "?sentinel_password=" in lines[0], lines
    given = "the sentinel_password given" if password else "a connection without sentinel_pass"
    assert given in lines[0] and "(3 of 3; 127.0.0.1:" in lines[0], lines
    assert "Traceback" not in done.stdout + done.stderr
    if password is not None:
        assert password not in done.stdout + done.stderr
    assert not (worker.state_dir / "progress").exists(), "no worker process was started"


def test_a_refused_sentinel_password_stops_the_scheduler_at_boot(
        failover_project: Path, guarded_sentinels: object, tmp_path: Path) -> None:
    bare = guarded_sentinels.url.split("?")[0]  # type: ignore[attr-defined]
    url = f"{bare}?sentinel_password=not-the-password"
    env = project_env(failover_project, REDIS_URL=url, EFFECTS_URL="redis://127.0.0.1:9/0",
                      WORKER_STATE_DIR=str(tmp_path / "state"))
    done = run_cli(failover_project, "scheduler", env=env, timeout=60)
    assert done.returncode == 78, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "the Sentinels refuse" in lines[0], done.stderr
    assert "not-the-password" not in done.stdout + done.stderr
