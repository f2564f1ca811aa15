"""The baked README, followed as a new team would: bake, then run the shell commands of its
"Quick start" and "Deploying" blocks and the code of "Enqueue a job", in README order, in
one terminal whose state (an activated venv, exported variables) carries from command to
command; each must succeed and do what the README says it does. `make install` is real: a
new venv, pip installing the project and its dependencies from PyPI (about 35 s). No
PostgreSQL is reachable (DATABASE_URL unset, libpq's default host empty): the quick start's
two pools, side by side, need none, and a pool that does says so in the README's one line.

Every command is run as written unless this file names it below, with the reason:
SUBSTITUTED (this machine differs from a laptop), FOREGROUND (it holds its terminal until
Ctrl-C), NARROWED (run as written, on part of its input) or SKIPPED (it needs what this
machine cannot have). A command the README repeats (Deploying repeats `make manifests
STACK=prod`... and `make simulate`) runs once: nothing it reads changes in between. A README
command renamed or broken is run and fails; an entry here that no README command matches
fails too (test_the_runbook_notices_a_renamed_command proves both on a mutated README).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from bakery import DATABASE_POOL, bake_project
from worker_runtime import testing

#: The README's sections whose code blocks are the runbook, in README order.
SECTIONS = ("Quick start", "Deploying", "Enqueue a job")
#: A project name of its own: its default state dir (/tmp/<project>) is this test's alone.
PROJECT = "runbook-worker"
#: The pool the README runs, and the actor of its example job.
POOL, ACTOR = "interactive", "send_notification"
#: The baked tests that need a PostgreSQL (they skip without DATABASE_URL).
DATABASE_TESTS = "tests/test_db.py"

SKIPPED = {
    "make infra-install": (
        "pip-installs worker-infra from its git pin (the template repository's tag: not "
        "reachable from here) and Pulumi's wheels (minutes): test_infra_baked.py::"
        "test_a_fresh_bake_renders_prod_following_its_readme runs it from a tagged local "
        "repository; here infra/venv is this checkout's worker-infra (the shared venv)"
    ),
    "docker compose up --build": (
        "no Docker engine on this machine (the docker client only): compose.yaml is "
        "validated against the Compose Specification's schema (test_generated_files.py) and "
        "against pools.toml (the baked tests/test_compose.py)"
    ),
}
SUBSTITUTED = {
    "redis-server --save '' &": (
        "6379 is this machine's shared Redis: a private redis-server of the test fixtures on "
        "a free port, its URL exported as REDIS_URL for every later command"
    ),
}
#: The second pool the README runs beside the first, and the port its line names.
SECOND, SECOND_PORT = "external", "9192"
SECOND_RUN = f"make run POOL={SECOND} METRICS_PORT={SECOND_PORT}"
FOREGROUND = {
    SECOND_RUN: (
        "a second pool beside the first, run as written but on a free metrics port (9192 "
        "may be taken on this shared machine); it must leave the first pool's state alone "
        "(its /readyz and its metrics still answer) and drain on Ctrl-C too"
    ),
    f"make run POOL={POOL}": (
        "holds its terminal: started, waited for until it logs its start, kept running while "
        "the later commands run (a second terminal); a save of an actor's module must reload "
        "it after its drain; stopped with Ctrl-C (SIGINT to its process group) at the end, "
        "which must drain and exit 0"
    ),
}
#: What `make test` leaves out here (PYTEST_ADDOPTS): the sandbox's escape matrix.
NOT_HERE = "tests/test_sandbox.py"
NARROWED = {
    "make test": (
        f"runs as written (the Makefile, the venv, pytest's config, its own redis-server), "
        f"with --ignore={NOT_HERE}: the escape matrix is 72 of the suite's 76 s on 2 cores; "
        "test_template.py runs `make test` whole for every option combination (slow)"
    ),
}
HANDLED = {**SKIPPED, **SUBSTITUTED, **FOREGROUND, **NARROWED}


# ---- reading the README -----------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One command of the README (a shell line, or a whole Python block), where it stands."""

    section: str
    language: str
    command: str


def readme_steps(readme: str) -> list[Step]:
    """The runbook: the commands of the SECTIONS' sh and python blocks, in README order.

    Parameters:
      readme: the README's text.

    A shell line's trailing ``# comment`` is dropped; a python block is one step.
    """
    sections = re.split(r"^## ", readme, flags=re.M)
    found: list[Step] = []
    for section in sections:
        heading = section.split("\n", 1)[0].strip()
        if heading not in SECTIONS:
            continue
        for language, body in re.findall(r"```(\w*)\n(.*?)```", section, re.S):
            assert language in {"sh", "python"}, f"{heading}: a ```{language} block, not run"
            if language == "python":
                found.append(Step(heading, language, body))
            elif language == "sh":
                for line in body.splitlines():
                    command = re.sub(r"\s+#\s.*$", "", line).strip()
                    assert not command.endswith("\\"), f"{heading}: continued line {command}"
                    if command:
                        found.append(Step(heading, language, command))
    headings = {step.section for step in found}
    assert headings == set(SECTIONS), f"README sections without code: {set(SECTIONS) - headings}"
    return found


def stale_entries(steps: list[Step]) -> list[str]:
    """Handled commands that no README command is any more (renamed or removed).

    Parameters:
      steps: the README's runbook.
    """
    commands = {step.command for step in steps}
    return [command for command in HANDLED if command not in commands]


# ---- one terminal -----------------------------------------------------------------------------


def fresh_environment() -> dict[str, str]:
    """A new team's terminal: this test's own venv, variables and pytest's left out."""
    venv_bin = str(Path(sys.prefix) / "bin")
    drop = ("WORKER_", "REDIS_", "DATABASE_", "TEST_DATABASE_", "DB_", "PG", "PYTEST_",
            "VIRTUAL_ENV", "PYTHON", "COV_", "METRICS_", "HEALTH_", "OTEL_", "LOG_LEVEL", "DLQ_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p != venv_bin)
    return env


@dataclass
class Terminal:
    """A shell session in the project: each command runs in bash with the variables that the
    commands before it exported or sourced; its output is kept for the checks."""

    cwd: Path
    env: dict[str, str]
    log: list[str] = field(default_factory=list)
    timings: list[tuple[str, float]] = field(default_factory=list)

    def run(self, command: str, *, timeout: float = 300,
            extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``command`` in bash, then keep the environment it leaves (``export``, ``.``)."""
        started = time.monotonic()
        state = self.cwd.parent / ".runbook-env"
        script = f"{command}\n__rc=$?\nenv -0 > {shlex.quote(str(state))}\nexit $__rc\n"
        done = subprocess.run(["bash", "-c", script], cwd=self.cwd,
                              env={**self.env, **(extra or {})}, capture_output=True,
                              text=True, timeout=timeout, check=False)
        self.timings.append((command, time.monotonic() - started))
        self.log.append(f"$ {command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        if state.exists():
            pairs = (item.split("=", 1) for item in state.read_text().split("\0") if "=" in item)
            self.env = {k: v for k, v in pairs if not k.startswith(("BASH_FUNC_", "_"))
                        and k not in {"SHLVL", "PWD", "OLDPWD"} and k not in (extra or {})}
            state.unlink()
        return done

    def start(self, command: str, log: Path) -> subprocess.Popen[bytes]:
        """Start ``command`` in the foreground of a terminal of its own (its own session)."""
        with log.open("wb") as out:
            return subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.cwd,
                                    env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)


def json_lines(path: Path) -> list[dict[str, Any]]:
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines


def wait_for(what: str, predicate: Callable[[], Any], timeout: float = 60) -> Any:
    """Poll ``predicate`` until it returns something truthy (a state, not a time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def still_running(group: int) -> str:
    """What is left of process group ``group``: each process and where its threads wait."""
    rows = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.getpgid(int(proc.name)) != group:
                continue
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            waits = sorted({(task / "wchan").read_text() for task in (proc / "task").iterdir()})
        except OSError:
            continue
        rows.append(f"{proc.name} {command} (threads waiting in: {', '.join(waits)})")
    return "\n".join(rows) or "nothing"


# ---- the run ----------------------------------------------------------------------------------


@dataclass
class Runbook:
    """A fresh bake followed step by step; the checks below look at what each step did."""

    project: Path
    database: bool
    redis_url: str
    terminal: Terminal
    baked: dict[str, str]
    foreground: dict[str, tuple[subprocess.Popen[bytes], Path]] = field(default_factory=dict)
    results: dict[str, subprocess.CompletedProcess[str]] = field(default_factory=dict)
    second_port: str = ""

    def pool(self) -> dict[str, Any]:
        pools: dict[str, Any] = tomllib.loads((self.project / "pools.toml").read_text())
        return dict(pools["pools"][POOL])

    def worker_log(self) -> Path:
        return self.foreground[f"make run POOL={POOL}"][1]

    def step(self, step: Step) -> None:
        if step.command in self.results:  # the Deploying block repeats two Quick start lines
            return
        if step.command in SKIPPED:
            if step.command == "make infra-install":
                self.stand_in_infra_venv()
            return
        if step.command in SUBSTITUTED:
            self.substitute(step.command)
            return
        if step.command in FOREGROUND:
            self.start_foreground(step.command)
            return
        command = step.command
        if step.language == "python":  # a second terminal, with the venv activated
            script = self.project.parent / "enqueue.py"
            script.write_text(step.command)
            command = f"python {shlex.quote(str(script))}"
        extra = {"PYTEST_ADDOPTS": f"-v -rs -p no:cacheprovider --ignore={NOT_HERE}"
                 } if step.command == "make test" else None
        done = self.terminal.run(command, extra=extra)
        assert done.returncode == 0, (
            f"README {step.section}: `{step.command}` exited {done.returncode}\n"
            f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
        self.results[step.command] = done
        check = CHECKS.get(self.key(step))
        if check is not None:
            check(self, done)

    def key(self, step: Step) -> str:
        return "enqueue" if step.language == "python" else step.command.replace(PROJECT, "{p}")

    def substitute(self, command: str) -> None:
        if command.startswith("redis-server"):
            self.terminal.env["REDIS_URL"] = self.redis_url

    def stand_in_infra_venv(self) -> None:
        """infra/venv as `make infra-install` leaves it, from this checkout's worker-infra:
        a venv that sees the shared venv's packages (worker-infra, Pulumi, pydantic...)."""
        venv = self.project / "infra" / "venv"
        subprocess.run([os.path.realpath(sys.executable), "-m", "venv", "--without-pip",
                        str(venv)], check=True, timeout=120)
        (site,) = venv.glob("lib/python*/site-packages")
        (shared,) = [p for p in sys.path if p.startswith(sys.prefix) and p.endswith("site-packages")]
        # A sitedir, so that its own .pth files (the editable worker-infra) apply too.
        (site / "shared-venv.pth").write_text(f"import site; site.addsitedir({shared!r})\n")

    def start_foreground(self, command: str) -> None:
        second = command == SECOND_RUN
        log = self.project.parent / ("second.log" if second else "foreground.log")
        run = command
        if second:
            self.second_port = str(testing.free_port())
            run = command.replace(f"METRICS_PORT={SECOND_PORT}", f"METRICS_PORT={self.second_port}")
        process = self.terminal.start(run, log)
        self.foreground[command] = (process, log)
        started = wait_for(
            f"`{command}` to log its start",
            lambda: process.poll() is not None
            or any(line.get("event") == "start" for line in json_lines(log)),
        )
        assert process.poll() is None and started, f"`{command}` exited:\n{log.read_text()}"
        if second:  # both pools run side by side, each ready, each with its own state
            wait_for(f"`{command}` to be ready (/readyz)",
                     lambda: self.readyz(self.second_port) == 200)
            assert self.readyz() == 200, "the first pool lost its state to the second"
            # The first pool's metrics live in its state folder: a shared folder wiped them.
            gauge = re.compile(r"^worker_concurrency(\{.*\})? [1-9]", re.M)
            assert gauge.search(self.metrics(self.terminal.env["METRICS_PORT"]))
            assert gauge.search(self.metrics(self.second_port))
            return
        # Ready once its processes have booted (/readyz), and then `healthcheck ready` says so.
        wait_for(f"`{command}` to be ready (/readyz)", lambda: self.readyz() == 200)
        ready = self.terminal.run(f"WORKER_POOL={POOL} {PROJECT} healthcheck ready")
        assert ready.returncode == 0, ready.stderr

    def database_pool_says_what_to_do(self) -> None:
        """A pool that uses PostgreSQL, started here without one, stops at boot with the one
        line the README quotes (exit 78), and leaves the running pools alone."""
        done = self.terminal.run(f"make run POOL={DATABASE_POOL}", timeout=60)
        ours = [line for line in done.stderr.splitlines()  # stdout: make echoes the command
                if line.strip() and not line.startswith("make")]
        assert done.returncode != 0 and len(ours) == 1, done.stdout + done.stderr
        assert "Error 78" in done.stderr, done.stderr
        assert f"`{ours[0]}`" in self.baked["README.md"], ours[0]
        assert self.readyz() == 200 and self.readyz(self.second_port) == 200

    def refused_at_once(self) -> None:
        """A second copy of the running pool on its port (a state folder of its own): `make
        run` stops at once with the one line the README quotes (exit 78), not waiting for an
        edit; the running pools stay ready."""
        port = self.terminal.env["METRICS_PORT"]
        other = self.project.parent / "state-of-a-copy"
        done = self.terminal.run(f"make run POOL={POOL} WORKER_STATE_ROOT={other}", timeout=60)
        ours = [line for line in done.stderr.splitlines()
                if line.strip() and not line.startswith("make")]
        assert "Error 78" in done.stderr and len(ours) == 1, done.stdout + done.stderr
        assert f"`{ours[0].replace(port, '9191')}`" in self.baked["README.md"], ours[0]
        assert self.readyz() == 200 and self.readyz(self.second_port) == 200

    def reloads_on_save(self) -> None:
        """A save of an actor's module: both running pools (`make run` watches src/) drain,
        stop and start again, and are ready again."""
        logs = [log for _, log in self.foreground.values()]
        starts = [self.events(log, "start") for log in logs]
        module = next(path for path in (self.project / "src").rglob("actors/*.py")
                      if f"def {ACTOR}(" in path.read_text())
        module.write_text(module.read_text() + "\n# saved\n")
        for log, before in zip(logs, starts, strict=True):
            wait_for(f"{log.name}: the reload", lambda log=log, before=before:
                     self.events(log, "start") > before, 90)
            assert any(line.get("msg") == "source changed: reloading" for line in json_lines(log))
        wait_for("both pools ready again",
                 lambda: self.readyz() == 200 and self.readyz(self.second_port) == 200)

    @staticmethod
    def events(log: Path, event: str) -> int:
        return sum(1 for line in json_lines(log) if line.get("event") == event)

    def metrics(self, port: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())

    def readyz(self, port: str | None = None) -> int:
        url = f"http://127.0.0.1:{port or self.terminal.env['METRICS_PORT']}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return int(response.status)
        except (OSError, urllib.error.HTTPError):
            return 0

    def ctrl_c(self, command: str = f"make run POOL={POOL}") -> list[dict[str, Any]]:
        """Ctrl-C in the foreground command's terminal: SIGINT to its process group."""
        process, log = self.foreground[command]
        stops = self.events(log, "stop")  # one per reload so far
        os.killpg(process.pid, signal.SIGINT)
        try:
            wait_for("the worker to stop after Ctrl-C",
                     lambda: self.events(log, "stop") > stops, 90)
        except AssertionError as timeout:
            raise AssertionError(f"{timeout}; still running:\n{still_running(process.pid)}") from None
        process.wait(timeout=30)
        with pytest.raises(ProcessLookupError):  # nothing of the pool is left running
            os.killpg(process.pid, 0)
        return json_lines(log)

    def stop_all(self) -> None:
        for process, _ in self.foreground.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


# ---- what each command must have done ---------------------------------------------------------


def check_install(book: Runbook, done: subprocess.CompletedProcess[str]) -> None:
    venv = book.project / ".venv"
    assert (venv / "bin" / "python").exists() and (venv / "bin" / PROJECT).exists()
    package = PROJECT.replace("-", "_")
    # An editable install: the package imports from anywhere with the venv's python.
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            f"import {package}; print({package}.__file__)"],
                           cwd="/", env=fresh_environment(), capture_output=True, text=True,
                           timeout=60, check=False)
    assert where.returncode == 0 and where.stdout.startswith(str(book.project / "src")), where


def check_activate(book: Runbook, done: subprocess.CompletedProcess[str]) -> None:
    assert book.terminal.env.get("VIRTUAL_ENV") == str(book.project / ".venv")
    which = book.terminal.run(f"command -v {PROJECT}")
    assert which.stdout.strip() == str(book.project / ".venv" / "bin" / PROJECT)


def check_config(book: Runbook, done: subprocess.CompletedProcess[str]) -> None:
    """`config` prints the effective values, each with its source: the pool's defaults
    resolved, secrets masked."""
    rows = [re.fullmatch(r"(\S+)\s+(.*?)\s+(environment|pool \S+|default)", line)
            for line in done.stdout.splitlines()]
    assert all(rows), done.stdout
    shown = {row[1]: json.loads(row[2]) for row in rows if row}
    sources = {row[1]: row[3] for row in rows if row}
    assert sources["WORKER_POOL"] == sources["REDIS_URL"] == "environment"
    assert sources["WORKER_CONCURRENCY"] == f"pool {POOL}"
    assert sources["LOG_FORMAT"] == "default"
    pool = book.pool()
    assert shown["WORKER_POOL"] == POOL
    assert shown["WORKER_QUEUES"] == pool["queues"]
    assert shown["WORKER_CONCURRENCY"] == pool["concurrency"]
    assert shown["WORKER_PROCESSES"] == pool["processes"]
    assert shown["WORKER_JOB_TIMEOUT_MS"] == pool["job_timeout_ms"]
    assert shown["WORKER_SHUTDOWN_TIMEOUT_MS"] == pool["shutdown_timeout_ms"]
    assert shown["WORKER_PREFETCH"] == pool.get("prefetch", pool["concurrency"])
    assert shown["REDIS_URL"] == book.redis_url
    assert all(value is not None for key, value in shown.items() if key.startswith("WORKER_"))
    if book.database:  # no PostgreSQL here, and the quick start's pool needs none
        assert shown["DATABASE_URL"] is None and sources["DATABASE_URL"] == "default"


def check_test(book: Runbook, done: subprocess.CompletedProcess[str]) -> None:
    passed = set(re.findall(r"^(tests/[^:\s]+)::.* PASSED", done.stdout, re.M))
    files = {str(path.relative_to(book.project)) for path in book.project.glob("tests/test_*.py")}
    # No PostgreSQL here: the database's tests skip, and say in one line how to run them.
    needs_database = {DATABASE_TESTS} if book.database else set()
    assert passed == files - {NOT_HERE} - needs_database, f"without a passing test: {files - passed}"
    if book.database:
        assert DATABASE_TESTS not in passed
        (reason,) = set(re.findall(rf"^SKIPPED \[\d+\] {DATABASE_TESTS}:\d+: (.*)$", done.stdout,
                                   re.M))
        assert reason.startswith("DATABASE_URL is not set") and "make test" in reason, reason


def check_lint(book: Runbook, done: subprocess.CompletedProcess[str]) -> None:
    assert "All checks passed!" in done.stdout and "Success: no issues found" in done.stdout


def check_manifests(stack: str) -> Callable[[Runbook, subprocess.CompletedProcess[str]], None]:
    def check(book: Runbook, done: subprocess.CompletedProcess[str]) -> None:
        rendered = book.project / "build" / "manifests" / f"{stack}.yaml"
        objects = [o for o in yaml.safe_load_all(rendered.read_text()) if o]
        pools = tomllib.loads((book.project / "pools.toml").read_text())["pools"]
        deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
        assert len(deployments) == len(pools) + 1, deployments  # one per pool + the scheduler
        assert f"wrote {rendered}" in done.stdout
    return check


def check_simulate(book: Runbook, done: subprocess.CompletedProcess[str]) -> None:
    for stack in ("dev", "staging", "prod"):
        assert f"## stack {stack}" in done.stdout
    assert f"| {POOL} | 10x step |" in done.stdout and "goal missed" not in done.stdout


def unchanged(path: str) -> Callable[[Runbook, subprocess.CompletedProcess[str]], None]:
    def check(book: Runbook, done: subprocess.CompletedProcess[str]) -> None:
        assert (book.project / path).read_text() == book.baked[path], (
            f"{path}: a fresh bake's generated file is not what the command writes"
        )
    return check


def check_enqueue(book: Runbook, done: subprocess.CompletedProcess[str]) -> None:
    """The jobs sent so far are processed by the running pool, each once (the quick start's
    send, then the uncertain-send example's send with its own message id: the check runs
    after each snippet); the delayed payment waits in Redis."""
    ended = wait_for(
        f"the running worker to log {ACTOR} done",
        lambda: [line for line in json_lines(book.worker_log())
                 if line.get("event") == "job_end" and line.get("actor") == ACTOR],
    )
    assert {line["outcome"] for line in ended} == {"success"}, ended
    assert len({line["job_id"] for line in ended}) == len(ended), f"a job ran twice: {ended}"
    delayed = redis.Redis.from_url(book.redis_url).hvals("dramatiq:payments.DQ.msgs")
    assert [b"pay-1" in body for body in delayed] == [True], "the delayed capture_payment"


def check_help(book: Runbook, done: subprocess.CompletedProcess[str]) -> None:
    """A bare `make` lists the targets and installs nothing."""
    assert "install" in done.stdout and "manifests" in done.stdout, done.stdout
    assert not (book.project / ".venv").exists()


def check_pre_commit(book: Runbook, done: subprocess.CompletedProcess[str]) -> None:
    """pre-commit comes with the dev extra (make install) and installs its git hook."""
    assert (book.project / ".venv" / "bin" / "pre-commit").exists()
    assert (book.project / ".git" / "hooks" / "pre-commit").exists(), done.stdout


CHECKS: dict[str, Callable[[Runbook, subprocess.CompletedProcess[str]], None]] = {
    "make": check_help,
    "pre-commit install": check_pre_commit,
    "make install": check_install,
    ". .venv/bin/activate": check_activate,
    f"WORKER_POOL={POOL} {{p}} config": check_config,
    "make test": check_test,
    "make lint": check_lint,
    "make manifests STACK=dev": check_manifests("dev"),
    "make manifests STACK=prod": check_manifests("prod"),
    "make simulate": check_simulate,
    "make alerts": unchanged("ops/alerts.yaml"),
    "make docs": unchanged("README.md"),
    "enqueue": check_enqueue,
}


# ---- the tests --------------------------------------------------------------------------------


OPTIONS = [{"database": "postgres", "sandbox_pool": "yes"},
           {"database": "none", "sandbox_pool": "no"}]


@pytest.fixture
def runbook(request: pytest.FixtureRequest, tmp_path: Path,
            redis_url: str) -> Iterator[Runbook]:
    options: dict[str, str] = request.param
    project = bake_project(tmp_path, project=PROJECT, **options)
    # A team's bake lives in a git repository (Backstage publishes one): `pre-commit install`.
    subprocess.run(["git", "init", "-q"], cwd=project, check=True, timeout=60)
    baked = {path: (project / path).read_text() for path in ("README.md", "ops/alerts.yaml")}
    env = {**fresh_environment(), "METRICS_PORT": str(testing.free_port()),
           # No PostgreSQL reachable: DATABASE_URL unset, and libpq's default host a folder
           # where none listens (this machine's own answers on /var/run/postgresql).
           "PGHOST": str(tmp_path / "no-postgresql"),
           # the Makefile's root of the pools' state folders (/tmp/<project> by default)
           "WORKER_STATE_ROOT": str(tmp_path / "state")}
    book = Runbook(project, options["database"] == "postgres", redis_url,
                   Terminal(project, env), baked)
    try:
        yield book
    finally:
        book.stop_all()


@pytest.mark.slow
@pytest.mark.parametrize("runbook", OPTIONS, ids=lambda o: "-".join(o.values()),
                         indirect=True)
def test_a_fresh_bake_follows_its_readme(runbook: Runbook) -> None:
    steps = readme_steps(runbook.baked["README.md"])
    assert stale_entries(steps) == []
    if not runbook.database:
        assert "DATABASE_URL" not in runbook.baked["README.md"]
    try:
        for step in steps:
            runbook.step(step)
        if runbook.database:
            runbook.database_pool_says_what_to_do()
        runbook.refused_at_once()
        runbook.reloads_on_save()
        second = runbook.ctrl_c(SECOND_RUN)
        lines = runbook.ctrl_c()
    except AssertionError:
        print("\n\n".join(runbook.terminal.log[-6:]))
        raise
    # Each pool stopped twice, cleanly: for the reload, then for Ctrl-C.
    stopped = [line for line in lines if line.get("event") == "stop"]
    assert [line["exit_code"] for line in stopped] == [0, 0], stopped
    stopped = [line for line in second if line.get("event") == "stop"]
    assert [(line["pool"], line["exit_code"]) for line in stopped] == [(SECOND, 0)] * 2, stopped
    assert any(line.get("msg") == "drained" for line in lines), lines[-5:]
    print("\n".join(f"{seconds:6.1f} s  {command}" for command, seconds in runbook.terminal.timings))
    run = {step.command for step in steps} - set(SKIPPED)
    assert set(runbook.results) | set(FOREGROUND) | set(SUBSTITUTED) >= run


def test_the_runbook_notices_a_renamed_command(tmp_path: Path) -> None:
    """A README mutated twice: a renamed command is run (and fails), and the entry of a
    handled command that was renamed is reported stale (so it cannot be dropped silently)."""
    project = bake_project(tmp_path, project=PROJECT)
    readme = (project / "README.md").read_text()
    assert stale_entries(readme_steps(readme)) == []

    renamed = readme.replace("docker compose up --build", "docker compose up --build --wait")
    assert stale_entries(readme_steps(renamed)) == ["docker compose up --build"]

    broken = readme.replace("\nmake lint ", "\nmake lints ")
    (step,) = [s for s in readme_steps(broken) if s.command == "make lints"]
    book = Runbook(project, True, "redis://127.0.0.1:1/0", Terminal(project, fresh_environment()),
                   {})
    with pytest.raises(AssertionError, match=r"`make lints` exited 2"):
        book.step(step)
