"""Unique jobs (issue #42 item 3) with real worker processes, real producer processes and a
real redis-server (and a Sentinel group).

* Producers racing: 8 producer processes send the same 20 keys at once; per key exactly
  one send is enqueued, every other raises ``DuplicateJob``, each key runs once, and the
  skipped sends are counted (``jobs_deduplicated_total``).
* A worker SIGKILLed while it runs the one job of a key: the job, recovered onto another
  worker, keeps the lock (a send meanwhile is skipped, naming the original message id);
  once it completes, the next send is accepted and runs.
* A TTL shorter than the job: once it lapses, an equal send is accepted and both run; the
  older one's end leaves the newer one's lock (the documented behaviour).
* A Sentinel failover while producers race and a worker runs: the lock is written and
  freed in the same Lua call as its job's enqueue and settlement, which Redis replicates as
  one transaction, so the promoted replica holds a job with its lock or neither: no key ever
  has two jobs running at once, and once everything ran no lock is left behind.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from _lifecycle import NS, Worker, wait_for, workers_of
from bakery import PYTHON, copy_project, package_of, project_env
from test_failover import effects, effects_url, sentinels  # noqa: F401  (fixtures)
from worker_runtime.timing import ORPHAN_AFTER_S

pytestmark = pytest.mark.slow

QUEUE = "notifications"
UQ_ACTORS = '''\
"""A unique job that records its runs (and the runs of its key at once) in Redis."""

from __future__ import annotations

import os
import time

import dramatiq
import redis

from worker_runtime.unique import Unique

_client = redis.Redis.from_url(os.environ.get("EFFECTS_URL") or os.environ["REDIS_URL"])
_ENTER = _client.register_script("""
local now = redis.call('incr', KEYS[1])
if now > tonumber(redis.call('get', KEYS[2]) or '0') then redis.call('set', KEYS[2], now) end
return now
""")


@dramatiq.actor(queue_name="notifications", max_retries=4, min_backoff=100, max_backoff=300,
                unique=Unique(key="key", ttl_ms=600_000))
def uq_job(key: str, n: int, seconds: float) -> None:
    """Runs ``seconds`` (less once ``release:<n>`` is set); counts its key's runs at once."""
    _ENTER(keys=[f"running:{key}", f"peak:{key}"])
    _client.rpush(f"start:{n}", f"{os.getpid()} {time.time()}")
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not _client.exists(f"release:{n}"):
            time.sleep(0.02)
    finally:
        _client.decr(f"running:{key}")
    _client.rpush(f"done:{n}", f"{os.getpid()} {time.time()}")
'''

#: A producer: says it is ``ready`` (imported), waits for ``go`` (a BLPOP), then sends ``uq_job`` for each key of argv once
#: (``rounds`` times over, or until ``stop`` is set), printing "sent <key> <n>" or
#: "dup <key> <n> <holder>".
PRODUCER = """\
import sys
import time
import redis
from worker_runtime.unique import DuplicateJob
from {package}.producer import enqueue

signal_url, name, rounds, seconds, *keys = sys.argv[1:]
signals = redis.Redis.from_url(signal_url)
signals.rpush("ready", name)
signals.blpop("go:" + name, timeout=60)
for round_ in range(int(rounds)):
    if signals.exists("stop"):
        break
    for key in keys:
        n = f"{{name}}-{{round_}}-{{key}}"
        try:
            enqueue("uq_job", key, n, float(seconds))
        except DuplicateJob as error:
            print("dup", key, n, error.holder, flush=True)
        except Exception as error:
            print("error", key, n, type(error).__name__, flush=True)
        else:
            print("sent", key, n, flush=True)
    time.sleep(0.005)
"""


@pytest.fixture(scope="session")
def uq_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = bake(database="none")  # without the lifecycle actors: they need a plain REDIS_URL
    return copy_project(base, tmp_path_factory.mktemp("unique") / base.name, uq_test=UQ_ACTORS)


@pytest.fixture
def workers(uq_project: Path, redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    yield from workers_of(uq_project, redis_url, tmp_path)


def start_producers(project: Path, redis_url: str, signal_url: str, count: int, keys: list[str],
                    out: Path, rounds: int = 1, seconds: float = 3.0,
                    **env: str) -> list[subprocess.Popen[str]]:
    """``count`` producer processes, each printing to ``out/p<i>.out``: a file, not a pipe,
    which the test would read only at the end (CI saw the producers blocked on a full pipe,
    64 KiB of "dup" lines, so no job was sent for a minute)."""
    code = PRODUCER.format(package=package_of(project))
    environment = project_env(project, REDIS_URL=redis_url, **env)
    out.mkdir(exist_ok=True)
    producers = []
    for i in range(count):
        with (out / f"p{i}.out").open("w") as printed:
            producers.append(subprocess.Popen(
                [PYTHON, "-c", code, signal_url, f"p{i}", str(rounds), str(seconds), *keys],
                cwd=project, env=environment, stdout=printed, text=True))
    return producers


def outcomes(producers: list[subprocess.Popen[str]], out: Path) -> list[list[str]]:
    """What the producers of :func:`start_producers` printed, once they ended."""
    for producer in producers:
        producer.wait(timeout=120)
    printed = [(out / f"p{i}.out").read_text() for i in range(len(producers))]
    return [line.split() for text in printed for line in text.splitlines()]


def send(project: Path, redis_url: str, name: str, key: str, seconds: float) -> list[str]:
    """One send of ``uq_job(key, "<name>-0-<key>", seconds)`` from a producer process:
    ["sent", key, n] or ["dup", key, n, holder]."""
    redis.Redis.from_url(redis_url).rpush(f"go:{name}", 1)
    code = PRODUCER.format(package=package_of(project))
    done = subprocess.run([PYTHON, "-c", code, redis_url, name, "1", str(seconds), key],
                          cwd=project, env=project_env(project, REDIS_URL=redis_url),
                          capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.split()


def metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def go(client: redis.Redis, name: str, count: int = 1) -> None:
    client.rpush(f"go:{name}", *["1"] * count)


def lock_of(client: redis.Redis, key: str) -> str | None:
    found = client.get(f'{NS}:__unique__.uq_job.key="{key}"')
    return None if found is None else found.decode()


def test_racing_producers_enqueue_each_key_once_and_the_skips_are_counted(
        uq_project: Path, redis_url: str, client: redis.Redis,
        workers: Callable[..., Worker], tmp_path: Path) -> None:
    worker = workers(WORKER_CONCURRENCY="4")
    keys = [f"k{i}" for i in range(20)]
    producers = start_producers(uq_project, redis_url, redis_url, 8, keys, tmp_path / "out",
                                seconds=3)
    wait_for(lambda: client.llen("ready") == 8, 60, "every producer to be ready")
    for i in range(8):  # all at once: each key's sends race
        go(client, f"p{i}")
    lines = outcomes(producers, tmp_path / "out")
    sent = [line for line in lines if line[0] == "sent"]
    dups = [line for line in lines if line[0] == "dup"]
    assert not [line for line in lines if line[0] == "error"]
    assert sorted(line[1] for line in sent) == sorted(keys), "each key enqueued exactly once"
    assert len(dups) == 8 * 20 - 20
    holders = {line[1]: line[2] for line in sent}
    wait_for(lambda: all(client.llen(f"done:{n}") for n in holders.values()), 60,
             "every enqueued job to run")
    assert all(int(client.get(f"peak:{key}") or 0) == 1 for key in keys)
    assert all(client.llen(f"start:{n}") == 1 for n in holders.values())
    assert not [line for line in dups if client.exists(f"start:{line[2]}")], "no dup ran"
    wait_for(lambda: not any(lock_of(client, key) for key in keys), 10, "every lock freed")
    skipped = metric(worker.metrics(), "jobs_deduplicated_total", queue=QUEUE, action="skipped")
    assert skipped == 8 * 20 - 20


def test_a_job_recovered_from_a_killed_worker_keeps_its_lock_until_it_completes(
        uq_project: Path, redis_url: str, client: redis.Redis,
        workers: Callable[..., Worker]) -> None:
    env = {"WORKER_HEARTBEAT_TIMEOUT_MS": "3000", "WORKER_CONCURRENCY": "2"}
    first = workers(**env)
    assert send(uq_project, redis_url, "a", "s", 60)[0] == "sent"
    wait_for(lambda: client.llen("start:a-0-s"), 30, "the job to start")
    holder = lock_of(client, "s")
    assert holder
    first.signal(signal.SIGKILL, group=True)
    first.wait(timeout=10)
    client.set("running:s", 0)  # the killed run never left
    skipped = send(uq_project, redis_url, "b", "s", 0)
    assert skipped[0] == "dup" and skipped[3] == holder, "killed: the lock stays"
    workers(**env)
    wait_for(lambda: client.llen("start:a-0-s") == 2, 30, "the recovered job to run again")
    again = send(uq_project, redis_url, "c", "s", 0)
    assert again[0] == "dup" and again[3] == holder, "recovered and running: the lock stays"
    assert lock_of(client, "s") == holder
    assert not client.exists("start:b-0-s") and not client.exists("start:c-0-s")
    client.set("release:a-0-s", 1)
    wait_for(lambda: client.llen("done:a-0-s") == 1, 30, "the recovered job to complete")
    wait_for(lambda: lock_of(client, "s") is None, 10, "its ack to free the lock")
    assert send(uq_project, redis_url, "d", "s", 0)[0] == "sent"
    wait_for(lambda: client.llen("done:d-0-s") == 1, 30, "the next job of the key to run")
    assert int(client.get("peak:s") or 0) == 1, "never two jobs of the key at once"


def test_a_ttl_shorter_than_the_job_admits_a_second_one_whose_lock_the_first_leaves(
        uq_project: Path, redis_url: str, client: redis.Redis,
        workers: Callable[..., Worker]) -> None:
    workers(WORKER_CONCURRENCY="4")
    code = ("import sys\nfrom worker_runtime.unique import Unique\n"
            f"from {package_of(uq_project)}.producer import enqueue\n"
            "m = enqueue('uq_job', 't', sys.argv[1], 60.0, "
            "unique=Unique(key='key', ttl_ms=int(sys.argv[2])))\nprint(m.message_id)\n")
    env = project_env(uq_project, REDIS_URL=redis_url)

    def enqueue(n: str, ttl_ms: int) -> str:
        done = subprocess.run([PYTHON, "-c", code, n, str(ttl_ms)], cwd=uq_project, env=env,
                              capture_output=True, text=True, timeout=60, check=True)
        return done.stdout.strip()

    older = enqueue("t-1", 500)
    wait_for(lambda: client.llen("start:t-1"), 30, "the older job to start")
    wait_for(lambda: lock_of(client, "t") is None, 10, "the TTL to lapse while it runs")
    newer = enqueue("t-2", 600_000)
    assert newer != older
    wait_for(lambda: client.llen("start:t-2"), 30, "the newer job to run beside it")
    assert int(client.get("peak:t") or 0) == 2, "the documented cost of a short TTL"
    client.set("release:t-1", 1)
    wait_for(lambda: client.llen("done:t-1"), 30, "the older job to end")
    time.sleep(0.3)
    assert lock_of(client, "t") == newer, "the older job's end left the newer lock"
    client.set("release:t-2", 1)
    wait_for(lambda: lock_of(client, "t") is None, 30, "the newer job's end to free it")


def test_across_a_sentinel_failover_no_key_runs_twice_at_once_and_no_lock_is_left(
        uq_project: Path, sentinels: object, effects: redis.Redis,  # noqa: F811
        tmp_path: Path) -> None:
    group = sentinels
    url = group.url  # type: ignore[attr-defined]
    env = {"EFFECTS_URL": effects_url(effects)}
    worker = Worker(uq_project, url, tmp_path / "w", WORKER_CONCURRENCY="4", **env).start()
    keys = [f"f{i}" for i in range(10)]
    # The producers send until told to stop, and must go on sending after the promotion.
    producers = start_producers(uq_project, url, effects_url(effects), 4, keys, tmp_path / "out",
                                rounds=1_000_000, seconds=0.02, **env)

    def done() -> int:
        return sum(1 for _ in effects.scan_iter("done:*", count=1000))

    try:
        wait_for(lambda: effects.llen("ready") == 4, 60, "every producer to be ready")
        for i in range(4):
            go(effects, f"p{i}")
        old_port = group.primary.port  # type: ignore[attr-defined]
        wait_for(lambda: done() >= 30, 60, "30 jobs done before the kill")
        group.primary.kill()  # type: ignore[attr-defined]
        wait_for(lambda: group.primary_port() not in (None, old_port),  # type: ignore[attr-defined]
                 60, "a Sentinel to name the promoted replica")
        promoted = done()
        wait_for(lambda: done() >= promoted + 30, 60, "30 more jobs done after the promotion")
        effects.set("stop", 1)
        lines = outcomes(producers, tmp_path / "out")
        sent = [line[2] for line in lines if line[0] == "sent"]
        kinds = collections.Counter(line[0] for line in lines)
        assert kinds["sent"] > 30 and kinds["dup"], kinds
        assert kinds["error"], f"the sends overlapped the failover: {kinds}"
        wait_for(lambda: all(effects.llen(f"done:{n}") for n in sent), 60,
                 "every acknowledged send to run")
        new_primary = redis.Redis(port=group.primary_port())  # type: ignore[attr-defined]
        # A job whose ack the failover lost is still held on the promoted replica, with its
        # lock: its worker requeues it once unknown for ORPHAN_AFTER_S, and its rerun's ack
        # frees the lock (CI saw one left 60 s after every send had run).
        wait_for(lambda: not any(new_primary.scan_iter(f"{NS}:__unique__.*", count=1000)),
                 ORPHAN_AFTER_S + 45, "every lock freed by its job's end")
        peaks = {key: int(effects.get(f"peak:{key}") or 0) for key in keys}
        assert all(peak == 1 for peak in peaks.values()), peaks
    finally:
        for producer in producers:
            producer.kill()
        worker.kill()
