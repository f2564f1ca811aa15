"""policy.admits/reachable: NetworkPolicy semantics as Kubernetes defines them, on small
hand-made policies (the rendered ones are judged in tests/test_infra_baked.py)."""

from __future__ import annotations

from typing import Any

from worker_infra.policy import Endpoint, admits, reachable, selects

SANDBOX = Endpoint("sb", {"kubernetes.io/metadata.name": "sb"}, {"pool": "sandbox"})
WORKER = Endpoint(
    "svc",
    {"kubernetes.io/metadata.name": "svc"},
    {"pool": "bulk"},
    "10.0.0.7",
    {"metrics": ("TCP", 9191)},
)


def policy(namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "NetworkPolicy",
        "metadata": {"namespace": namespace, "name": "p"},
        "spec": spec,
    }


DENY = policy("sb", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})


def egress(namespace: str, rule: dict[str, Any]) -> dict[str, Any]:
    return policy(namespace, {"podSelector": {}, "policyTypes": ["Egress"], "egress": [rule]})


def test_a_pod_no_policy_selects_is_not_isolated() -> None:
    assert reachable([], SANDBOX, WORKER, 9191)
    other = policy("sb", {"podSelector": {"matchLabels": {"pool": "x"}}, "policyTypes": ["Egress"]})
    assert reachable([other], SANDBOX, WORKER, 9191)


def test_default_deny_denies_until_a_rule_admits() -> None:
    assert not reachable([DENY], SANDBOX, WORKER, 9191)
    to_svc = {
        "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "svc"}}}],
        "ports": [{"port": 6379, "protocol": "TCP"}],
    }
    assert not reachable([DENY, egress("sb", to_svc)], SANDBOX, WORKER, 9191)
    assert reachable([DENY, egress("sb", to_svc)], SANDBOX, WORKER, 6379)
    assert not reachable([DENY, egress("sb", to_svc)], SANDBOX, WORKER, 6379, "UDP")
    ranged = {**to_svc, "ports": [{"port": 9000, "endPort": 9300}]}
    assert reachable([DENY, egress("sb", ranged)], SANDBOX, WORKER, 9191)
    named = {**to_svc, "ports": [{"port": "metrics"}]}
    assert reachable([DENY, egress("sb", named)], SANDBOX, WORKER, 9191)
    assert not reachable([DENY, egress("sb", named)], SANDBOX, WORKER, 9292)
    assert reachable([DENY, egress("sb", {})], SANDBOX, WORKER, 9292)  # an empty rule: all


def test_peers() -> None:
    pods_only = {"to": [{"podSelector": {"matchLabels": {"pool": "bulk"}}}]}
    assert not admits([DENY, egress("sb", pods_only)], "Egress", SANDBOX, WORKER, 9191)
    both = {"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"pool": "bulk"}}}]}
    assert admits([DENY, egress("sb", both)], "Egress", SANDBOX, WORKER, 9191)
    block = {"to": [{"ipBlock": {"cidr": "10.0.0.0/24", "except": ["10.0.0.0/29"]}}]}
    assert not admits([DENY, egress("sb", block)], "Egress", SANDBOX, WORKER, 9191)
    wider = {"to": [{"ipBlock": {"cidr": "10.0.0.0/16"}}]}
    assert admits([DENY, egress("sb", wider)], "Egress", SANDBOX, WORKER, 9191)


def test_the_target_side_ingress_counts_too() -> None:
    closed = policy("svc", {"podSelector": {}, "policyTypes": ["Ingress"]})
    assert not reachable([closed], SANDBOX, WORKER, 9191)
    opened = policy(
        "svc",
        {
            "podSelector": {},
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": "sb"}
                            }
                        }
                    ]
                }
            ],
        },
    )
    assert reachable([closed, opened], SANDBOX, WORKER, 9191)


def test_selectors() -> None:
    labels = {"a": "1", "b": "2"}
    assert selects({}, labels) and selects(None, labels)
    assert selects({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, labels)
    assert not selects(
        {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, labels
    )
    assert not selects({"matchExpressions": [{"key": "c", "operator": "Exists"}]}, labels)
    assert selects({"matchExpressions": [{"key": "c", "operator": "DoesNotExist"}]}, labels)
    assert not selects({"matchLabels": {"a": "2"}}, labels)
