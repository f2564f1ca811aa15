"""The first hour of a product team with a fresh bake, beyond the README's runbook
(test_readme_runbook.py): `make` alone helps, infra/ installs from the pinned tag or a
local checkout of this template and says which, and what cannot run says in one line
what to run instead."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import yaml
from _lifecycle import Jobs, Worker, lc_project  # noqa: F401  (fixture)
from bakery import (
    PYTHON,
    TEMPLATE,
    RedisServer,
    add_actors,
    bake_project,
    free_port,
    make,
    project_env,
    run_cli,
    wait_for,
)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bake_project(tmp_path_factory.mktemp("first-hour"))


def test_a_bare_make_prints_help_and_installs_nothing(project: Path) -> None:
    done = make(project)
    assert done.returncode == 0, done.stderr
    targets = [line.split()[0] for line in done.stdout.splitlines()[1:]]
    assert {"help", "install", "run", "dev", "test", "lint", "infra-install",
            "manifests", "docs"} <= set(targets), done.stdout
    assert all(len(line.split(maxsplit=1)) == 2 for line in done.stdout.splitlines()[1:])
    assert not (project / ".venv").exists()
    assert make(project, "help").stdout == done.stdout


@pytest.mark.parametrize("target", ["manifests", "simulate", "alerts", "alerts-check"])
def test_infra_targets_without_worker_infra_say_what_to_run(project: Path, target: str) -> None:
    """Without infra/venv (and with a python that lacks worker_infra): one line, no
    ModuleNotFoundError traceback."""
    done = make(project, target, "STACK=dev", "PYTHON=python3")
    assert done.returncode != 0
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "worker-infra is not installed: run 'make infra-install'" in lines[0]
    assert "WORKER_TEMPLATE=" in lines[0]


def test_an_unreachable_pin_says_to_use_a_local_checkout(tmp_path: Path) -> None:
    """A bake made elsewhere (no template-source.mk of a checkout on this machine) whose
    pinned tag's repository is not reachable (a fresh bake's placeholder org is not): pip's error, then the one line naming the pin and the local-checkout command."""
    project = bake_project(tmp_path, template_repo=f"file://{tmp_path}/no-such-repo")
    (project / "template-source.mk").unlink()  # baked elsewhere: no checkout of it here
    done = make(project, "infra-install", timeout=600)
    assert done.returncode != 0
    assert done.stdout.startswith(
        f"worker-infra: from the pinned tag git+file://{tmp_path}/no-such-repo@v0.1.0"
    ), done.stdout
    last = done.stdout.strip().splitlines()[-1]
    assert last == (
        f"infra-install: could not install git+file://{tmp_path}/no-such-repo@v0.1.0"
        "#subdirectory=infra; from a local checkout of worker-template: "
        "make infra-install WORKER_TEMPLATE=/path/to/worker-template"
    ), done.stdout


def test_a_wrong_local_checkout_is_one_line(project: Path, tmp_path: Path) -> None:
    done = make(project, "infra-install", f"WORKER_TEMPLATE={tmp_path}")
    assert done.returncode != 0
    assert f"infra-install: {tmp_path} is not a checkout of worker-template" in done.stdout
    assert not (project / "infra" / "venv").exists()


@pytest.mark.slow
def test_infra_install_from_a_local_checkout_renders_dev(tmp_path: Path) -> None:
    """`make infra-install WORKER_TEMPLATE=<this checkout>` then `make manifests STACK=dev`
    in a fresh bake whose pin points nowhere reachable: worker-infra comes from the checkout
    (editable), the rest of infra/requirements.txt from PyPI, and it says so."""
    project = bake_project(tmp_path, template_repo="https://github.com/example-org/worker-template")
    python = shutil.which("python3")
    assert python
    done = make(project, "infra-install", f"WORKER_TEMPLATE={TEMPLATE}", timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.startswith(
        f"worker-infra: from the local checkout {TEMPLATE}/infra (WORKER_TEMPLATE), not the pin "
        "git+https://github.com/example-org/worker-template@v0.1.0#subdirectory=infra"
    ), done.stdout
    where = subprocess.run(
        [str(project / "infra" / "venv" / "bin" / "python"), "-c",
         "import worker_infra; print(worker_infra.__file__)"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert where.stdout.strip().startswith(str(TEMPLATE / "infra")), where.stdout
    done = make(project, "manifests", "STACK=dev", timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    objects = [o for o in yaml.safe_load_all((project / "build/manifests/dev.yaml").read_text())
               if o]
    assert sum(o["kind"] == "Deployment" for o in objects) >= 5


NAP = '''
import time
from pathlib import Path

import dramatiq


@dramatiq.actor(queue_name="notifications")
def nap(marker: str, release: str, limit: float) -> None:
    """Runs until ``release`` exists (at most ``limit`` seconds): in flight for as long as
    the test needs, however slow the machine."""
    Path(marker).write_text("started")
    deadline = time.monotonic() + limit
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
'''


def lines_of(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines()


def wait_for_line(log: Path, predicate: Callable[[str], bool], what: str,
                  after: int = 0, timeout: float = 90) -> int:
    """The index of the first line of ``log`` past ``after`` that ``predicate`` accepts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for index, line in enumerate(lines_of(log)[after:], start=after):
            if predicate(line):
                return index
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(lines_of(log)[-30:]))


def kill_session(sid: int) -> None:
    """SIGKILL every process of the session ``sid`` (field 6 of /proc/<pid>/stat)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[3]) == sid:
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile


@pytest.mark.slow
def test_make_dev_runs_redis_and_the_pool_and_reloads_after_the_drain(tmp_path: Path) -> None:
    """`make dev` in a fresh bake: its own redis-server, the pool with console logs; an
    edit of an actor's module while a job runs drains that job (it ends done, not
    interrupted) before the worker starts again; Ctrl-C drains and stops it all, then Redis."""
    project = add_actors(bake_project(tmp_path / "bake", project="dev-worker"), nap=NAP)
    redis_port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "PYTHON", "MAKE", "MFLAGS", "REDIS_", "WORKER_",
                                "LOG_", "METRICS_", "DATABASE_", "PG"))}
    # No PostgreSQL for the default pool (interactive uses none): a desk without a database.
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        make_dev = subprocess.Popen(
            ["make", "dev", f"PYTHON={PYTHON}", f"DEV_REDIS_PORT={redis_port}",
             f"DEV_METRICS_PORT={metrics_port}", f"WORKER_STATE_ROOT={tmp_path / 'state'}"],
            cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        console = re.compile(r"\d\d:\d\d:\d\d\.\d{3} (INFO|WARNING|ERROR) +(.*)")
        started = wait_for_line(log, lambda line: " worker started " in line, "the start")
        assert f"make dev: starting redis-server on port {redis_port}" in log.read_text()
        assert console.fullmatch(lines_of(log)[started])
        assert not [line for line in lines_of(log) if line.startswith("{")], "JSON lines"
        # A job running when its module is edited: the reload drains it. It runs until the
        # test has seen the reload begin (a fixed nap ended before a loaded machine's
        # watcher noticed the edit: drained finished=0).
        marker, release = tmp_path / "nap-started", tmp_path / "nap-release"
        send = (f"from dev_worker.actors.nap import nap; "
                f"nap.send({str(marker)!r}, {str(release)!r}, 120.0)")
        subprocess.run([PYTHON, "-c", send], cwd=project, check=True, timeout=60,
                       env={**env, "PYTHONPATH": str(project / "src"),
                            "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"})
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.05)
        module = project / "src" / "dev_worker" / "actors" / "nap.py"
        module.write_text(module.read_text() + "\n# edited\n")
        reloading = wait_for_line(log, lambda line: "source changed: reloading" in line,
                                  "the reload", after=started)
        release.write_text("go")
        drained = wait_for_line(log, lambda line: " drained " in line, "the drain", reloading)
        assert "finished=1" in lines_of(log)[drained] and "interrupted=0" in lines_of(log)[drained]
        ended = [line for line in lines_of(log)[reloading:drained] if "event=job_end" in line]
        assert len(ended) == 1 and "actor=nap" in ended[0] and "outcome=success" in ended[0]
        again = wait_for_line(log, lambda line: " worker started " in line, "the restart",
                              after=drained)
        # Ctrl-C: SIGINT to the terminal's foreground process group.
        os.killpg(make_dev.pid, signal.SIGINT)
        # make itself says "Interrupt" and dies of the SIGINT (as `make run` does); what
        # ran under it drained and stopped cleanly first.
        assert make_dev.wait(timeout=120) in (0, -signal.SIGINT), "\n".join(lines_of(log)[-20:])
        stopped = [line for line in lines_of(log)[again:] if " worker stopped " in line]
        assert len(stopped) == 1 and "exit_code=0" in stopped[0], lines_of(log)[again:]
        with pytest.raises(redis.ConnectionError):  # its redis-server stopped too
            redis.Redis(port=redis_port, socket_connect_timeout=1).ping()
    finally:
        # `make dev` puts each job in its own process group (set -m): on a failure, kill
        # the whole session, or its redis-server and workers outlive the test.
        kill_session(make_dev.pid)
        make_dev.wait(timeout=30)
        print(log.read_text()[-5000:])


@pytest.mark.slow
def test_make_lints_mypy_checks_the_tests_too(project: Path, tmp_path: Path) -> None:
    """The mypy --strict of `make lint` (and of the pre-commit hook) reads the tests as well
    as src/ (pyproject.toml's files): a type error planted in a test file fails it, named."""
    copy = tmp_path / project.name
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns(".venv", ".mypy_cache"))
    (copy / "tests" / "test_planted.py").write_text(
        'def test_planted() -> None:\n    count: int = "three"\n    assert count\n')
    done = subprocess.run([PYTHON, "-m", "mypy", "--strict"], cwd=copy, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "tests/test_planted.py:2: error: Incompatible types in assignment" in done.stdout, (
        done.stdout)


def test_ci_actions_are_pinned_by_commit_and_kept_current(project: Path) -> None:
    """Every action of the baked CI is pinned to a commit SHA (its tag in a comment), its
    PostgreSQL is compose.yaml's (pinned by digest), and the bake's Dependabot config updates
    the actions, the base image, compose's images and both Python dependency sets."""
    workflow = (project / ".github" / "workflows" / "ci.yml").read_text()
    uses = re.findall(r"uses: (\S+)(.*)", workflow)
    assert uses, "no action in ci.yml"
    for action, comment in uses:
        assert re.fullmatch(r"[\w-]+/[\w-]+@[0-9a-f]{40}", action), action
        assert re.fullmatch(r"\s+# v\d+\.\d+\.\d+", comment), (action, comment)
    config = yaml.safe_load((project / ".github" / "dependabot.yml").read_text())
    covered = {(u["package-ecosystem"], u["directory"]) for u in config["updates"]}
    assert {("github-actions", "/"), ("docker", "/"), ("docker-compose", "/"), ("pip", "/"),
            ("pip", "/infra")} <= covered
    # CI runs no image of its own: its PostgreSQL is compose.yaml's, pinned there by digest
    # (the baked tests/test_compose.py) and kept current by the docker-compose entry.
    assert "image:" not in workflow
    assert "docker compose up -d --wait postgres" in workflow


@pytest.mark.slow
def test_make_lock_pins_what_make_install_the_image_and_ci_install(tmp_path: Path) -> None:
    """A fresh bake carries its lock files and installs from them; after a change of
    pyproject.toml's dependencies, `make lock` rewrites requirements.lock and
    requirements-dev.lock (uv, universal, hashes), every dependency pinned but worker-runtime;
    `make install` then installs exactly those versions, and the Dockerfile and CI install
    from the lock files too."""
    project = bake_project(tmp_path, project="lock-worker")
    # worker-runtime from this checkout (no index has it: #40's packaging makes it the default)
    runtime = f"WORKER_TEMPLATE={TEMPLATE}"
    done = make(project, "install", runtime, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "install: the versions of requirements-dev.lock" in done.stdout
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('    "pytest>=8",\n',
                                                       '    "pytest>=8",\n    "toolz>=0.12",\n'))
    assert "toolz" not in (project / "requirements-dev.lock").read_text()
    done = make(project, "lock", runtime, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    pins = {}
    for name in ("requirements.lock", "requirements-dev.lock"):
        lines = [line for line in (project / name).read_text().splitlines()
                 if line and not line.startswith((" ", "#"))]
        assert lines and all("==" in line and line.endswith("\\") for line in lines), lines
        pins[name] = dict(line.split()[0].split("==") for line in lines)  # hashes follow
        assert "worker-runtime" not in pins[name]
    assert "pytest" in pins["requirements-dev.lock"] and "pytest" not in pins["requirements.lock"]
    assert "toolz" in pins["requirements-dev.lock"]
    assert {"dramatiq", "redis", "pydantic", "psycopg"} <= set(pins["requirements.lock"])
    done = make(project, "install", runtime, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "install: the versions of requirements-dev.lock" in done.stdout
    freeze = subprocess.run([str(project / ".venv" / "bin" / "python"), "-m", "pip", "freeze"],
                            capture_output=True, text=True, timeout=120, check=True).stdout
    installed = dict(line.split("==") for line in freeze.splitlines() if "==" in line)
    for name in ("pydantic", "redis", "pytest", "mypy", "toolz"):
        assert installed[name] == pins["requirements-dev.lock"][name], name
    dockerfile = (project / "Dockerfile").read_text()
    assert "COPY requirements.lock ./" in dockerfile
    assert "--require-hashes -r requirements.lock" in dockerfile
    assert "!requirements.lock" in (project / ".dockerignore").read_text().splitlines()
    ci = (project / ".github" / "workflows" / "ci.yml").read_text()
    assert "pip install -e" not in ci and ci.count("make install PYTHON=python") == 2


# -- Redis not running, a mistyped variable, a bad value: each one clear line ---------------


@pytest.mark.slow
def test_redis_not_running_is_one_line_naming_redis_url_then_quiet(
        lc_project: Path, tmp_path: Path) -> None:
    """Redis not running at boot: one line naming REDIS_URL and how to start Redis, no
    CRITICAL line while the supervisor retries quietly; liveness holds; once a
    redis-server listens there, the worker starts and runs a job, and SIGTERM exits 0."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    worker = Worker(lc_project, url, tmp_path / "w").start()
    server = None
    try:
        wait_for(lambda: worker.records("redis_unreachable"), 30, "the unreachable line")
        time.sleep(10)  # 10 s of retries: Dramatiq's consumers logged 6 CRITICAL lines
        (said,) = worker.records("redis_unreachable")
        assert f"REDIS_URL={url}" in said["msg"], said
        assert "redis-server" in said["msg"] and "docker compose up -d redis" in said["msg"]
        loud = [record for record in worker.records() if record["level"] in ("critical", "error")]
        assert loud == [said], worker.log()[-3000:]
        assert len(worker.log().splitlines()) <= 2, worker.log()[-3000:]
        assert worker.healthcheck("live").returncode == 0  # waiting for Redis is alive
        (tmp_path / "redis").mkdir()
        server = RedisServer(tmp_path / "redis")
        server.port, server.url = port, url
        server.start()
        wait_for(lambda: worker.records("redis_reachable"), 30, "Redis to be seen answering")
        jobs = Jobs(url)
        jobs.enqueue("lc_quick", "first")
        wait_for(lambda: jobs.dones("first"), 30, "the first job")
        jobs.client.close()
        assert worker.stop(timeout=60) == 0, worker.log()[-3000:]
    finally:
        worker.kill()
        if server is not None:
            server.stop()


@pytest.mark.slow
def test_redis_lost_while_running_is_one_line_per_process_then_quiet(
        lc_project: Path, tmp_path: Path) -> None:
    """Redis stopped under a running worker (2 processes) for 10 s: each process says it
    once (no CRITICAL line from Dramatiq's consumers, no warning per recovery pass), then
    once that Redis answers again, and runs a job."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    server.start()
    worker = Worker(lc_project, server.url, tmp_path / "w", WORKER_PROCESSES="2").start()
    jobs = Jobs(server.url)
    try:
        wait_for(lambda: jobs.client.zcard("dramatiq:__heartbeats__") >= 2, 30, "2 processes")
        before = len(worker.records())
        server.stop()
        wait_for(lambda: len(worker.records("redis_unreachable")) == 2, 30, "both processes")
        time.sleep(10)  # Dramatiq's consumers logged 2 lines each per 3 s before
        during = worker.records()[before:]
        assert [r["event"] for r in during if r["level"] != "info"] == [
            "redis_unreachable", "redis_unreachable"], worker.log()[-3000:]
        server.start()
        wait_for(lambda: len(worker.records("redis_reachable")) == 2, 30, "Redis answering")
        jobs.enqueue("lc_quick", "after")
        wait_for(lambda: jobs.dones("after"), 30, "a job after the outage")
        assert worker.stop(timeout=60) == 0, worker.log()[-3000:]
    finally:
        worker.kill()
        jobs.client.close()
        server.stop()


def test_sigterm_while_waiting_for_redis_exits_0(lc_project: Path, tmp_path: Path) -> None:
    worker = Worker(lc_project, f"redis://127.0.0.1:{free_port()}/0", tmp_path / "w").start()
    try:
        wait_for(lambda: worker.records("redis_unreachable"), 30, "the unreachable line")
        assert worker.stop(timeout=10) == 0, worker.log()[-3000:]
        assert not worker.children()
    finally:
        worker.kill()


def test_a_mistyped_variable_is_warned_at_boot_with_the_closest_name(
        lc_project: Path, tmp_path: Path) -> None:
    worker = Worker(lc_project, f"redis://127.0.0.1:{free_port()}/0", tmp_path / "w",
                    WORKER_CONCURENCY="4", HEALTH_STALED_AFTER_S="30",
                    REDIS_ALOW_EVICTION="true").start()
    try:
        wait_for(lambda: worker.records("redis_unreachable"), 30, "the boot")
        warned = sorted(record["msg"] for record in worker.records("unknown_variable"))
        assert warned == [
            f"{name} is not a setting of this service (did you mean {known}?); it is ignored"
            for name, known in [("HEALTH_STALED_AFTER_S", "HEALTH_STALLED_AFTER_S"),
                                ("REDIS_ALOW_EVICTION", "REDIS_ALLOW_EVICTION"),
                                ("WORKER_CONCURENCY", "WORKER_CONCURRENCY")]
        ], worker.log()[-3000:]
        assert worker.stop(timeout=10) == 0
    finally:
        worker.kill()


@pytest.mark.parametrize("value", ["abc", "0"])
def test_a_bad_concurrency_reports_only_the_variable_the_user_set(
        project: Path, tmp_path: Path, value: str) -> None:
    env = project_env(project, WORKER_POOL="interactive", WORKER_CONCURRENCY=value,
                      WORKER_STATE_DIR=str(tmp_path / "state"))
    done = run_cli(project, "worker", env=env)
    assert done.returncode == 78, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"config error: WORKER_CONCURRENCY='{value}'"), lines
    env["WORKER_PREFETCH"] = value  # set by the user, a bad derived variable is reported
    done = run_cli(project, "worker", env=env)
    assert [line.split("=")[0] for line in done.stderr.strip().splitlines()] == [
        "config error: WORKER_CONCURRENCY", "config error: WORKER_PREFETCH"], done.stderr
