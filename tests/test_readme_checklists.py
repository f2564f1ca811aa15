"""The baked README's checklists ("Add an actor / a queue / a pool / a schedule"), followed
on a fresh bake as a team adds an imports workload: each step's promise holds (the refusal
before it is done, the test that asks for the next step, what the commands then render).

Runs the bake from its src/ in this venv (as the other template tests do); the README's own
commands in order, in a venv of their own, are tests/test_readme_runbook.py's."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from bakery import (
    PYTHON,
    bake_project,
    package_of,
    project_env,
    run_cli,
)
from worker_runtime import testing
from test_generated_files import check_compose_spec

PROJECT = "checklist-worker"
ACTOR_MODULE = '''\
"""Imports: files a customer uploads, read in the background."""

from __future__ import annotations

import dramatiq

from ..lifecycle import checkpoint


@dramatiq.actor(queue_name="imports")
def import_file(file_id: str) -> None:
    """Import ``file_id`` (idempotent: importing a file twice changes nothing)."""
    checkpoint()
'''
POOL = '''
[pools.imports]                  # customer uploads: minutes at most, no database
queues = ["imports"]
processes = 1
concurrency = 2
job_timeout_ms = 60000
shutdown_timeout_ms = 70000
memory = "384Mi"
cpu = "100m"
handler_memory = "16Mi"
min_replicas = 1
max_replicas = 2
backlog_age_target_s = 60
uses = []
'''
SERVICE = '''
  worker-imports:
    <<: *worker
    environment: {<<: *env, WORKER_POOL: imports}
    stop_grace_period: 85s
'''
SCHEDULE = '''
[schedules.hourly_import]
actor = "import_file"
cron = "0 * * * *"
timezone = "UTC"
missed = "skip"
args = ["f-hourly"]
'''


def checklist(readme: str, heading: str) -> str:
    section = readme.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    assert section.count("- [ ]") >= 3, f"{heading}: not a checklist"
    return section


def make(project: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-s", *args, f"PYTHON={PYTHON}"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def baked_tests(project: Path, *files: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "no:cloudcoil", *files], cwd=project, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def insert_before(path: Path, marker: str, text: str) -> None:
    content = path.read_text()
    assert marker in content
    path.write_text(content.replace(marker, text + marker, 1))


def rendered(project: Path, stack: str) -> list[dict[str, Any]]:
    text = (project / "build" / "manifests" / f"{stack}.yaml").read_text()
    return [o for o in yaml.safe_load_all(text) if o]


def backlog_alerts(project: Path) -> dict[str, str]:
    """queue -> slo_seconds of the backlog-age alerts in ops/alerts.yaml."""
    groups = yaml.safe_load((project / "ops" / "alerts.yaml").read_text())["groups"]
    return {rule["labels"]["queue"]: rule["labels"]["slo_seconds"]
            for group in groups for rule in group["rules"]
            if rule.get("alert") == "WorkerBacklogAgeOverSLO"}


def trigger_lists(objects: list[dict[str, Any]], pool: str) -> set[str]:
    (scaler,) = [o for o in objects if o["kind"] == "ScaledObject"
                 and o["metadata"]["name"] == f"{PROJECT}-{pool}"]
    return {t["metadata"]["listName"] for t in scaler["spec"]["triggers"] if t["type"] == "redis"}


@pytest.mark.slow
def test_the_add_checklists_work_on_a_fresh_bake(tmp_path: Path, redis_url: str) -> None:
    project = bake_project(tmp_path, project=PROJECT, database="none", sandbox_pool="no")
    readme = (project / "README.md").read_text()
    package = project / "src" / package_of(project)
    env = project_env(project, REDIS_URL=redis_url, WORKER_STATE_DIR=str(tmp_path / "state"),
                      METRICS_PORT=str(testing.free_port()))

    # Add an actor: a module under actors/, on a queue no pool serves yet: refused, exit 78.
    assert "refuses to boot, exit 78" in checklist(readme, "Add an actor")
    (package / "actors" / "imports.py").write_text(ACTOR_MODULE)
    refused = run_cli(project, "worker", env={**env, "WORKER_POOL": "external"}, timeout=60)
    assert refused.returncode == 78, refused.stderr
    plain = [line for line in refused.stderr.splitlines() if not line.startswith("{")]
    refusal = "config error: actor 'import_file' uses queue 'imports', which no pool in pools.toml serves"
    assert plain == [refusal], refused.stderr

    # Add a pool: pools.toml; tests/test_compose.py then asks for its compose service, and
    # the alert test for `make alerts`.
    add_pool = checklist(readme, "Add a pool")
    assert "`tests/test_compose.py` says so until you do" in add_pool
    (project / "pools.toml").write_text((project / "pools.toml").read_text() + POOL)
    failing = baked_tests(project, "tests/test_compose.py", "tests/test_ops_files.py", env=env)
    assert failing.returncode == 1
    assert "add or remove the pool's worker-<pool> service" in failing.stdout
    assert "run `make alerts`" in failing.stdout
    insert_before(project / "compose.yaml", "\n  # Fires the [schedules.*]", SERVICE)

    # Add a queue: to exactly one pool; `make alerts`; nothing else.
    add_queue = checklist(readme, "Add a queue")
    assert "`make alerts`" in add_queue and "Nothing else" in add_queue
    pools = project / "pools.toml"
    pools.write_text(pools.read_text().replace('queues = ["reports"]',
                                               'queues = ["reports", "exports"]', 1))
    assert "`make alerts` and `make manifests STACK=dev`" in add_pool
    for target in ("alerts", "manifests"):
        done = make(project, target, "STACK=dev", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    assert backlog_alerts(project)["imports"] == "60"
    assert backlog_alerts(project)["exports"] == "120"  # the bulk pool's target
    objects = rendered(project, "dev")
    # Ready lists only (a due delayed message wakes a pool through the age query, #30).
    assert trigger_lists(objects, "imports") == {"dramatiq:imports", "dramatiq:imports.high",
                                                 "dramatiq:imports.low"}
    assert "dramatiq:exports" in trigger_lists(objects, "bulk")
    assert not any(name.endswith(".DQ") for name in trigger_lists(objects, "bulk"))
    assert check_compose_spec(project / "compose.yaml").returncode == 0
    # (the pool model's and settings' own tests are the runtime's: runtime/tests)
    passing = baked_tests(project, "tests/test_compose.py", "tests/test_ops_files.py",
                          "tests/test_actors.py", env=env)
    assert passing.returncode == 0, passing.stdout[-3000:]

    # ... and per environment: a stack overrides its numbers.
    assert "`pools: {<name>: {...}}`" in add_pool
    prod = project / "infra" / "Pulumi.prod.yaml"
    prod.write_text(prod.read_text().replace(
        "    critical:\n", "    imports:\n      max_replicas: 3\n    critical:\n", 1))
    done = make(project, "manifests", "STACK=prod", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    (scaler,) = [o for o in rendered(project, "prod") if o["kind"] == "ScaledObject"
                 and o["metadata"]["name"] == f"{PROJECT}-imports"]
    assert scaler["spec"]["maxReplicaCount"] == 3

    # A queue served by two pools is refused (one line, exit 78).
    twice = pools.read_text().replace('queues = ["imports"]', 'queues = ["imports", "exports"]')
    (tmp_path / "twice.toml").write_text(twice)
    refused = run_cli(project, "config", env={**env, "WORKER_POOL": "imports",
                                              "WORKER_POOLS_FILE": str(tmp_path / "twice.toml")})
    assert refused.returncode == 78 and "exports" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr

    # The new pool runs the new actor: nothing else was needed.
    run_the_pool(project, env, tmp_path / "worker.log", redis_url)

    # Add a schedule: listed with its next fire times; a missing `missed` refused, named.
    assert "`missed` is required" in checklist(readme, "Add a schedule")
    pools.write_text(pools.read_text() + SCHEDULE)
    listed = run_cli(project, "schedules", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    (entry,) = [s for s in json.loads(listed.stdout)["schedules"]
                if s["schedule"] == "hourly_import"]
    assert entry["actor"] == "import_file" and len(entry["next"]) == 3, entry
    pools.write_text(pools.read_text().replace('missed = "skip"\nargs = ["f-hourly"]',
                                               'args = ["f-hourly"]'))
    refused = run_cli(project, "schedules", env=env)
    assert refused.returncode == 78, refused.stderr
    assert re.search(r"hourly_import.*missed", refused.stderr), refused.stderr


def run_the_pool(project: Path, env: dict[str, str], log: Path, redis_url: str) -> None:
    """Boot the imports pool, enqueue import_file by name, see it done, stop it (SIGTERM)."""
    worker = subprocess.Popen([PYTHON, "-m", package_of(project), "worker"], cwd=project,
                              env={**env, "WORKER_POOL": "imports"}, stderr=log.open("w"),
                              start_new_session=True)
    try:
        enqueue = (f"from {package_of(project)}.producer import enqueue; "
                   "print(enqueue('import_file', 'f-1').message_id)")
        sent = subprocess.run([PYTHON, "-c", enqueue], cwd=project, env=env,
                              capture_output=True, text=True, timeout=60, check=True)
        job_id = sent.stdout.strip()
        deadline = time.monotonic() + 60
        ended: list[dict[str, Any]] = []
        while not ended and time.monotonic() < deadline and worker.poll() is None:
            lines = [json.loads(line) for line in log.read_text().splitlines()
                     if line.startswith("{")]
            ended = [line for line in lines
                     if line.get("job_id") == job_id and line.get("event") == "job_end"]
            time.sleep(0.05)
        assert ended and ended[0]["outcome"] == "success", log.read_text()[-3000:]
        assert redis.Redis.from_url(redis_url).llen("dramatiq:imports") == 0
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=90) == 0, log.read_text()[-3000:]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)
