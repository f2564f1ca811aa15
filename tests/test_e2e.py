"""End to end with real processes: a baked worker drains 200 jobs exactly once, and refuses
to boot (exit 78, variable named) on bad configuration."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from bakery import (
    PYTHON, copy_project, free_port, package_of, project_env, run_cli)
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

PROBE_ACTOR = '''
import os
import time

import dramatiq
import redis

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


@dramatiq.actor(queue_name="notifications")
def probe(n: int) -> None:
    # Long enough that one process cannot run all 200 before the other's next poll:
    # a settlement refills its own slot, so a busy process keeps what it can run.
    time.sleep(0.05)
    _client.rpush("probe:done", f"{n}:{os.getpid()}")
'''


@pytest.fixture(scope="module")
def project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default bake with a probe actor dropped into actors/."""
    return copy_project(bake(), tmp_path_factory.mktemp("e2e") / "orders-worker",
                        probe=PROBE_ACTOR)


@pytest.mark.slow
def test_worker_processes_200_jobs_exactly_once(project: Path, redis_url: str,
                                                tmp_path: Path) -> None:
    env = project_env(project, WORKER_POOL="interactive", REDIS_URL=redis_url,
                      WORKER_PROCESSES="2",
                      WORKER_STATE_DIR=str(tmp_path / "state"), METRICS_PORT=str(free_port()))
    log = tmp_path / "worker.log"  # a file, not a pipe: a full pipe would stall the worker
    worker = subprocess.Popen([PYTHON, "-m", package_of(project), "worker"], cwd=project, env=env,
                              stderr=log.open("w"), start_new_session=True)
    try:
        # Both processes booted before the jobs arrive: one that boots seconds earlier may
        # otherwise run all 200 before the other fetches (the supervisor's status file).
        status = tmp_path / "state" / "supervisor.json"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if json.loads(status.read_text())["live"] == 2:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        broker = RedisBroker(url=redis_url)
        for n in range(200):
            broker.enqueue(Message(queue_name="notifications", actor_name="probe", args=(n,),
                                   kwargs={}, options={}))
        client = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 60
        while client.llen("probe:done") < 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # a duplicate would show up now
        done = [item.decode().split(":") for item in client.lrange("probe:done", 0, -1)]
        assert sorted(int(n) for n, _ in done) == list(range(200))
        assert len({pid for _, pid in done}) == 2, "both worker processes took jobs"
        assert client.llen("dramatiq:notifications") == 0
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
    stderr = log.read_text()
    assert worker.returncode == 0, stderr[-3000:]
    lines = stderr.splitlines()
    assert any('"worker started"' in line and '"version"' in line and '"config"' in line
               for line in lines)
    assert any('"worker stopped"' in line for line in lines)
    assert "secret" not in stderr


BAD_ENV = [
    ({"WORKER_CONCURRENCY": "0"}, "WORKER_CONCURRENCY='0': Input should be greater than or equal to 1"),
    ({"WORKER_CONCURRENCY": "many"}, "WORKER_CONCURRENCY='many': Input should be a valid integer"),
    ({"WORKER_POOL": "nope"}, "WORKER_POOL='nope': not a pool of pools.toml"),
    ({"WORKER_QUEUES": "reports"}, "WORKER_QUEUES='reports': queue 'reports' belongs to pool 'bulk'"),
    ({"WORKER_QUEUES": "ghost"}, "queue 'ghost' is not declared in pools.toml"),
    ({"WORKER_JOB_TIMEOUT_MS": "50000", "WORKER_SHUTDOWN_TIMEOUT_MS": "40000"},
     "WORKER_SHUTDOWN_TIMEOUT_MS='40000': must exceed WORKER_JOB_TIMEOUT_MS (50000)"),
    ({"REDIS_URL": "http://redis:6379"}, "REDIS_URL='http://redis:6379': must start with redis://"),
    ({"REDIS_URL": "redis://:hunter2@:6379/0"}, "REDIS_URL='redis://:***@:6379/0': needs a host"),
    ({"DB_POOL_SIZE": "4", "WORKER_CONCURRENCY": "8"},
     "DB_POOL_SIZE='4': must be at least WORKER_CONCURRENCY (8)"),
    ({"METRICS_PORT": "80"}, "METRICS_PORT='80': Input should be greater than or equal to 1024"),
]


@pytest.mark.parametrize(("bad", "line"), BAD_ENV, ids=[next(iter(b)) for b, _ in BAD_ENV])
def test_bad_env_refuses_to_boot_with_exit_78(project: Path, bad: dict[str, str],
                                              line: str) -> None:
    env = project_env(project, **{"WORKER_POOL": "interactive", **bad})
    done = run_cli(project, "worker", env=env)
    assert done.returncode == 78
    assert line in done.stderr
    assert "Traceback" not in done.stderr
    assert "hunter2" not in done.stderr


def test_bad_pools_toml_refuses_with_file_key_and_problem(project: Path, tmp_path: Path) -> None:
    pools = tmp_path / "pools.toml"
    pools.write_text((project / "pools.toml").read_text().replace("concurrency = 8", "concurrency = -1"))
    env = project_env(project, WORKER_POOL="interactive", WORKER_POOLS_FILE=str(pools))
    done = run_cli(project, "worker", env=env)
    assert done.returncode == 78
    assert f"{pools}: pools.interactive.concurrency: Input should be greater than or equal to 1" in done.stderr
    assert "Traceback" not in done.stderr


def test_config_prints_effective_config_with_secrets_masked(project: Path) -> None:
    env = project_env(project, WORKER_POOL="bulk", REDIS_URL="rediss://:s3cr3t@redis:6380/1",
                      DATABASE_URL="postgresql://app:pa55@db/app")
    done = run_cli(project, "config", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert '"REDIS_URL": "rediss://:***@redis:6380/1"' in done.stdout
    assert '"DATABASE_URL": "postgresql://app:***@db/app"' in done.stdout
    assert '"WORKER_PROCESSES": 2' in done.stdout
    assert "s3cr3t" not in done.stdout and "pa55" not in done.stdout


def test_actor_on_a_queue_of_no_pool_refuses_to_boot(project: Path, tmp_path: Path) -> None:
    orphan = tmp_path / "orders-worker"
    shutil.copytree(project, orphan)
    (orphan / "src" / package_of(orphan) / "actors" / "orphan.py").write_text(
        "import dramatiq\n\n\n@dramatiq.actor(queue_name='nowhere')\ndef lost() -> None:\n"
        "    pass\n"
    )
    env = project_env(orphan, WORKER_POOL="external", REDIS_URL="redis://127.0.0.1:1/0",
                      WORKER_STATE_DIR=str(tmp_path / "state"))
    done = run_cli(orphan, "worker", "--process", env=env)
    assert done.returncode == 78
    assert "actor 'lost' uses queue 'nowhere', which no pool in pools.toml serves" in done.stderr
