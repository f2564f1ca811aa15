"""ops/alerts.yaml and ops/dashboard.json: valid, parsed by a real PromQL parser, and naming
only metrics this service exports (the names of DESIGN section 2.3)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import worker_runtime
import yaml
from worker_runtime import contract
from worker_runtime.pools import load_pools
from worker_runtime.settings import DATABASE_RESOURCE

promql = pytest.importorskip("promql_parser", reason="dev dependency promql-parser")

ROOT = Path(__file__).resolve().parents[1]
#: The code that exports the metrics: the runtime's.
SOURCE = Path(worker_runtime.__file__).resolve().parent
ALERTS = ROOT / "ops" / "alerts.yaml"
DASHBOARD = ROOT / "ops" / "dashboard.json"
#: The database option: pools.toml declares the PostgreSQL downstream.
DATABASE_ENABLED = DATABASE_RESOURCE in load_pools(ROOT / "pools.toml").downstream

CONTRACT = {
    "jobs_processed_total",
    "job_duration_seconds",
    "worker_inflight_jobs",
    "worker_concurrency",
    "db_pool_in_use",
    "db_pool_size",
    "queue_depth",
    "queue_oldest_message_seconds",
    "queue_dead_letters",
    # unserved work (DESIGN 7: status --check), exported beside the backlog
    "queue_consumers",
    "queue_unserved",
    # schedules (DESIGN 2.7), exported by the scheduler
    "schedule_runs_total",
    "schedule_last_success_timestamp_seconds",
    "schedule_due_timestamp_seconds",
    "scheduler_leader",
    # broker faults (DESIGN 6)
    "broker_resets_total",
    "jobs_lost_total",
    "broker_full",
    # flow control (DESIGN 7, issue #42)
    "queue_paused",
    "downstream_in_use",
    "downstream_limit",
    "jobs_throttled_total",
    # how long a due job waited for admission on a queue under flow control (issue #42 item 5)
    "job_admission_wait_seconds",
    # unique jobs' sends turned away (issue #42 item 3), counted in Redis by every producer
    "jobs_deduplicated_total",
    # handlers that would not stop at their time limit (#39 item 5)
    "jobs_time_limit_exceeded_total",
    # worker processes the kernel's OOM killer ended, read from the container's cgroup (#43)
    "worker_oom_kills_total",
}
DATABASE_ONLY = {"db_pool_in_use", "db_pool_size"}
#: Read by the OOM-kill alert from kube-state-metrics, not exported by this service.
KUBE_STATE_METRICS = {
    "kube_pod_container_status_last_terminated_reason",
    "kube_pod_container_status_restarts_total",
}
#: Prometheus's own series of each target (whether a pool has a worker up).
PROMETHEUS = {"up"}
#: A metric's definition: its kind, then its name as a literal or a name of worker_runtime.contract.
_DEFINITION = re.compile(
    r"\b(Counter|Gauge|Histogram|GaugeMetricFamily|CounterMetricFamily)\(\s*"
    r"(?:\"([a-z_:]+)\"|contract\.([A-Z_]+))"
)


def defined_metrics() -> dict[str, str]:
    """Every metric the source defines, as exposed (Counter ``x`` is ``x_total``) -> kind."""
    found = {}
    for path in SOURCE.rglob("*.py"):
        for kind, literal, constant in _DEFINITION.findall(path.read_text()):
            name = literal or str(getattr(contract, constant))
            if kind.startswith("Counter") and not name.endswith("_total"):
                name += "_total"
            found[name] = kind
    return found


def exported_series() -> set[str]:
    """Series names a query may use: a histogram's are its _bucket, _sum and _count."""
    names = set()
    for name, kind in defined_metrics().items():
        if not DATABASE_ENABLED and name in DATABASE_ONLY:
            continue
        if kind == "Histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


def selectors(expr: str) -> list[Any]:
    found: list[Any] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql.VectorSelector):
            found.append(node)

    promql.walk(promql.parse(expr), visit)
    return found


def assert_only_known_metrics(expr: str, external: frozenset[str] = frozenset()) -> set[str]:
    names = set()
    for selector in selectors(expr):
        assert selector.name, f"selector without a metric name in {expr!r}"
        assert selector.name in exported_series() | external, (
            f"{selector.name!r} is not exported: {expr!r}"
        )
        names.add(selector.name)
    return names


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(ALERTS.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def test_the_source_defines_exactly_the_contract_metrics() -> None:
    assert set(defined_metrics()) == CONTRACT


def test_alert_rules_parse_and_name_only_exported_metrics() -> None:
    loaded = yaml.safe_load(ALERTS.read_text())
    assert [group["name"] for group in loaded["groups"]]
    used: set[str] = set()
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"[A-Z][A-Za-z]+", rule["alert"])
        assert rule["labels"]["severity"] in {"page", "ticket"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        if "for" in rule:
            promql.parse_duration(rule["for"])
        external = frozenset(KUBE_STATE_METRICS | PROMETHEUS)
        used |= assert_only_known_metrics(rule["expr"], external)
    expected = {*KUBE_STATE_METRICS, *PROMETHEUS} | {
        "queue_oldest_message_seconds",
        "queue_dead_letters",
        "queue_depth",
        "queue_unserved",
        "worker_inflight_jobs",
        "worker_concurrency",
        "jobs_processed_total",
        "schedule_last_success_timestamp_seconds",
        "schedule_due_timestamp_seconds",
        "scheduler_leader",
    }
    if DATABASE_ENABLED:
        expected |= DATABASE_ONLY
    assert expected <= used


def test_the_alerts_cover_the_issue() -> None:
    names = {rule["alert"] for rule in rules()}
    assert {
        "WorkerBacklogAgeOverSLO",
        "WorkerDeadLettersGrowing",
        "WorkerFetchBottleneck",
        "WorkerNoProgress",
        "ScheduleLate",
        "SchedulerNoLeader",
        "WorkerOOMKilled",
        "WorkerPoolHasNoWorker",
        "WorkerBacklogUnobserved",
        "WorkerDelayedMessagesOverdue",
        "WorkerQueueUnserved",
    } <= names
    assert ("WorkerDbPoolSaturated" in names) == DATABASE_ENABLED


def test_each_queue_has_an_age_alert_at_its_pools_backlog_age_target() -> None:
    """Change pools.toml, and this test asks for `make alerts`."""
    age_rules = {
        rule["labels"]["queue"]: rule
        for rule in rules()
        if rule["alert"] == "WorkerBacklogAgeOverSLO"
    }
    pools = load_pools(ROOT / "pools.toml").pools
    assert set(age_rules) == {queue for pool in pools.values() for queue in pool.queues}, (
        "ops/alerts.yaml and pools.toml disagree: run `make alerts`"
    )
    for name, pool in pools.items():
        for queue in pool.queues:
            target = pool.backlog_age_target_s
            rule = age_rules[queue]
            assert rule["expr"].endswith(f"> {target}"), f"queue {queue}: run `make alerts`"
            assert f'worker_template_pool="{name.replace("_", "-")}"' in rule["expr"]
            assert f'queue="{queue}"' in rule["expr"]
            assert rule["labels"]["pool"] == name.replace("_", "-")
            assert rule["labels"]["slo_seconds"] == str(target)


def test_alerts_are_what_pools_toml_derives() -> None:
    """ops/alerts.yaml is exactly worker_infra's rules for pools.toml (`make alerts-check`,
    which also runs their promtool cases)."""
    pytest.importorskip("worker_infra", reason="pip install -r infra/requirements.txt")
    # The promtool cases run in `make alerts-check` (CI's manifests job installs promtool).
    done = subprocess.run(
        [sys.executable, str(ROOT / "infra" / "alerts.py"), "--check", "--no-promtool"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _grafana_to_promql(expr: str) -> str:
    return expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")


def test_dashboard_loads_and_names_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    used: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used |= assert_only_known_metrics(_grafana_to_promql(target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"])
        assert match, variable["definition"]
        used |= assert_only_known_metrics(match.group(1))
    assert exported_series() - {"job_duration_seconds_sum", "job_duration_seconds_count"} <= used
