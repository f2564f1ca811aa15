"""Helpers for the template's tests: bake projects and run them in this venv.

Every baked project runs from its ``src/`` through ``PYTHONPATH`` in this one venv
(``sys.executable``), on the worker runtime installed in it (``-e ./runtime``), so no test
pays for a pip install per bake.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cookiecutter.main import cookiecutter
from worker_runtime import testing

TEMPLATE = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
#: The PostgreSQL the database option is tested against (.ci/run makes the socket login work).
TEST_DATABASE_URL = os.environ.get(
    "TEST_DATABASE_URL", "postgresql:///postgres?host=/var/run/postgresql"
)
#: A pool of the default bake whose handlers use PostgreSQL (pools.toml: ``uses``), and its
#: queue. The quick start's pools (interactive, external) use none: the tests that need a
#: database run this one.
DATABASE_POOL, DATABASE_QUEUE = "critical", "payments"


def load_module(name: str, path: Path) -> Any:
    """The Python file ``path`` imported as module ``name`` (not added to ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The runtime's pytest plugin (worker_runtime.testing) has the redis-server fixtures.
RedisServer = testing.RedisServer
free_port = testing.free_port


def bake_project(output_dir: Path, **context: str) -> Path:
    """Bake the template into ``output_dir`` without prompts; return the project dir."""
    return Path(
        cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(output_dir), extra_context=context)
    )


def make(project: Path, *args: str, timeout: float = 120,
         wrap: Callable[..., list[str]] | None = None) -> subprocess.CompletedProcess[str]:
    """``make *args`` in ``project`` as a new team runs it: no venv active, no PYTHON
    (``wrap``: the command line run instead, given make's, e.g. in a namespace)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "PYTHON", "MAKE", "MFLAGS"))}
    command = ["make", *args]
    return subprocess.run(wrap(*command) if wrap else command, cwd=project, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def package_of(project: Path) -> str:
    return project.name.replace("-", "_")


def add_actors(project: Path, **modules: str) -> Path:
    """Write each of ``modules`` (module name -> source) into ``project``'s actors package;
    return ``project``."""
    for name, source in modules.items():
        (project / "src" / package_of(project) / "actors" / f"{name}.py").write_text(source)
    return project


def copy_project(base: Path, target: Path, **actors: str) -> Path:
    """Copy the bake ``base`` to ``target`` (no caches) and add ``actors`` (see
    :func:`add_actors`); return ``target``."""
    shutil.copytree(base, target, ignore=shutil.ignore_patterns("__pycache__", ".*_cache"))
    return add_actors(target, **actors)


def make_manifests(project: Path, stack: str) -> subprocess.CompletedProcess[str]:
    """The baked ``make manifests STACK=<stack>`` (renders build/manifests/<stack>.yaml)."""
    return subprocess.run(
        ["make", "-s", "manifests", f"STACK={stack}", f"PYTHON={PYTHON}"],
        check=False, cwd=project, capture_output=True, text=True, timeout=120,
    )


def project_env(project: Path, **overrides: str) -> dict[str, str]:
    """Environment that runs ``project`` from its src/ in this venv (then the PYTHONPATH this
    run was given, if any).

    ``WORKER_STATE_DIR`` is the project's own (``<project>-state`` beside it) unless
    ``overrides`` name one: the service's default, ``/tmp/<project>``, is one folder for
    every bake of the same name, and a supervisor refuses a folder that another one of a
    parallel test uses."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "REDIS_", "DATABASE_"))}
    # The project's src first, then what this run was given (a worktree's runtime and infra
    # before the venv's editable install of another checkout).
    inherited = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    env["PYTHONPATH"] = os.pathsep.join([str(project / "src"), *inherited])
    env["PYTHONUNBUFFERED"] = "1"
    env["WORKER_STATE_DIR"] = str(project.parent / f"{project.name}-state")
    env.update(overrides)
    return env


def run_cli(project: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 60,
            ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m <package> *args`` in ``project`` and capture its output."""
    return subprocess.run(
        [PYTHON, "-m", package_of(project), *args],
        cwd=project, env=env or project_env(project), capture_output=True, text=True,
        timeout=timeout,
    )


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, step: float = 0.02) -> Any:
    """Poll ``predicate`` every ``step`` seconds (default 0.02) until it is truthy and return
    its value; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def require_postgres(url: str = TEST_DATABASE_URL) -> str:
    """``url`` (default :data:`TEST_DATABASE_URL`) when a PostgreSQL answers there; else the
    test is skipped on a desk and fails in CI (``CI`` set), where ``.ci/run`` starts one: a
    database test never passes there by being skipped."""
    import pytest

    if not postgres_answers(url):
        reason = f"no PostgreSQL answers at {url} (TEST_DATABASE_URL)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; .ci/run starts one", pytrace=False)
        pytest.skip(reason)
    return url


def postgres_answers(url: str = TEST_DATABASE_URL) -> bool:
    """Whether a PostgreSQL answers ``select 1`` at ``url`` (default
    :data:`TEST_DATABASE_URL`) within 2 s."""
    try:
        import psycopg
    except ImportError:
        return False
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            conn.execute("select 1")
        return True
    except psycopg.Error:
        return False
