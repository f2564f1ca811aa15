"""What the benchmarks share: a baked service with their actors, their own redis-server,
and worker processes started, awaited and stopped the same way.

The bake, the redis-server and the project's environment are the template tests' own
(``tests/bakery.py``, whose ``RedisServer`` is the baked projects' test fixture), so a
benchmark measures the service exactly as the tests run it. Messages are enqueued as
Dramatiq's RedisBroker does (the body in ``<ns>:<queue>.msgs``, its id pushed on the
queue), pipelined.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import redis
from dramatiq.message import Message

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import bakery
from bakery import (
    PYTHON,
    RedisServer,
    add_actors,
    bake_project,
    free_port,
    package_of,
    project_env,
)

__all__ = [
    "NS",
    "PACKAGE",
    "PYTHON",
    "QUEUE",
    "bake",
    "foreign_free_env",
    "free_port",
    "in_process",
    "message",
    "pipeline",
    "push",
    "redis_server",
    "start",
    "start_worker",
    "stop",
    "wait_for",
    "wait_started",
    "worker_env",
]

PACKAGE = "orders_worker"
QUEUE = "notifications"
NS = "dramatiq"
#: Settings of other tools that must not leak from this shell into a measured process.
FOREIGN_PREFIXES = ("OTEL_", "dramatiq_")
#: How often the benchmarks poll (their timings are read at this resolution).
POLL_S = 0.005


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """:func:`bakery.wait_for` polling every :data:`POLL_S`."""
    return bakery.wait_for(predicate, timeout, what, step=POLL_S)


def bake(output_dir: Path, actors: dict[str, str] | None = None, **context: str) -> Path:
    """Bake the template into ``output_dir`` with ``context`` and add ``actors`` (module
    name -> source, default none) to its actors package."""
    return add_actors(bake_project(output_dir, **context), **(actors or {}))


def redis_server(directory: Path) -> RedisServer:
    """A started redis-server on a free port, with ``directory`` (created) as its dir."""
    directory.mkdir(parents=True, exist_ok=True)
    server = RedisServer(directory)
    server.start()
    return server


#: The actor of the benchmarks that run the service's stack in their own process: it sleeps
#: ``ms`` (a no-op for 0).
PROFILE_ACTOR = """
import time

import dramatiq


@dramatiq.actor(queue_name="notifications", max_retries=0)
def profile_job(ms):
    if ms:
        time.sleep(ms / 1000)
"""


def in_process(
    root: Path, driver: str, **settings: str
) -> tuple[Path, Path, RedisServer, dict[str, str]]:
    """What a benchmark that runs the service's stack in a process of its own needs, under
    ``root``: a bake (``database=none``) with :data:`PROFILE_ACTOR`, ``driver`` written
    to ``root/driver.py``, a started redis-server, and the worker's environment (metric
    and state folders made) with ``settings``. Returns (project, driver, server, env)."""
    project = bake(root, {"profile_job": PROFILE_ACTOR}, database="none")
    script = root / "driver.py"
    script.write_text(driver)
    for folder in ("prom", "state"):
        (root / folder).mkdir()
    server = redis_server(root / "redis")
    env = worker_env(
        project, server.url, root / "state", PROMETHEUS_MULTIPROC_DIR=str(root / "prom"), **settings
    )
    return project, script, server, env


def foreign_free_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the variables of :data:`FOREIGN_PREFIXES`."""
    return {k: v for k, v in env.items() if not k.startswith(FOREIGN_PREFIXES)}


def worker_env(project: Path, redis_url: str, state_dir: Path, **settings: str) -> dict[str, str]:
    """The environment of ``project``'s worker on ``redis_url``: pool ``interactive``, one
    process, state in ``state_dir``, a free metrics port, then ``settings``."""
    defaults = {
        "WORKER_POOL": "interactive",
        "REDIS_URL": redis_url,
        "WORKER_STATE_DIR": str(state_dir),
        "METRICS_PORT": str(free_port()),
        "WORKER_PROCESSES": "1",
    }
    return {**foreign_free_env(project_env(project)), **defaults, **settings}


def start(
    command: list[str], cwd: Path, env: dict[str, str], log: Path | None = None
) -> subprocess.Popen[bytes]:
    """``command`` in its own process group, its output appended to ``log`` (default None:
    discarded)."""
    if log is None:
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    with log.open("ab") as out:
        return subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def start_worker(
    project: Path, env: dict[str, str], log: Path | None = None
) -> subprocess.Popen[bytes]:
    """The baked ``worker`` command of ``project`` (see :func:`start`)."""
    return start([PYTHON, "-m", package_of(project), "worker"], project, env, log)


def wait_started(
    client: redis.Redis,
    process: subprocess.Popen[bytes],
    timeout: float = 30,
) -> None:
    """Wait until a worker process sent its heartbeat (its consumers run); fail at once
    when ``process`` exits first."""

    def beating() -> bool:
        if process.poll() is not None:
            raise SystemExit(f"the worker exited {process.returncode} before its heartbeat")
        return bool(client.zcard(f"{NS}:__heartbeats__"))

    wait_for(beating, timeout, "the worker's heartbeat")


def stop(process: subprocess.Popen[bytes], timeout: float = 30, group: bool = True) -> int:
    """SIGTERM to the process group (``group``, default) or the process alone; its exit
    code, or -SIGKILL after SIGKILL to the group when it has not exited within ``timeout``."""
    try:
        if group:
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(signal.SIGTERM)
        return process.wait(timeout=timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        return -signal.SIGKILL


def message(actor: str, *args: Any, queue: str = QUEUE) -> Message[Any]:
    """A message for ``actor`` on ``queue`` whose Redis id is its message id."""
    made: Message[Any] = Message(
        queue_name=queue, actor_name=actor, args=args, kwargs={}, options={}
    )
    return made.copy(options={"redis_message_id": made.message_id})


def pipeline(client: redis.Redis, messages: Iterable[Message[Any]]) -> Any:
    """A pipeline (not yet executed, not a transaction) that enqueues ``messages`` (from
    :func:`message`): a benchmark times its ``execute()`` alone."""
    pipe = client.pipeline(transaction=False)
    for item in messages:
        redis_id = item.options["redis_message_id"]
        pipe.hset(f"{NS}:{item.queue_name}.msgs", redis_id, item.encode())
        pipe.rpush(f"{NS}:{item.queue_name}", redis_id)
    return pipe


def push(client: redis.Redis, messages: Iterable[Message[Any]], batch: int = 10_000) -> None:
    """Enqueue ``messages`` (from :func:`message`), ``batch`` per pipeline (default 10,000)."""
    pending = iter(messages)
    while chunk := list(itertools.islice(pending, batch)):
        pipeline(client, chunk).execute()
