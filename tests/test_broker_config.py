"""Redis's configuration is checked at boot: a Redis that evicts keys refuses to boot.

A real redis-server per case. ``maxmemory-policy allkeys-lru`` (one eviction drops a whole
queue's bodies hash): the worker exits 78 with one line naming the policy and the fix,
before any process starts; ``REDIS_ALLOW_EVICTION=true`` accepts it (one warning) and the
worker runs. Where ``CONFIG GET`` is refused, by an ACL or a renamed command as managed
Redis services do, the worker reads ``INFO`` instead: a renamed CONFIG on an ``allkeys-lru``
Redis still refuses to boot; only where INFO is refused too does it say so once and run.

Persistence, where the operator asks for it: with ``REDIS_REQUIRE_PERSISTENCE=true`` a Redis
started with ``--save '' --appendonly no`` refuses to boot (78, one line naming what Redis
reports and the fix); ``--appendonly yes`` or RDB save points boot; unset, the bare Redis
boots; with CONFIG renamed away (``rename-command CONFIG ""``) the bare Redis still refuses
to boot (read from ``INFO persistence``) and an AOF Redis boots; where CONFIG and INFO are
both refused the one warning names both checks and jobs run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from _lifecycle import Jobs, Worker, lc_project, wait_for  # noqa: F401  (fixture)
from bakery import RedisServer, run_cli

pytestmark = pytest.mark.slow


def ran_jobs(project: Path, url: str, tmp_path: Path, count: int = 1,
             **env: str) -> Worker:
    """Start a worker on ``url``, run ``count`` quick jobs, stop it (exit 0): the worker, for
    its log records."""
    jobs = Jobs(url)
    worker = Worker(project, url, tmp_path / "w", **env).start()
    try:
        ids = [f"r{index}" for index in range(count)]
        for job_id in ids:
            jobs.enqueue("lc_quick", job_id)
        wait_for(lambda: all(jobs.dones(job_id) for job_id in ids), 30, "the jobs to run")
        assert worker.stop(timeout=30) == 0, worker.log()[-3000:]
    finally:
        worker.kill()
        jobs.client.close()
    return worker


def server(tmp_path: Path, name: str, *options: str) -> Iterator[RedisServer]:
    directory = tmp_path / name
    directory.mkdir()
    redis_server = RedisServer(directory, options=options)
    redis_server.start()
    try:
        yield redis_server
    finally:
        redis_server.stop()


@pytest.fixture
def evicting_redis(tmp_path: Path) -> Iterator[RedisServer]:
    yield from server(tmp_path, "lru", "--maxmemory", "20mb", "--maxmemory-policy", "allkeys-lru")


def test_an_evicting_redis_refuses_to_boot_in_one_line_naming_policy_and_fix(
        lc_project: Path, evicting_redis: RedisServer, tmp_path: Path) -> None:
    worker = Worker(lc_project, evicting_redis.url, tmp_path / "w")
    done = run_cli(lc_project, "worker", env=worker.env, timeout=60)
    assert done.returncode == 78, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "maxmemory-policy is allkeys-lru" in lines[0], lines
    assert "noeviction" in lines[0] and "REDIS_ALLOW_EVICTION=true" in lines[0], lines
    assert "Traceback" not in done.stdout + done.stderr
    assert not (worker.state_dir / "progress").exists(), "no worker process was started"


def test_redis_allow_eviction_accepts_it_with_one_warning(
        lc_project: Path, evicting_redis: RedisServer, tmp_path: Path) -> None:
    worker = ran_jobs(lc_project, evicting_redis.url, tmp_path, REDIS_ALLOW_EVICTION="true")
    warnings = worker.records("redis_eviction_allowed")
    assert len(warnings) == 1 and warnings[0]["policy"] == "allkeys-lru", worker.log()[-2000:]


def acl_url(url: str, *denied: str) -> str:
    """``url`` for a new ACL user ``worker`` allowed every command but ``denied``."""
    with redis.Redis.from_url(url) as admin:
        admin.acl_setuser("worker", enabled=True, passwords=["+secret"], keys=["*"],
                          channels=["*"], commands=["+@all", *(f"-{name}" for name in denied)])
    return url.replace("redis://", "redis://worker:secret@")


@pytest.fixture(params=["acl", "renamed"])
def config_refused(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A Redis whose CONFIG GET the worker may not run: an ACL user without ``config``, or
    CONFIG renamed away; yields the worker's REDIS_URL."""
    if request.param == "renamed":
        for found in server(tmp_path, "renamed", "--rename-command", "CONFIG", ""):
            yield found.url
        return
    for found in server(tmp_path, "acl"):
        yield acl_url(found.url, "config")


def test_a_refused_config_get_is_read_from_info_and_the_worker_runs(
        lc_project: Path, config_refused: str, tmp_path: Path) -> None:
    with redis.Redis.from_url(config_refused) as client, pytest.raises(redis.ResponseError):
        client.config_get("maxmemory-policy")  # the premise: CONFIG GET is refused
    worker = ran_jobs(lc_project, config_refused, tmp_path, 4, WORKER_PROCESSES="2")
    assert not worker.records("redis_config_unchecked"), worker.log()[-3000:]
    from_info = worker.records("redis_config_from_info")
    assert len(from_info) == 1 and from_info[0]["policy"] == "noeviction", from_info


def test_config_and_info_both_refused_is_said_once_and_the_worker_runs(
        lc_project: Path, tmp_path: Path) -> None:
    for found in server(tmp_path, "acl", "--save", "", "--appendonly", "no"):
        url = acl_url(found.url, "config", "info")
        worker = ran_jobs(lc_project, url, tmp_path, WORKER_PROCESSES="2",
                          REDIS_REQUIRE_PERSISTENCE="true")
        unchecked = worker.records("redis_config_unchecked")
        assert len(unchecked) == 1, worker.log()[-3000:]
        assert "CONFIG GET and INFO are refused" in unchecked[0]["msg"], unchecked
        assert "maxmemory-policy and persistence" in unchecked[0]["msg"], unchecked


def refused_in_one_line(project: Path, url: str, tmp_path: Path, **env: str) -> str:
    """Run the worker on ``url``: it must exit 78 with one line on stderr (returned)."""
    worker = Worker(project, url, tmp_path / "w", **env)
    done = run_cli(project, "worker", env=worker.env, timeout=60)
    assert done.returncode == 78, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert not (worker.state_dir / "progress").exists(), "no worker process was started"
    return str(lines[0])


RENAMED = ("--rename-command", "CONFIG", "")


def test_an_evicting_redis_without_config_refuses_to_boot(
        lc_project: Path, tmp_path: Path) -> None:
    for lru in server(tmp_path, "lru", "--maxmemory", "20mb", "--maxmemory-policy",
                      "allkeys-lru", *RENAMED):
        line = refused_in_one_line(lc_project, lru.url, tmp_path)
        assert "maxmemory-policy is allkeys-lru" in line and "REDIS_ALLOW_EVICTION=true" in line


def test_an_evicting_redis_without_config_is_accepted_with_allow_eviction(
        lc_project: Path, tmp_path: Path) -> None:
    for lru in server(tmp_path, "lru", "--maxmemory", "20mb", "--maxmemory-policy",
                      "allkeys-lru", *RENAMED):
        worker = ran_jobs(lc_project, lru.url, tmp_path, REDIS_ALLOW_EVICTION="true")
        warnings = worker.records("redis_eviction_allowed")
        assert len(warnings) == 1 and warnings[0]["policy"] == "allkeys-lru", warnings


@pytest.fixture
def bare_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis that persists nothing (as many managed caches run)."""
    yield from server(tmp_path, "bare", "--save", "", "--appendonly", "no")


def test_required_persistence_refuses_a_redis_that_persists_nothing(
        lc_project: Path, bare_redis: RedisServer, tmp_path: Path) -> None:
    with redis.Redis.from_url(bare_redis.url) as client:  # the premise
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
    worker = Worker(lc_project, bare_redis.url, tmp_path / "w", REDIS_REQUIRE_PERSISTENCE="true")
    done = run_cli(lc_project, "worker", env=worker.env, timeout=60)
    assert done.returncode == 78, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Redis persists nothing (appendonly no, save '')" in lines[0], lines
    assert "appendonly yes" in lines[0] and "REDIS_REQUIRE_PERSISTENCE=false" in lines[0], lines
    assert "Traceback" not in done.stdout + done.stderr
    assert not (worker.state_dir / "progress").exists(), "no worker process was started"


@pytest.mark.parametrize("options", [("--save", "", "--appendonly", "yes"),
                                     ("--save", "3600 1", "--appendonly", "no")],
                         ids=["aof", "rdb"])
def test_required_persistence_boots_on_a_redis_that_persists(
        lc_project: Path, tmp_path: Path, options: tuple[str, ...]) -> None:
    for persisting in server(tmp_path, "persisting", *options):
        worker = ran_jobs(lc_project, persisting.url, tmp_path, REDIS_REQUIRE_PERSISTENCE="true")
        assert not worker.records("redis_config_unchecked"), worker.log()[-2000:]


def test_persistence_is_not_required_by_default(
        lc_project: Path, bare_redis: RedisServer, tmp_path: Path) -> None:
    ran_jobs(lc_project, bare_redis.url, tmp_path)


def test_required_persistence_without_config_refuses_a_redis_that_persists_nothing(
        lc_project: Path, tmp_path: Path) -> None:
    for bare in server(tmp_path, "renamed", "--save", "", "--appendonly", "no", *RENAMED):
        with redis.Redis.from_url(bare.url) as client, pytest.raises(redis.ResponseError):
            client.config_get("save")  # the premise: CONFIG is renamed away
        line = refused_in_one_line(lc_project, bare.url, tmp_path,
                                   REDIS_REQUIRE_PERSISTENCE="true")
        assert "Redis persists nothing (INFO persistence: aof_enabled 0" in line, line
        assert "appendonly yes" in line and "REDIS_REQUIRE_PERSISTENCE=false" in line, line


def test_required_persistence_without_config_boots_on_an_aof_redis(
        lc_project: Path, tmp_path: Path) -> None:
    for aof in server(tmp_path, "aof", "--save", "", "--appendonly", "yes", *RENAMED):
        worker = ran_jobs(lc_project, aof.url, tmp_path, REDIS_REQUIRE_PERSISTENCE="true")
        assert len(worker.records("redis_config_from_info")) == 1, worker.log()[-2000:]
