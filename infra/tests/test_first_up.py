"""The first `pulumi up` on a real cluster (issue #24), through Pulumi's mocks: the pools
file as an immutable ConfigMap named by its content, bounded rollout waits, the preflight,
names that never force delete-before-replace, the sandbox's egress and CPU limit, image
pull policies and their checkov skips."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from templatepools import SERVICE_POOLS, pool_files, pools_file

from worker_infra import GuardError, ServiceSpec, WorkerService, preflight
from worker_infra.policy import of_kind, sandbox_problems, validate_strict
from worker_infra.poolsfile import checksum
from worker_infra.render import render
from worker_infra.rollout import POD_START_S, TIMEOUT_ANNOTATION, rollout_timeout_s
from worker_infra.workload import CHECKOV_SKIPS

Objects = list[dict[str, Any]]


def rendered(spec: ServiceSpec) -> Objects:
    return render(lambda: WorkerService("svc", spec), project="orders-worker", stack="test")


def deployment(objects: Objects, name: str) -> dict[str, Any]:
    (found,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == name]
    return found


def mounted_config_map(d: dict[str, Any]) -> str:
    (volume,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "pools"]
    name: str = volume["configMap"]["name"]
    return name


# ---- the pools file: immutable, named by its content ---------------------------------------


def spec_of(service: ServiceSpec, data: dict[str, Any]) -> ServiceSpec:
    """``service`` with the pools file ``data`` (validated by the model), as the infra
    program hands it over: the specs, the whole file and each pool's own file."""
    pools, resources, text = pools_file(data)
    return dataclasses.replace(
        service, pools=pools, downstream=resources, pools_file=text, pool_files=pool_files(data)
    )


def config_maps(objects: Objects) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (m["metadata"]["namespace"], m["metadata"]["name"]): m
        for m in of_kind(objects, "ConfigMap")
    }


def test_each_pool_mounts_an_immutable_config_map_of_its_own_file_named_by_its_content(
    service: ServiceSpec,
) -> None:
    """Every Deployment mounts ``<project>-<pool>-pools-<sha[:10]>`` holding exactly the
    file of its pool (``pool_files``), immutable; the same files give the same names again
    (a rollback restores the old ConfigMaps and pod templates exactly)."""
    objects = rendered(service)
    maps = config_maps(objects)
    pools = {p.name: p for p in service.pools}
    for d in of_kind(objects, "Deployment"):
        pool_name = next(
            e["value"]
            for e in d["spec"]["template"]["spec"]["containers"][0]["env"]
            if e["name"] == "WORKER_POOL"
        )
        text = service.pool_files[pool_name]
        name = mounted_config_map(d)
        assert name == f"orders-worker-{pools[pool_name].slug}-pools-{checksum(text)[:10]}"
        config_map = maps[d["metadata"]["namespace"], name]
        assert config_map["immutable"] is True
        assert config_map["data"]["pools.toml"] == text
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert annotations["worker-template/pools-sha256"] == checksum(text)
        validate_strict(config_map)
    assert len(maps) == len(service.pools)  # no scheduler here: no whole-file ConfigMap
    again = rendered(dataclasses.replace(service))
    assert config_maps(again).keys() == maps.keys()


def test_a_change_to_one_pool_rolls_that_pool_alone(service: ServiceSpec) -> None:
    """interactive's concurrency 8 -> 6: only interactive's file, ConfigMap and pod
    template change; every other Deployment (the sandbox's in its namespace too) keeps its
    pod template and its ConfigMap, so Kubernetes does not roll it. (With one ConfigMap of
    the whole file for all pools, every pool's template changed.)"""
    import copy

    data = copy.deepcopy(SERVICE_POOLS)
    data["pools"]["interactive"]["concurrency"] = 6
    changed = spec_of(service, data)
    before, after = rendered(spec_of(service, SERVICE_POOLS)), rendered(changed)
    templates = [
        {d["metadata"]["name"]: d["spec"]["template"] for d in of_kind(o, "Deployment")}
        for o in (before, after)
    ]
    rolled = sorted(name for name in templates[0] if templates[0][name] != templates[1][name])
    assert rolled == ["orders-worker-interactive"]
    gone = config_maps(before).keys() - config_maps(after).keys()
    new = config_maps(after).keys() - config_maps(before).keys()
    assert [name for _, name in gone] == [
        mounted_config_map(deployment(before, "orders-worker-interactive"))
    ]
    assert [name for _, name in new] == [
        mounted_config_map(deployment(after, "orders-worker-interactive"))
    ]
    # The old file is the one the old pods validated: concurrency 8 in full, other pools
    # by their queues.
    (old,) = [config_maps(before)[key] for key in gone]
    assert "concurrency = 8" in old["data"]["pools.toml"]


def test_a_pool_file_holds_its_pool_in_full_and_the_others_queues(service: ServiceSpec) -> None:
    """What a pod needs and nothing that changes with another pool: its own entry and the
    resources it uses in full; the other pools' queues (the worker refuses an actor whose
    queue no pool serves); no schedules. Each file passes the service's pool model."""
    import tomllib

    from worker_runtime import pools

    for name, text in service.pool_files.items():
        data = tomllib.loads(text)
        pools.PoolsFile.model_validate(data)
        own = next(p for p in service.pools if p.name == name)
        assert set(data["pools"]) == {p.name for p in service.pools}
        for other, entry in data["pools"].items():
            if other != name:
                assert set(entry) <= {"queues", "sandbox"}, (name, other, entry)
        assert data["pools"][name]["concurrency"] == own.concurrency
        assert set(data.get("downstream", {})) == set(own.uses)
        assert "schedules" not in data


def test_a_queue_change_changes_every_pool_file(service: ServiceSpec) -> None:
    """Queues are shared routing: a queue added to one pool reaches every pool's file (the
    other pools' workers then know who serves it)."""
    import copy

    data = copy.deepcopy(SERVICE_POOLS)
    data["pools"]["bulk"]["queues"] = ["reports", "exports"]
    changed = spec_of(service, data)
    assert all(
        changed.pool_files[p] != service.pool_files[p] and "exports" in changed.pool_files[p]
        for p in service.pool_files
    )


# ---- bounded waits, sized from each rollout -------------------------------------------------


def test_rollout_timeout_is_steps_of_start_and_min_ready_plus_the_last_grace() -> None:
    # The prod bulk pool at its cap: 8 replicas, one at a time, minReadySeconds 345 = grace.
    assert rollout_timeout_s(8, 0, 1, 345, 345) == 8 * (POD_START_S + 345) + 345 == 3585
    assert rollout_timeout_s(20, 0, 1, 55, 55, pod_start_s=60) == 20 * 115 + 55
    assert rollout_timeout_s(0, 0, 1, 0, 30) == POD_START_S + 30  # a pool at zero
    assert rollout_timeout_s(5, 1, 1, 0, 30) == 3 * POD_START_S + 30
    with pytest.raises(ValueError, match="surge \\+ unavailable at least 1"):
        rollout_timeout_s(3, 0, 0, 0, 30)


def test_every_deployment_carries_the_timeout_of_its_rollout(service: ServiceSpec) -> None:
    """Recomputed from the rendered objects: the ScaledObject's cap, the strategy, the
    minReadySeconds and the grace period. Pulumi's default (10 minutes) would fail
    `pulumi up` in the middle of bulk's rollout (5 x (60 + 345) + 345 s here)."""
    objects = rendered(service)
    caps = {
        s["spec"]["scaleTargetRef"]["name"]: s["spec"]["maxReplicaCount"]
        for s in of_kind(objects, "ScaledObject")
    }
    seen = {}
    for d in of_kind(objects, "Deployment"):
        name, spec = d["metadata"]["name"], d["spec"]
        strategy = spec["strategy"]["rollingUpdate"]
        pod = spec["template"]["spec"]
        expected = rollout_timeout_s(
            caps.get(name, spec["replicas"]),
            strategy["maxSurge"],
            strategy["maxUnavailable"],
            spec.get("minReadySeconds", 0),
            pod["terminationGracePeriodSeconds"],
        )
        seen[name] = int(d["metadata"]["annotations"][TIMEOUT_ANNOTATION])
        assert seen[name] == expected, name
    assert seen["orders-worker-bulk"] == 3 * (60 + 345) + 345 > 600
    assert seen["orders-worker-sandbox"] == 4 * 60 + 55  # no minReadySeconds: no downstream


# ---- the preflight --------------------------------------------------------------------------


@dataclass
class FakeCluster:
    """A cluster with the given CRDs, RuntimeClasses and live Deployment selectors."""

    crds: set[str] = field(
        default_factory=lambda: {
            *preflight.KEDA_CRDS,
            preflight.POD_MONITOR_CRD,
            preflight.PROMETHEUS_RULE_CRD,
        }
    )
    runtime_classes: set[str] = field(default_factory=lambda: {"gvisor"})
    selectors: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)

    def has_crd(self, name: str) -> bool:
        self.asked.append(name)
        return name in self.crds

    def has_runtime_class(self, name: str) -> bool:
        self.asked.append(name)
        return name in self.runtime_classes

    def deployment_selector(self, namespace: str, name: str) -> Mapping[str, str] | None:
        return self.selectors.get((namespace, name))


def ready(service: ServiceSpec) -> ServiceSpec:
    """``service`` on a gVisor cluster that creates no RuntimeClass, its ACL user installed."""
    sandbox = dataclasses.replace(
        service.sandbox,
        runtime_handler=None,
        broker_user="orders-worker-sandbox",
        broker_password="pw",
        broker_acl_installed=True,
    )
    return dataclasses.replace(service, sandbox=sandbox)


def test_a_ready_cluster_passes_the_preflight(service: ServiceSpec) -> None:
    cluster = FakeCluster()
    assert preflight.problems(ready(service), cluster) == []
    assert "scaledobjects.keda.sh" in cluster.asked and "gvisor" in cluster.asked


def test_the_preflight_names_each_missing_prerequisite_in_one_line(service: ServiceSpec) -> None:
    spec = dataclasses.replace(
        ready(service),
        sandbox=dataclasses.replace(ready(service).sandbox, broker_acl_installed=False),
    )
    with pytest.raises(GuardError) as error:
        preflight.check(spec, FakeCluster(crds=set(), runtime_classes=set()))
    lines = str(error.value).splitlines()
    assert len(lines) == 5 and all(line.startswith("preflight: ") for line in lines)
    keda, monitor, rule, runtime, acl = lines
    assert "KEDA is not installed (CRD scaledobjects.keda.sh, triggerauthentications" in keda
    assert "helm install keda kedacore/keda" in keda
    assert "podmonitors.monitoring.coreos.com is missing" in monitor
    assert "set podMonitor: false" in monitor
    assert "prometheusrules.monitoring.coreos.com" in rule and "prometheusRule: false" in rule
    assert "RuntimeClass 'gvisor' (sandbox.runtimeClass) is missing" in runtime
    assert "sandbox.runtimeHandler" in runtime and "remove sandbox.runtimeClass" in runtime
    assert "no ACL user 'orders-worker-sandbox'" in acl
    assert "redis-cli ACL SETUSER orders-worker-sandbox reset on " in acl
    assert '">$(pulumi config get sandboxRedisPassword)"' in acl and "pw" not in acl.split()
    assert "'~dramatiq-sandbox:*'" in acl and "'-script|flush'" in acl
    assert "sandbox.brokerAclInstalled: true" in acl


def test_stack_options_for_a_cluster_without_prometheus_operator_or_gvisor(
    service: ServiceSpec,
) -> None:
    bare = FakeCluster(crds=set(preflight.KEDA_CRDS), runtime_classes=set())
    spec = ready(service)
    assert len(preflight.problems(spec, bare)) == 3
    without = dataclasses.replace(
        spec,
        scaling=dataclasses.replace(spec.scaling, pod_monitor=False),
        prometheus_rule=False,
        sandbox=dataclasses.replace(spec.sandbox, runtime_class=None),
    )
    assert preflight.problems(without, bare) == []
    objects = rendered(without)
    assert not of_kind(objects, "PodMonitor") and not of_kind(objects, "PrometheusRule")
    # A stack that creates its RuntimeClass needs none in the cluster.
    created = dataclasses.replace(
        without, sandbox=dataclasses.replace(spec.sandbox, runtime_handler="runsc")
    )
    assert preflight.problems(created, bare) == []


def test_a_selector_change_is_refused_naming_the_field(service: ServiceSpec) -> None:
    spec = ready(service)
    live = {"app.kubernetes.io/name": "orders-worker", "worker-template/pool": "bulk"}
    assert (
        preflight.problems(
            spec, FakeCluster(selectors={("orders-worker", "orders-worker-bulk"): live})
        )
        == []
    )
    old = {"app": "orders-worker-bulk"}
    (line,) = preflight.problems(
        spec, FakeCluster(selectors={("orders-worker", "orders-worker-bulk"): old})
    )
    assert line.startswith(
        "Deployment orders-worker/orders-worker-bulk: spec.selector would change from "
        "{'app': 'orders-worker-bulk'} to "
    )
    assert "delete the pool before its replacement exists" in line


def test_the_offline_render_checks_nothing_live(service: ServiceSpec) -> None:
    assert preflight.problems(service, preflight.OFFLINE) == []
    with preflight.using(FakeCluster()):
        assert isinstance(preflight.current(), FakeCluster)
    assert preflight.current() is None


# ---- names: stack-scoped, and new names for immutable values --------------------------------


def test_the_priority_class_is_named_by_stack_and_value(service: ServiceSpec) -> None:
    critical = dataclasses.replace(
        next(p for p in service.pools if p.name == "external"), critical=True
    )
    pools = tuple(critical if p.name == "external" else p for p in service.pools)
    names = {}
    for instance in ("orders-worker-staging", "orders-worker-prod"):
        objects = rendered(dataclasses.replace(service, pools=pools, instance=instance))
        (priority,) = of_kind(objects, "PriorityClass")
        names[instance] = priority["metadata"]["name"]
        assert names[instance] == f"{instance}-critical-{priority['value']}"
        pod = deployment(objects, "orders-worker-external")["spec"]["template"]["spec"]
        assert pod["priorityClassName"] == names[instance]
    assert len(set(names.values())) == 2


# ---- the sandbox: egress, CPU limit ---------------------------------------------------------


def sandbox_objects(objects: Objects) -> Objects:
    return [o for o in objects if o["metadata"].get("namespace") == "orders-worker-sandbox"]


def test_the_sandbox_has_a_cpu_limit_and_the_quota_counts_it(service: ServiceSpec) -> None:
    everything = rendered(service)
    objects = sandbox_objects(everything)
    (d,) = of_kind(objects, "Deployment")
    (container,) = d["spec"]["template"]["spec"]["containers"]
    # pools.toml: cpu = "500m" (the request), the limit twice that (SANDBOX_CPU_LIMIT_FACTOR)
    assert container["resources"]["limits"] == {"cpu": "1000m", "memory": "1Gi"}
    (quota,) = of_kind(objects, "ResourceQuota")
    assert quota["spec"]["hard"]["limits.cpu"] == f"{1000 * 6}m"
    (limits,) = of_kind(objects, "LimitRange")
    assert limits["spec"]["limits"][0]["max"]["cpu"] == "1000m"
    assert sandbox_problems(everything, "orders-worker-sandbox") == []
    del container["resources"]["limits"]["cpu"]
    assert "orders-worker-sandbox: container worker has no CPU limit" in sandbox_problems(
        everything, "orders-worker-sandbox"
    )
    ordinary = deployment(rendered(service), "orders-worker-bulk")
    assert "cpu" not in ordinary["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_sandbox_egress_admits_node_local_dns_and_a_broker_outside_the_cluster(
    service: ServiceSpec,
) -> None:
    spec = dataclasses.replace(
        service,
        broker=dataclasses.replace(service.broker, cidr="10.0.12.7"),
        sandbox=dataclasses.replace(service.sandbox, node_local_dns="169.254.20.10"),
    )
    everything = rendered(spec)
    objects = sandbox_objects(everything)
    policies = {p["metadata"]["name"]: p["spec"] for p in of_kind(objects, "NetworkPolicy")}
    dns = policies["allow-dns"]["egress"][0]
    assert dns["to"][1] == {"ipBlock": {"cidr": "169.254.20.10/32"}}
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    broker = policies["allow-broker"]["egress"][0]
    assert broker == {
        "to": [{"ipBlock": {"cidr": "10.0.12.7/32"}}],
        "ports": [{"port": 6379, "protocol": "TCP"}],
    }
    blocks = ("169.254.20.10/32", "10.0.12.7/32")
    assert sandbox_problems(everything, "orders-worker-sandbox", ip_blocks=blocks) == []
    assert sandbox_problems(everything, "orders-worker-sandbox") != []
    for obj in objects:
        validate_strict(obj)
    # Without the options: the DNS pods and the broker pods only.
    plain = {
        p["metadata"]["name"]: p["spec"]
        for p in of_kind(sandbox_objects(rendered(service)), "NetworkPolicy")
    }
    assert len(plain["allow-dns"]["egress"][0]["to"]) == 1
    assert "ipBlock" not in plain["allow-broker"]["egress"][0]["to"][0]


@pytest.mark.parametrize(
    ("where", "value"), [("redis.cidr", "10.0.12.0/33"), ("sandbox.nodeLocalDns", "dns")]
)
def test_a_bad_egress_address_is_refused_in_one_line(
    service: ServiceSpec, where: str, value: str
) -> None:
    spec = (
        dataclasses.replace(service, broker=dataclasses.replace(service.broker, cidr=value))
        if where == "redis.cidr"
        else dataclasses.replace(
            service, sandbox=dataclasses.replace(service.sandbox, node_local_dns=value)
        )
    )
    with pytest.raises(GuardError, match=rf"sandbox egress: {where} '{value}' is not an address"):
        rendered(spec)


# ---- image pull policy and the checkov skips ------------------------------------------------


@pytest.mark.parametrize(
    ("image", "policy", "skips"),
    [
        ("registry.example.com/orders-worker:staging", "Always", {"CKV_K8S_43"}),
        ("registry.example.com/orders-worker:v1.0.0", "Always", {"CKV_K8S_43"}),
        ("registry.example.com/orders-worker@sha256:" + "a" * 64, "IfNotPresent", {"CKV_K8S_15"}),
    ],
)
def test_a_tag_is_pulled_always_and_only_a_digest_if_not_present(
    service: ServiceSpec, image: str, policy: str, skips: set[str]
) -> None:
    for d in of_kind(rendered(dataclasses.replace(service, image=image)), "Deployment"):
        container = d["spec"]["template"]["spec"]["containers"][0]
        assert container["imagePullPolicy"] == policy
        annotations = d["metadata"]["annotations"]
        skipped = {
            v.split("=", 1)[0] for k, v in annotations.items() if k.startswith("checkov.io/skip")
        }
        cpu_limited = "cpu" in container["resources"]["limits"]
        expected = skips | {"CKV_K8S_35"} | (set() if cpu_limited else {"CKV_K8S_11"})
        assert skipped == expected, d["metadata"]["name"]
        for value in annotations.values():
            check, _, reason = value.partition("=")
            if check in CHECKOV_SKIPS:
                assert reason == CHECKOV_SKIPS[check]


# ---- the timing rule, through the service ---------------------------------------------------


@pytest.mark.parametrize("margin", [5, 10])
def test_a_margin_within_the_kill_after_is_refused_naming_the_numbers(
    service: ServiceSpec, margin: int
) -> None:
    with pytest.raises(
        GuardError,
        match=rf"timing guard: pool 'interactive': grace period {40 + margin} s must exceed "
        r"shutdown_timeout_ms \(40000\) \+ the supervisor's kill after 10 s = 50 s",
    ):
        rendered(dataclasses.replace(service, grace_margin_s=margin))
    rendered(dataclasses.replace(service, grace_margin_s=11))
