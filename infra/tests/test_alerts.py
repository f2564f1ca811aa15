"""Alert rules derived from the pools, proven with ``promtool test rules``: per pool, on
series labelled as the Prometheus Operator labels a PodMonitor's targets (job
``<namespace>/<project>-workers``, namespace, pod, the pool label); every expression parsed
by a real PromQL parser; rendered by WorkerService as a PrometheusRule valid against the
Operator's schema, with the stack's monitoring selector labels."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from worker_infra import GuardError, ScalingSpec, ServiceSpec, WorkerService
from worker_infra.alerts import KUBE_STATE_METRICS, alert_groups
from worker_infra.policy import of_kind, validate_strict
from worker_infra.render import render
from worker_infra.ruletests import humanize_duration, humanize_timestamp, rule_tests

promql = pytest.importorskip("promql_parser")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool (apt-get install prometheus)"
)


def rules_of(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for group in groups for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    found: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql.VectorSelector):
            found.add(node.name)

    promql.walk(promql.parse(expr), visit)
    return found


def groups_for(service: ServiceSpec) -> list[dict[str, Any]]:
    return alert_groups(service.project, service.pools, database=True, namespace=service.namespace)


def promtool_test(tmp_path: Path, groups: list[dict[str, Any]], tests: dict[str, Any]) -> str:
    """Run ``promtool test rules`` on ``tests`` against ``groups``; its output ("" on success)."""
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / "alerts.test.yaml").write_text(yaml.safe_dump(tests))
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "test", "rules", "alerts.test.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    return "" if done.returncode == 0 else done.stdout + done.stderr


def test_one_age_alert_per_queue_at_its_pools_target_scoped_to_pool_and_service(
    service: ServiceSpec,
) -> None:
    age = {
        r["labels"]["queue"]: r
        for r in rules_of(groups_for(service))
        if r["alert"] == "WorkerBacklogAgeOverSLO"
    }
    expected = {queue: pool for pool in service.pools for queue in pool.queues}
    assert set(age) == set(expected)
    for queue, pool in expected.items():
        scope = (
            f'namespace="{service.namespace}",job="{service.namespace}/orders-worker-workers",'
            f'worker_template_pool="{pool.slug}",queue="{queue}"'
        )
        assert age[queue]["expr"] == (
            "max by (namespace, worker_template_pool, queue) "
            f"(queue_oldest_message_seconds{{{scope}}}) > {pool.backlog_age_target_s}"
        )
        own = f"{service.namespace}-sandbox" if pool.sandbox else service.namespace
        assert age[queue]["labels"] | {"pool": pool.slug, "namespace": own} == age[queue]["labels"]
        assert age[queue]["labels"]["service"] == service.project


def test_a_new_queue_gets_its_alert_without_a_hand_edit(service: ServiceSpec) -> None:
    first = service.pools[0]
    grown = dataclasses.replace(first, queues=(*first.queues, "receipts"), backlog_age_target_s=7)
    pools = (grown, *service.pools[1:])
    rules = rules_of(alert_groups("p", pools, database=False, namespace="ns"))
    by_alert = {r["alert"]: r for r in rules if r["labels"].get("queue") == "receipts"}
    assert sorted(by_alert) == ["WorkerBacklogAgeOverSLO", "WorkerQueueUnserved"]
    receipts = by_alert["WorkerBacklogAgeOverSLO"]
    assert receipts["expr"].endswith("> 7") and receipts["labels"]["pool"] == first.name
    unserved = by_alert["WorkerQueueUnserved"]
    assert "queue_unserved{" in unserved["expr"] and 'queue="receipts"' in unserved["expr"]
    assert unserved["for"] and unserved["labels"]["pool"] == first.name
    assert "WorkerDbPoolSaturated" not in {r["alert"] for r in rules}


def test_every_expression_parses_and_every_rule_names_its_pool_and_service(
    service: ServiceSpec,
) -> None:
    for rule in rules_of(groups_for(service)):
        promql.parse(rule["expr"])
        if "for" in rule:
            promql.parse_duration(rule["for"])
        assert rule["labels"]["severity"] in {"page", "ticket"}
        assert rule["labels"]["service"] == service.project and rule["labels"]["namespace"]
        if not rule["alert"].startswith("Schedule"):
            assert rule["labels"]["pool"] in {p.slug for p in service.pools}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        # every selector of the service's own series is scoped to its namespace and job
        assert f'job="{service.namespace}' in rule["expr"] or "kube_pod" in rule["expr"]


def test_oom_alert_reads_kube_state_metrics_for_the_pools_worker_containers(
    service: ServiceSpec,
) -> None:
    ooms = [r for r in rules_of(groups_for(service)) if r["alert"] == "WorkerOOMKilled"]
    assert len(ooms) == len(service.pools)
    for oom, pool in zip(ooms, service.pools, strict=True):
        assert metric_names(oom["expr"]) == set(KUBE_STATE_METRICS)
        assert 'reason="OOMKilled"' in oom["expr"] and 'container="worker"' in oom["expr"]
        assert f'pod=~"orders-worker-{pool.slug}-[a-z0-9]{{1,10}}-[a-z0-9]{{5}}"' in oom["expr"]
        assert "increase(kube_pod_container_status_restarts_total" in oom["expr"]


def test_the_annotation_helpers_match_prometheus() -> None:
    """The values the promtool cases expect (checked against promtool by the cases)."""
    assert humanize_duration(605) == "10m 5s" and humanize_duration(600) == "10m 0s"
    assert humanize_duration(100_000) == "1d 3h 46m 40s" and humanize_duration(7) == "7s"
    assert humanize_timestamp(0) == "1970-01-01 00:00:00 +0000 UTC"


@needs_promtool
def test_promtool_cases_pass_on_the_rules_per_pool(service: ServiceSpec, tmp_path: Path) -> None:
    groups = groups_for(service)
    tests = rule_tests(
        service.project,
        service.pools,
        database=True,
        namespace=service.namespace,
        schedules=["nightly_report"],
    )
    names = {t["name"] for t in tests["tests"]}
    for pool in service.pools:
        assert {n for n in names if n.startswith(f"{pool.name}:")}, pool.name
    assert promtool_test(tmp_path, groups, tests) == ""


def _by_job(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rules aggregated per scrape job instead of per pool (one PodMonitor per
    namespace: every pool of the service shares the job)."""
    mutated = yaml.safe_load(yaml.safe_dump(groups))
    for rule in rules_of(mutated):
        expr = rule["expr"].replace("namespace, worker_template_pool", "job")
        expr = expr.replace("(worker_template_pool)", "(job)")
        rule["expr"] = re.sub(r',worker_template_pool="[^"]*"', "", expr)
    return mutated


@needs_promtool
def test_promtool_cases_catch_rules_aggregated_per_job(
    service: ServiceSpec, tmp_path: Path
) -> None:
    tests = rule_tests(service.project, service.pools, database=True, namespace=service.namespace)
    output = promtool_test(tmp_path, _by_job(groups_for(service)), tests)
    for alert in ("WorkerNoProgress", "WorkerFetchBottleneck", "WorkerBacklogAgeOverSLO"):
        assert f"alertname: {alert}" in output


def test_the_service_renders_its_alerts_as_a_valid_prometheus_rule(service: ServiceSpec) -> None:
    objects = render(lambda: WorkerService("orders-worker", service), project="p", stack="s")
    (rule,) = of_kind(objects, "PrometheusRule")
    validate_strict(rule)
    assert rule["metadata"]["namespace"] == service.namespace
    expected = alert_groups(
        service.project,
        service.pools,
        database=True,
        namespace=service.namespace,
        sandbox_namespace=service.sandbox.namespace,
    )
    assert rule["spec"]["groups"] == expected
    broken = dict(rule, spec={"groups": [{"name": "x", "rules": [{"alert": "A", "exprr": 1}]}]})
    with pytest.raises(ValueError, match="PrometheusRule"):
        validate_strict(broken)


def test_monitoring_labels_reach_the_pod_monitors_and_the_rule(service: ServiceSpec) -> None:
    labels = {"release": "kube-prometheus-stack", "team.example.com/owner": "payments"}
    spec = dataclasses.replace(service, scaling=ScalingSpec(monitoring_labels=labels))
    objects = render(lambda: WorkerService("orders-worker", spec), project="p", stack="s")
    selected = of_kind(objects, "PodMonitor") + of_kind(objects, "PrometheusRule")
    assert len(of_kind(objects, "PodMonitor")) == 2  # the service's namespace and the sandbox's
    for obj in selected:
        assert labels.items() <= obj["metadata"]["labels"].items(), obj["metadata"]["name"]


def test_bad_monitoring_labels_are_refused_in_one_line(service: ServiceSpec) -> None:
    bad = {"release": "kube prometheus", "-x": "1", "ok": "fine"}
    spec = dataclasses.replace(service, scaling=ScalingSpec(monitoring_labels=bad))
    with pytest.raises(GuardError) as refused:
        render(lambda: WorkerService("orders-worker", spec), project="p", stack="s")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("monitoringLabels:")
    assert "'release': 'kube prometheus'" in message and "'-x': '1'" in message
    assert "'ok'" not in message


def test_the_prometheus_rule_can_be_turned_off(service: ServiceSpec) -> None:
    spec = dataclasses.replace(service, prometheus_rule=False)
    objects = render(lambda: WorkerService("orders-worker", spec), project="p", stack="s")
    assert of_kind(objects, "PrometheusRule") == []
