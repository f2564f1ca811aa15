"""Alert rules derived from the pools: one backlog-age alert per queue at its pool's target,
an OOM-kill alert on kube-state-metrics, every expression parsed by a real PromQL parser,
rendered by WorkerService as a PrometheusRule valid against the Prometheus Operator's schema."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from worker_infra import ServiceSpec, WorkerService
from worker_infra.alerts import KUBE_STATE_METRICS, alert_groups
from worker_infra.policy import of_kind, validate_strict
from worker_infra.render import render

promql = pytest.importorskip("promql_parser")


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
    return alert_groups(
        service.project, service.pools, database=True, namespaces=[service.namespace]
    )


def test_one_age_alert_per_queue_at_its_pools_target(service: ServiceSpec) -> None:
    age = {
        r["labels"]["queue"]: r
        for r in rules_of(groups_for(service))
        if r["alert"] == "WorkerBacklogAgeOverSLO"
    }
    expected = {queue: pool for pool in service.pools for queue in pool.queues}
    assert set(age) == set(expected)
    for queue, pool in expected.items():
        assert age[queue]["expr"] == (
            f'max by (queue) (queue_oldest_message_seconds{{queue="{queue}"}}) '
            f"> {pool.backlog_age_target_s}"
        )
        assert age[queue]["labels"]["pool"] == pool.name


def test_a_new_queue_gets_its_alert_without_a_hand_edit(service: ServiceSpec) -> None:
    first = service.pools[0]
    grown = dataclasses.replace(first, queues=(*first.queues, "receipts"), backlog_age_target_s=7)
    pools = (grown, *service.pools[1:])
    rules = rules_of(alert_groups("p", pools, database=False, namespaces=["ns"]))
    (receipts,) = [r for r in rules if r["labels"].get("queue") == "receipts"]
    assert receipts["expr"].endswith("> 7") and receipts["labels"]["pool"] == first.name
    assert "WorkerDbPoolSaturated" not in {r["alert"] for r in rules}


def test_every_expression_parses_and_durations_are_valid(service: ServiceSpec) -> None:
    for rule in rules_of(groups_for(service)):
        promql.parse(rule["expr"])
        if "for" in rule:
            promql.parse_duration(rule["for"])
        assert rule["labels"]["severity"] in {"page", "ticket"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_oom_alert_reads_kube_state_metrics_for_the_worker_containers(
    service: ServiceSpec,
) -> None:
    (oom,) = [r for r in rules_of(groups_for(service)) if r["alert"] == "WorkerOOMKilled"]
    assert metric_names(oom["expr"]) == set(KUBE_STATE_METRICS)
    assert 'reason="OOMKilled"' in oom["expr"]
    assert 'container="worker"' in oom["expr"] and 'pod=~"orders-worker-.+"' in oom["expr"]
    assert "increase(kube_pod_container_status_restarts_total" in oom["expr"]


def test_the_service_renders_its_alerts_as_a_valid_prometheus_rule(service: ServiceSpec) -> None:
    objects = render(lambda: WorkerService("orders-worker", service), project="p", stack="s")
    (rule,) = of_kind(objects, "PrometheusRule")
    validate_strict(rule)
    assert rule["metadata"]["namespace"] == service.namespace
    sandbox = service.sandbox.namespace or f"{service.namespace}-sandbox"
    expected = alert_groups(
        service.project, service.pools, database=True, namespaces=[service.namespace, sandbox]
    )
    assert rule["spec"]["groups"] == expected
    broken = dict(rule, spec={"groups": [{"name": "x", "rules": [{"alert": "A", "exprr": 1}]}]})
    with pytest.raises(ValueError, match="PrometheusRule"):
        validate_strict(broken)


def test_the_prometheus_rule_can_be_turned_off(service: ServiceSpec) -> None:
    spec = dataclasses.replace(service, prometheus_rule=False)
    objects = render(lambda: WorkerService("orders-worker", spec), project="p", stack="s")
    assert of_kind(objects, "PrometheusRule") == []
