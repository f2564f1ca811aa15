"""Alerts, scaling signals and the dashboard against a real Prometheus (Debian's
``prometheus``, started here on a free loopback port with its own data dir), scraping real
worker processes of two pools and the scheduler, labelled as the PodMonitor labels them.

The scrape config mimics what the Prometheus Operator generates for the rendered
PodMonitor: ``job="<namespace>/<podmonitor>"``, ``namespace``, ``pod``, ``container``,
``endpoint`` and each ``podTargetLabels`` label, relabelled from the pod's metadata. Every
rendered ScaledObject query and every alert expression of the bake's ops/alerts.yaml is
evaluated against the live series and checked against what Redis holds: the interactive
pool busy with a backlog, the bulk pool at zero pods with ready and overdue delayed
messages, then every scheduler gone. Every dashboard panel's query returns data.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from _lifecycle import ServiceProcess, Worker, get, wait_for
from bakery import copy_project, free_port, make_manifests, project_env
from dramatiq.message import Message
from worker_infra.monitoring import POOL_SERIES_LABEL, pod_monitor_name
from worker_infra.policy import of_kind
from worker_infra.pool import POOL_LABEL

pytestmark = pytest.mark.slow
PROMETHEUS = shutil.which("prometheus")
SCRAPE_S = 1
STACK = "dev"

ACTORS = '''
"""Actors of the Prometheus test (written into a copy of the bake)."""

import os
import time

import dramatiq
import redis

_redis = redis.Redis.from_url(os.environ["REDIS_URL"])


@dramatiq.actor(queue_name="notifications", max_retries=0)
def p_quick(n):
    pass


@dramatiq.actor(queue_name="notifications", max_retries=0)
def p_hold(n):
    while not _redis.exists("p_hold:release"):
        time.sleep(0.05)


@dramatiq.actor(queue_name="notifications", max_retries=0)
def p_fail(n):
    raise RuntimeError("fails: a dead letter")


@dramatiq.actor(queue_name="reports", max_retries=0)
def p_report(n):
    pass
'''


def sanitized(label: str) -> str:
    """A Kubernetes label as a Prometheus label name (what the Operator does)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def scrape_config(
    namespace: str, project: str, targets: list[dict[str, Any]]
) -> dict[str, Any]:
    """The scrape job the Operator renders for the PodMonitor ``<project>-workers`` in
    ``namespace`` (its relabelling), with static targets carrying the pods' metadata."""
    relabel: list[dict[str, Any]] = [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {
            "source_labels": ["__meta_kubernetes_pod_container_name"],
            "target_label": "container",
        },
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]
    for label in [POOL_LABEL]:  # the PodMonitor's podTargetLabels
        name = sanitized(label)
        relabel.append(
            {
                "source_labels": [f"__meta_kubernetes_pod_label_{name}"],
                "regex": "(.+)",
                "target_label": name,
                "replacement": "${1}",
            }
        )
    relabel += [
        {
            "target_label": "job",
            "replacement": f"{namespace}/{pod_monitor_name(project)}",
        },
        {"target_label": "endpoint", "replacement": "metrics"},
    ]
    return {
        "job_name": f"podMonitor/{namespace}/{pod_monitor_name(project)}/0",
        "scrape_interval": f"{SCRAPE_S}s",
        "static_configs": targets,
        "relabel_configs": relabel,
    }


def target(
    port: int, namespace: str, pod: str, container: str, pool: str | None
) -> dict[str, Any]:
    labels = {
        "__meta_kubernetes_namespace": namespace,
        "__meta_kubernetes_pod_name": pod,
        "__meta_kubernetes_pod_container_name": container,
    }
    if pool is not None:
        labels[f"__meta_kubernetes_pod_label_{sanitized(POOL_LABEL)}"] = pool
    return {"targets": [f"127.0.0.1:{port}"], "labels": labels}


class Prometheus:
    """A prometheus server on a free loopback port with its own data dir."""

    def __init__(self, directory: Path, config: dict[str, Any]) -> None:
        assert PROMETHEUS is not None
        self.port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = directory / "prometheus.log"
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={directory / 'prometheus.yml'}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(self.ready, 60, "prometheus ready")

    def ready(self) -> bool:
        assert self.process.poll() is None, self.log_path.read_text()[-3000:]
        try:
            return get(f"http://127.0.0.1:{self.port}/-/ready")[0] == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        status, body = get(f"http://127.0.0.1:{self.port}/api/v1/{path}?{query}")
        reply = json.loads(body)
        assert status == 200 and reply["status"] == "success", (path, params, body)
        return reply["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def enqueue(
    client: redis.Redis,
    actor: str,
    queue: str,
    sent_s: float,
    eta_s: float | None = None,
) -> None:
    """Enqueue as Dramatiq's RedisBroker does, sent at ``sent_s`` (a delayed message, due at
    ``eta_s``, into ``<queue>.DQ``)."""
    redis_id = str(uuid.uuid4())
    options: dict[str, Any] = {"redis_message_id": redis_id}
    name = queue
    if eta_s is not None:
        options["eta"] = int(eta_s * 1000)
        name = f"{queue}.DQ"
    message: Message[Any] = Message(
        queue_name=name,
        actor_name=actor,
        args=(1,),
        kwargs={},
        options=options,
        message_timestamp=int(sent_s * 1000),
    )
    client.hset(f"dramatiq:{name}.msgs", redis_id, message.encode())
    client.rpush(f"dramatiq:{name}", redis_id)


def due_age_s(client: redis.Redis, queue: str, now_s: float) -> float:
    """How long the head of ``dramatiq:<queue>`` has waited since due, from Redis."""
    head = client.lindex(f"dramatiq:{queue}", 0)
    if head is None:
        return 0.0
    body = json.loads(client.hget(f"dramatiq:{queue}.msgs", head) or b"{}")
    due_ms = max(body["message_timestamp"], body["options"].get("eta", 0))
    return max(0.0, now_s - due_ms / 1000)


def rules_of(project: Path) -> list[dict[str, Any]]:
    loaded = yaml.safe_load((project / "ops" / "alerts.yaml").read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def pools_of(result: list[dict[str, Any]]) -> set[str]:
    return {r["metric"].get(POOL_SERIES_LABEL, "") for r in result}


@pytest.fixture(scope="module")
def prom_project(
    bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return copy_project(
        bake(database="none", sandbox_pool="no"),
        tmp_path_factory.mktemp("prometheus") / "orders-worker",
        prom_test=ACTORS,
    )


@pytest.fixture
def stack(
    prom_project: Path, redis_url: str, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    """Interactive and bulk workers, the scheduler, and a Prometheus scraping them."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus)")
    done = make_manifests(prom_project, STACK)
    assert done.returncode == 0, done.stderr
    objects = list(
        yaml.safe_load_all(
            (prom_project / "build" / "manifests" / f"{STACK}.yaml").read_text()
        )
    )
    scaled = of_kind(objects, "ScaledObject")
    namespace = scaled[0]["metadata"]["namespace"]
    long_jobs = {
        "WORKER_JOB_TIMEOUT_MS": "120000",
        "WORKER_SHUTDOWN_TIMEOUT_MS": "130000",
    }
    interactive = Worker(
        prom_project,
        redis_url,
        tmp_path / "interactive",
        WORKER_POOL="interactive",
        WORKER_CONCURRENCY="2",
        **long_jobs,
    )
    bulk = Worker(
        prom_project,
        redis_url,
        tmp_path / "bulk",
        WORKER_POOL="bulk",
        WORKER_CONCURRENCY="2",
        **long_jobs,
    )
    scheduler = ServiceProcess(
        prom_project,
        "scheduler",
        tmp_path / "scheduler",
        project_env(
            prom_project,
            REDIS_URL=redis_url,
            METRICS_PORT=str(free_port()),
            WORKER_STATE_DIR=str(tmp_path / "scheduler" / "state"),
        ),
    )
    processes = [interactive, bulk, scheduler]
    prometheus: Prometheus | None = None
    # nightly_report first seen three days ago and never successful: its due tick exists
    # (the schedule series and the dashboard's due-tick panel have data) and it is late.
    # The key is the baked layout's schedule_state_key.
    three_days_ago = int(time.time()) - 3 * 86400
    redis.Redis.from_url(redis_url).hset(
        "dramatiq:schedules:nightly_report",
        mapping={"since": three_days_ago, "tick": three_days_ago},
    )
    try:
        for process in processes:
            process.start()
        project = prom_project.name
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_S}s",
                "evaluation_interval": f"{SCRAPE_S}s",
            },
            "rule_files": [str(prom_project / "ops" / "alerts.yaml")],
            "scrape_configs": [
                scrape_config(
                    namespace,
                    project,
                    [
                        target(
                            interactive.port,
                            namespace,
                            f"{project}-interactive-5d8f7c9b4-aaaaa",
                            "worker",
                            "interactive",
                        ),
                        target(
                            bulk.port,
                            namespace,
                            f"{project}-bulk-6c9b5d8f7-bbbbb",
                            "worker",
                            "bulk",
                        ),
                        target(
                            scheduler.port,
                            namespace,
                            f"{project}-scheduler-7c9b5d8f4-ccccc",
                            "scheduler",
                            None,
                        ),
                    ],
                )
            ],
        }
        prometheus = Prometheus(tmp_path / "prometheus", config)
        yield {
            "prometheus": prometheus,
            "interactive": interactive,
            "bulk": bulk,
            "scheduler": scheduler,
            "scaled": scaled,
            "namespace": namespace,
            "client": redis.Redis.from_url(redis_url),
        }
    finally:
        redis.Redis.from_url(redis_url).set("p_hold:release", 1)
        if prometheus is not None:
            prometheus.stop()
        for process in processes:
            process.kill()


def trigger_queries(scaled: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(pool, trigger name) -> query of every prometheus trigger of the rendered objects."""
    found = {}
    for obj in scaled:
        pool = obj["metadata"]["labels"][POOL_LABEL]
        for trigger in obj["spec"]["triggers"]:
            if trigger["type"] == "prometheus":
                found[pool, trigger["name"]] = trigger["metadata"]["query"]
    return found


def test_alerts_scaling_queries_and_dashboard_against_a_real_prometheus(
    stack: dict[str, Any], prom_project: Path
) -> None:
    prom: Prometheus = stack["prometheus"]
    client: redis.Redis = stack["client"]
    interactive: Worker = stack["interactive"]
    bulk: Worker = stack["bulk"]
    up = 'up{job=~".+"}'
    wait_for(
        lambda: len([r for r in prom.query(up) if r["value"][1] == "1"]) == 3,
        60,
        "every target scraped",
    )

    # Jobs end in both pools (counters and durations), in two waves: Prometheus sees a
    # counter increase only between two of its samples (the first wave creates the series).
    # The second wave has a job that fails into the dead letters. Then bulk goes to zero pods.
    for wave in (1, 2):
        now = time.time()
        for _ in range(3):
            enqueue(client, "p_quick", "notifications", now)
            enqueue(client, "p_report", "reports", now)
        if wave == 2:
            enqueue(client, "p_fail", "notifications", now)
        for pool, ended in (("interactive", 3 * wave + wave // 2), ("bulk", 3 * wave)):
            counted = f'sum(jobs_processed_total{{worker_template_pool="{pool}"}})'
            wait_for(
                lambda c=counted, e=ended: prom.value(c) == e,
                30,
                f"wave {wave} of {pool}'s jobs counted",
            )
    assert client.zcard("dramatiq:notifications.XQ") == 1
    assert bulk.stop(timeout=60) == 0
    # Interactive: 2 jobs held, 4 waiting since a minute; bulk: 3 waiting for 200 s and a
    # delayed message due 400 s ago, nothing serving them.
    now = time.time()
    for _ in range(6):
        enqueue(client, "p_hold", "notifications", now - 60)
    for _ in range(3):
        enqueue(client, "p_report", "reports", now - 200)
    enqueue(client, "p_report", "reports", now - 500, eta_s=now - 400)
    wait_for(
        lambda: client.llen("dramatiq:notifications") == 4, 30, "2 held, 4 waiting"
    )
    wait_for(
        lambda: (
            prom.value('sum(worker_inflight_jobs{worker_template_pool="interactive"})')
            == 2
        ),
        30,
        "2 in flight seen",
    )

    # Every rendered ScaledObject query, against Redis.
    queries = trigger_queries(stack["scaled"])
    assert {pool for pool, _ in queries} == {
        "interactive",
        "bulk",
        "external",
        "critical",
    }
    queues = {
        "interactive": "notifications",
        "bulk": "reports",
        "external": "partner",
        "critical": "payments",
    }
    inflight = {"interactive": 2, "bulk": 0, "external": 0, "critical": 0}
    for (pool, name), expr in queries.items():
        queue = queues[pool]
        if name == "load":
            expected = client.llen(f"dramatiq:{queue}") + inflight[pool]
            wait_for(
                lambda e=expr, x=expected: prom.value(e) == x,
                30,
                f"{pool} load {expr} == {expected}",
            )
        else:
            assert name == "age"
            before = time.time()
            seen = prom.value(expr)
            after = time.time()
            assert seen is not None, f"{pool} age: no data ({expr})"
            ready = due_age_s(client, queue, before)
            overdue = due_age_s(client, f"{queue}.DQ", before)
            truth = max(ready, overdue)
            # The series is at most one scrape (plus the query's own time) older than now.
            margin = SCRAPE_S + (after - before) + 1.0
            assert truth - margin <= seen <= truth + margin, (pool, expr, seen, truth)
    assert (
        prom.value(queries["bulk", "age"]) >= 399
    )  # the overdue delayed message, at zero

    # Every alert expression, against what runs and what Redis holds.
    depth_bulk = client.llen("dramatiq:reports")

    def expected_pools(rule: dict[str, Any], scheduler_up: bool) -> set[str]:
        alert, labels = rule["alert"], rule["labels"]
        pool, queue = labels.get("pool"), labels.get("queue")
        firing = {
            ("WorkerBacklogAgeOverSLO", "interactive"): queue == "notifications",
            ("WorkerBacklogAgeOverSLO", "bulk"): queue == "reports",
            ("WorkerDelayedMessagesOverdue", "bulk"): True,
            ("WorkerPoolHasNoWorker", "bulk"): True,
            # reports waits with no live process serving it (bulk at zero pods, #41).
            ("WorkerQueueUnserved", "bulk"): queue == "reports",
            # Redis holds a new dead letter of notifications (0 before the test's failure).
            ("WorkerDeadLettersGrowing", "interactive"): True,
        }
        if not scheduler_up:
            firing[("WorkerBacklogUnobserved", "bulk")] = True
            firing[("WorkerBacklogUnobserved", "external")] = True
            firing[("WorkerBacklogUnobserved", "critical")] = True
            firing[("WorkerDelayedMessagesOverdue", "bulk")] = False
            firing[("WorkerPoolHasNoWorker", "bulk")] = False
            firing[("WorkerQueueUnserved", "bulk")] = False
            firing[("WorkerBacklogAgeOverSLO", "bulk")] = False
        if alert == "SchedulerNoLeader":
            return set() if scheduler_up else {""}
        if alert == "ScheduleLate":
            return {""} if scheduler_up else set()
        return {pool} if pool is not None and firing.get((alert, pool)) else set()

    rules = rules_of(prom_project)
    assert len(rules) > 30

    def check_rules(scheduler_up: bool) -> None:
        for rule in rules:
            expected = expected_pools(rule, scheduler_up)
            key = (
                rule["alert"],
                rule["labels"].get("pool"),
                rule["labels"].get("queue"),
            )
            wait_for(
                lambda r=rule, e=expected: pools_of(prom.query(r["expr"])) == e,
                30,
                f"{key}: {rule['expr']} returns pools {expected}",
            )
            if rule["alert"] == "WorkerPoolHasNoWorker" and expected:
                assert prom.value(rule["expr"]) == depth_bulk

    check_rules(scheduler_up=True)
    # Prometheus evaluated every loaded rule without an error.
    groups = prom.api("rules")["groups"]
    loaded = [r for g in groups for r in g["rules"]]
    assert len(loaded) == len(rules)
    wait_for(
        lambda: all(
            r["health"] == "ok" for g in prom.api("rules")["groups"] for r in g["rules"]
        ),
        30,
        "every rule evaluated without an error",
    )

    # Every dashboard panel's query, and every variable's, returns data.
    check_dashboard(prom, prom_project)

    # Every scheduler gone: no leader, and the pools without a pod are no longer seen.
    scheduler: ServiceProcess = stack["scheduler"]
    assert scheduler.stop(timeout=30) == 0
    check_rules(scheduler_up=False)
    assert interactive.process is not None and interactive.process.poll() is None


#: The panel queries with no data here: jobs_throttled_total counts fetches a downstream
#: budget held back, job_admission_wait_seconds times the fetches of a queue under flow
#: control, and neither running pool of this stack (interactive, bulk without the database)
#: uses a downstream or a keyed rate; tests/test_flow_control.py and tests/test_lanes.py
#: prove both with real workers.
WITHOUT_A_GATED_POOL = ("jobs_throttled_total", "job_admission_wait_seconds")


def check_dashboard(prom: Prometheus, project: Path) -> None:
    dashboard = json.loads((project / "ops" / "dashboard.json").read_text())
    values = {"$job": ".+", "$pool": ".+", "$queue": ".+", "$__rate_interval": "1m"}

    def concrete(expr: str) -> str:
        for name, value in values.items():
            expr = expr.replace(name, value)
        return expr

    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"])
            assert match, variable["definition"]
            result = prom.query(concrete(match.group(1)))
            assert any(match.group(2) in r["metric"] for r in result), variable[
                "definition"
            ]
    for panel in dashboard["panels"]:
        for item in panel["targets"]:
            expr = concrete(item["expr"])
            if any(name in expr for name in WITHOUT_A_GATED_POOL):
                continue  # no pool of this stack that runs uses a downstream budget
            wait_for(
                lambda e=expr: prom.query(e) != [],
                30,
                f"panel {panel['title']!r}: {expr} returns data",
            )
