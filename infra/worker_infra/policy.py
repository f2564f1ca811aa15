"""Checks over rendered objects: strict schema validation and the platform's policies.

Used by the tests and usable in CI over ``build/manifests/<stack>.yaml``. Validation needs
the dev dependencies ``kubernetes-validate`` and ``cloudcoil.models.keda`` (imported lazily).
Every ``*_problems`` function returns a list of human-readable problems, empty when fine.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker_runtime import contract

K8S_VERSION = "1.30"
#: Custom resources and where their schemas come from (module, version).
CRD_MODELS = {
    "ScaledObject": ("cloudcoil.models.keda", "v1alpha1"),
    "TriggerAuthentication": ("cloudcoil.models.keda", "v1alpha1"),
    "PodMonitor": ("cloudcoil.models.prometheus_operator", "v1"),
    "PrometheusRule": ("cloudcoil.models.prometheus_operator", "v1"),
}
KEDA_KINDS = ("ScaledObject", "TriggerAuthentication")
Obj = Mapping[str, Any]


def _forbid_unknown(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists properties."""
    if isinstance(schema, dict):
        out = {k: _forbid_unknown(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_forbid_unknown(v) for v in schema]
    return schema


@functools.cache
def crd_validator(kind: str) -> Any:
    """A jsonschema validator of custom resource ``kind`` that rejects unknown fields."""
    import importlib

    import jsonschema

    module, version = CRD_MODELS[kind]
    model = getattr(importlib.import_module(f"{module}.{version}"), kind)
    schema = _forbid_unknown(model.model_json_schema(by_alias=True))
    return jsonschema.Draft202012Validator(schema)


keda_validator = crd_validator


def prometheus_rule_validator() -> Any:
    """A jsonschema validator of the Prometheus Operator's PrometheusRule (no unknown fields)."""
    return crd_validator("PrometheusRule")


def validate_strict(obj: Obj) -> None:
    """Raise if ``obj`` is not a valid object of its kind, unknown fields included."""
    if obj["kind"] in CRD_MODELS:
        validator = crd_validator(obj["kind"])
        errors = sorted(validator.iter_errors(dict(obj)), key=lambda e: list(e.path))
        if errors:
            raise ValueError(
                f"{obj['kind']} {obj['metadata'].get('name')}: "
                + "; ".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
            )
        return
    import kubernetes_validate

    kubernetes_validate.validate(dict(obj), K8S_VERSION, strict=True)


def workers(objects: Iterable[Obj]) -> list[Obj]:
    """The pools' Deployments (component ``worker``; the scheduler's is not a pool)."""
    return [
        d
        for d in of_kind(objects, "Deployment")
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "worker"
    ]


def pod_env(deployment: Obj) -> dict[str, Any]:
    """The worker container's environment: name -> value (or its ``valueFrom``)."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def pod_pools_file(objects: Iterable[Obj], deployment: Obj) -> dict[str, Any]:
    """The pools file a Deployment's pods read: its ConfigMap volume's ``pools.toml``, parsed."""
    import tomllib

    from .poolsfile import POOLS_KEY

    namespace = deployment["metadata"]["namespace"]
    pod = deployment["spec"]["template"]["spec"]
    names = [v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v]
    for obj in of_kind(objects, "ConfigMap"):
        meta = obj["metadata"]
        if meta.get("namespace") == namespace and meta["name"] in names:
            return tomllib.loads(obj["data"][POOLS_KEY])
    raise LookupError(f"{deployment['metadata']['name']}: no pools file ConfigMap")


def pod_pool(objects: Iterable[Obj], deployment: Obj) -> dict[str, Any]:
    """The pools-file entry a Deployment's pods run (``WORKER_POOL`` in the mounted file)."""
    pools: dict[str, Any] = pod_pools_file(objects, deployment)["pools"]
    return dict(pools[pod_env(deployment)["WORKER_POOL"]])


def of_kind(objects: Iterable[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def restricted_problems(deployment: Obj) -> list[str]:
    """Where a Deployment's pods break Pod Security "restricted" (plus a read-only root)."""
    name = deployment["metadata"]["name"]
    pod = deployment["spec"]["template"]["spec"]
    problems = []
    psc = pod.get("securityContext", {})
    if psc.get("runAsNonRoot") is not True:
        problems.append(f"{name}: pod runAsNonRoot is not true")
    if psc.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
        problems.append(f"{name}: pod seccompProfile is not RuntimeDefault")
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            problems.append(f"{name}: {flag}")
    if pod.get("automountServiceAccountToken") is not False:
        problems.append(f"{name}: service account token is mounted")
    for volume in pod.get("volumes", []):
        if set(volume) - {"name"} - {"emptyDir", "secret", "configMap", "projected"}:
            problems.append(f"{name}: volume {volume['name']} is not an allowed type")
    mounts_tmp = False
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        sc = c.get("securityContext", {})
        where = f"{name}/{c['name']}"
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            problems.append(f"{where}: privileged")
        if sc.get("capabilities", {}).get("drop") != ["ALL"]:
            problems.append(f"{where}: capabilities not dropped (ALL)")
        if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{where}: adds capabilities")
        if sc.get("runAsUser") == 0 or psc.get("runAsUser") == 0:
            problems.append(f"{where}: runs as root")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}: root filesystem is writable")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            problems.append(f"{where}: hostPort")
        mounts_tmp |= any(m["mountPath"] == "/tmp" for m in c.get("volumeMounts", []))
        if "memory" not in c.get("resources", {}).get("limits", {}):
            problems.append(f"{where}: no memory limit")
    if not mounts_tmp:
        problems.append(f"{name}: no writable /tmp")
    return problems


def cpu_trigger_problems(objects: Iterable[Obj]) -> list[str]:
    """ScaledObjects with a cpu (or memory) trigger, or no backlog trigger."""
    problems = []
    for so in of_kind(objects, "ScaledObject"):
        types = [t["type"] for t in so["spec"]["triggers"]]
        bad = [t for t in types if t in ("cpu", "memory")]
        if bad:
            problems.append(f"{so['metadata']['name']}: {', '.join(bad)} trigger")
        if not {"redis", "prometheus"} <= set(types):
            problems.append(f"{so['metadata']['name']}: triggers {types} lack redis + prometheus")
    return problems


def isolation_problems(objects: Sequence[Obj]) -> list[str]:
    """Per pool exactly one Deployment and one ScaledObject; no queue served by two pools.
    The scheduler's Deployment is no pool: it has no scaler and serves no queue."""
    problems = []
    deployments = [
        d
        for d in of_kind(objects, "Deployment")
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") != "scheduler"
    ]
    scaled = of_kind(objects, "ScaledObject")
    targets = [(s["metadata"]["namespace"], s["spec"]["scaleTargetRef"]["name"]) for s in scaled]
    owner: dict[str, str] = {}
    for d in deployments:
        key = (d["metadata"]["namespace"], d["metadata"]["name"])
        if targets.count(key) != 1:
            problems.append(f"{key[1]}: {targets.count(key)} ScaledObjects")
        for queue in pod_pool(objects, d)["queues"]:
            if queue in owner:
                problems.append(f"queue {queue} served by {owner[queue]} and {key[1]}")
            owner[queue] = key[1]
    if len(targets) != len(deployments) or len(set(targets)) != len(targets):
        problems.append(f"{len(deployments)} Deployments but ScaledObject targets {targets}")
    return problems


def sandbox_problems(
    objects: Sequence[Obj],
    namespace: str,
    broker_port: int = 6379,
    metrics_port: int = contract.METRICS_PORT,
    monitoring_namespace: str = "monitoring",
    ip_blocks: Sequence[str] = (),
) -> list[str]:
    """The sandbox namespace: enforced "restricted", default-deny, egress only DNS + broker
    (selected pods, or exactly the address blocks ``ip_blocks``: a NodeLocal DNSCache, a
    broker outside the cluster), ingress only the monitoring namespace to the metrics port,
    quota and limits (a CPU limit on every container), no Secret but the broker's, and no
    secret in the pods' environment (references or plain values)."""
    from .guards import secret_like
    from .secrets import BROKER_SECRET_SUFFIX

    problems = []
    ns = [o for o in of_kind(objects, "Namespace") if o["metadata"]["name"] == namespace]
    if (
        not ns
        or ns[0]["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") != "restricted"
    ):
        problems.append(f"namespace {namespace} does not enforce restricted")
    inside = [o for o in objects if o["metadata"].get("namespace") == namespace]
    policies = of_kind(inside, "NetworkPolicy")
    deny = [
        p
        for p in policies
        if p["spec"].get("podSelector") == {}
        and set(p["spec"].get("policyTypes", [])) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
    ]
    if len(deny) != 1:
        problems.append(f"{namespace}: {len(deny)} default-deny policies")
    ingress = [r for p in policies for r in p["spec"].get("ingress", [])]
    scrape = {
        "from": [
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": monitoring_namespace}
                }
            }
        ],
        "ports": [{"port": metrics_port, "protocol": "TCP"}],
    }
    if ingress not in ([], [scrape]):
        problems.append(f"{namespace}: ingress rules {ingress} admit more than the scrape")
    rules = [r for p in policies for r in p["spec"].get("egress", [])]
    ports = sorted(
        (port.get("protocol", "TCP"), port["port"]) for r in rules for port in r.get("ports", [])
    )
    if len(rules) != 2 or ports != sorted([("UDP", 53), ("TCP", 53), ("TCP", broker_port)]):
        problems.append(f"{namespace}: egress rules {rules} are not exactly DNS + broker")
    for r in rules:
        for peer in r.get("to", []):
            if "ipBlock" in peer:
                if peer != {"ipBlock": {"cidr": peer["ipBlock"].get("cidr")}} or (
                    peer["ipBlock"].get("cidr") not in ip_blocks
                ):
                    problems.append(f"{namespace}: egress peer {peer} is not an allowed block")
            elif "podSelector" not in peer or "namespaceSelector" not in peer:
                problems.append(f"{namespace}: egress peer {peer} is not a selected pod set")
    if not of_kind(inside, "ResourceQuota") or not of_kind(inside, "LimitRange"):
        problems.append(f"{namespace}: no ResourceQuota or LimitRange")
    secrets = [s["metadata"]["name"] for s in of_kind(inside, "Secret")]
    if len(secrets) != 1 or not secrets[0].endswith(BROKER_SECRET_SUFFIX):
        problems.append(f"{namespace}: secrets {secrets}")
    for d in of_kind(inside, "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            if "cpu" not in c.get("resources", {}).get("limits", {}):
                problems.append(f"{namespace}: container {c['name']} has no CPU limit")
        env = d["spec"]["template"]["spec"]["containers"][0]["env"]
        refs = {e["name"] for e in env if "valueFrom" in e}
        if refs != {"REDIS_URL"}:
            problems.append(f"{namespace}: pod gets secrets {sorted(refs)}")
        for e in env:
            if "value" in e and (
                e["name"] in ("DATABASE_URL", "DB_POOL_SIZE") or secret_like(e["name"], e["value"])
            ):
                problems.append(f"{namespace}: pod gets {e['name']} in plain text")
    return problems


# NetworkPolicy semantics, evaluated over rendered objects (no CNI needed): which connections
# the policies admit, as Kubernetes defines it (networking.k8s.io/v1).


@dataclass(frozen=True)
class Endpoint:
    """A pod as NetworkPolicies see it: its namespace and that namespace's labels (the API
    server sets ``kubernetes.io/metadata.name``), its labels, its address (for ``ipBlock``
    peers; None: matched by no block) and its named ports (name -> (protocol, port))."""

    namespace: str
    namespace_labels: Mapping[str, str]
    labels: Mapping[str, str]
    ip: str | None = None
    named_ports: Mapping[str, tuple[str, int]] = field(default_factory=dict)


def endpoint(objects: Iterable[Obj], deployment: Obj, ip: str | None = None) -> Endpoint:
    """The pods of rendered ``deployment`` as an :class:`Endpoint` (its namespace's labels
    from the rendered Namespace when there is one)."""
    namespace = deployment["metadata"]["namespace"]
    labels = {"kubernetes.io/metadata.name": namespace}
    for ns in of_kind(objects, "Namespace"):
        if ns["metadata"]["name"] == namespace:
            labels.update(ns["metadata"].get("labels") or {})
    pod = deployment["spec"]["template"]
    named = {
        port["name"]: (port.get("protocol", "TCP"), port["containerPort"])
        for container in pod["spec"]["containers"]
        for port in container.get("ports", [])
        if port.get("name")
    }
    return Endpoint(namespace, labels, pod["metadata"].get("labels") or {}, ip, named)


def selects(selector: Obj | None, labels: Mapping[str, str]) -> bool:
    """Whether label ``selector`` (``matchLabels`` and ``matchExpressions``) selects
    ``labels``; an empty selector selects everything."""
    if selector is None:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        present = key in labels
        if (
            (operator == "In" and not (present and labels[key] in values))
            or (operator == "NotIn" and present and labels[key] in values)
            or (operator == "Exists" and not present)
            or (operator == "DoesNotExist" and present)
        ):
            return False
    return True


def _peer_matches(peer: Obj, policy_namespace: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if other.ip is None:
            return False
        address = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(cidr) for cidr in block.get("except") or []
        )
    if "namespaceSelector" in peer:
        namespace_ok = selects(peer["namespaceSelector"], other.namespace_labels)
    else:  # a podSelector alone: pods of the policy's own namespace
        namespace_ok = other.namespace == policy_namespace
    return namespace_ok and selects(peer.get("podSelector"), other.labels)


def _port_matches(rule_port: Obj, port: int, protocol: str, target: Endpoint) -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    wanted = rule_port.get("port")
    if wanted is None:
        return True
    if isinstance(wanted, str):  # a named port of the destination pod
        return target.named_ports.get(wanted) == (protocol, port)
    return bool(wanted <= port <= rule_port.get("endPort", wanted))


def admits(
    policies: Iterable[Obj],
    direction: str,
    pod: Endpoint,
    other: Endpoint,
    port: int,
    protocol: str = "TCP",
) -> bool:
    """Whether ``policies`` admit ``pod``'s side of a connection with ``other`` on ``port``:
    ``direction`` ``Egress`` (``pod`` connects to ``other``, whose port it is) or ``Ingress``
    (``other`` connects to ``pod``'s port). A pod no policy of its namespace selects for
    that direction is not isolated (all admitted); an isolated one is admitted only what one
    rule of a selecting policy admits (peers: ``to``/``from``, absent: any; ports absent:
    any)."""
    key = "to" if direction == "Egress" else "from"
    target = other if direction == "Egress" else pod
    selecting = [
        p
        for p in policies
        if p["metadata"].get("namespace") == pod.namespace
        and selects(p["spec"].get("podSelector"), pod.labels)
        and direction
        in p["spec"].get("policyTypes", ["Ingress", *(["Egress"] if "egress" in p["spec"] else [])])
    ]
    if not selecting:
        return True
    return any(
        (
            not rule.get(key)
            or any(_peer_matches(peer, p["metadata"]["namespace"], other) for peer in rule[key])
        )
        and (
            not rule.get("ports")
            or any(_port_matches(rp, port, protocol, target) for rp in rule["ports"])
        )
        for p in selecting
        for rule in p["spec"].get(direction.lower()) or []
    )


def reachable(
    policies: Iterable[Obj], source: Endpoint, target: Endpoint, port: int, protocol: str = "TCP"
) -> bool:
    """Whether ``source`` may open a connection to ``target``'s ``port``: its own namespace's
    policies admit the egress and ``target``'s admit the ingress."""
    policies = list(policies)
    return admits(policies, "Egress", source, target, port, protocol) and admits(
        policies, "Ingress", target, source, port, protocol
    )
