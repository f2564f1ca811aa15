"""Pulumi mock tests of each component: what it registers, and what it refuses."""

from __future__ import annotations

import dataclasses
from typing import Any

import pulumi
import pytest
from templatepools import POOL_ENV, TIMING, pool, pools_file_text

from worker_infra import (
    BacklogScaler,
    BacklogScalerArgs,
    BrokerSpec,
    GuardError,
    SandboxPool,
    SandboxPoolArgs,
    SchedulerSpec,
    ServiceSpec,
    WorkerPool,
    WorkerPoolArgs,
    WorkerService,
)
from worker_infra.policy import (
    cpu_trigger_problems,
    isolation_problems,
    of_kind,
    restricted_problems,
    sandbox_problems,
    validate_strict,
)
from worker_infra.render import RecordingMocks, render

POOL = pool(
    "interactive",
    ("notifications", "emails"),
    processes=2,
    concurrency=8,
    job_timeout_ms=30_000,
    shutdown_timeout_ms=40_000,
    memory="640Mi",
    handler_memory="16Mi",
    min_replicas=2,
    max_replicas=4,
    uses=["postgres"],
)
BROKER = BrokerSpec(host="redis-master.redis", port=6380, password="pw")


def run(program: Any) -> list[dict[str, Any]]:
    return render(program, project="orders-worker", stack="test")


def pool_args(**changes: Any) -> WorkerPoolArgs:
    args = WorkerPoolArgs(
        pool=POOL,
        project="orders-worker",
        image="img:1",
        namespace="ns",
        broker_secret="orders-worker-broker",
        pools_config_map="orders-worker-pools",
        pools_checksum="0" * 64,
        timing=TIMING,
        database_secret="orders-worker-database",
    )
    return dataclasses.replace(args, **changes)


def env_of(deployment: dict[str, Any]) -> dict[str, Any]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_worker_pool_registers_deployment_token_less_account_and_pdb() -> None:
    objects = run(lambda: WorkerPool("interactive", pool_args()))
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Deployment", "PodDisruptionBudget"]
    sa, deployment, pdb = objects
    assert sa["automountServiceAccountToken"] is False
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"] == "orders-worker-interactive"
    assert pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == 55
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    # One old pod drains at a time: the next replacement waits out its grace period.
    assert deployment["spec"]["minReadySeconds"] == 55
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert {c["topologyKey"] for c in pod["topologySpreadConstraints"]} == {
        "topology.kubernetes.io/zone",
        "kubernetes.io/hostname",
    }
    (container,) = pod["containers"]
    assert container["command"] == ["orders-worker", "worker"]
    assert container["livenessProbe"]["exec"]["command"] == [
        "orders-worker",
        "healthcheck",
        "live",
        "--stalled-after",
        "60",
    ]
    assert container["readinessProbe"]["exec"]["command"] == [
        "orders-worker",
        "healthcheck",
        "ready",
    ]
    assert container["resources"] == {
        "limits": {"memory": "640Mi"},
        "requests": {"cpu": "250m", "memory": "640Mi"},
    }
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"worker-template/pools-sha256": "0" * 64}
    assert {"mountPath": "/etc/worker-pools", "name": "pools", "readOnly": True} in container[
        "volumeMounts"
    ]
    assert {
        "configMap": {
            "items": [{"key": "pools.toml", "path": "pools.toml"}],
            "name": "orders-worker-pools",
        },
        "name": "pools",
    } in pod["volumes"]
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    assert restricted_problems(deployment) == []
    for obj in objects:
        validate_strict(obj)


def test_worker_pool_environment_follows_the_contract() -> None:
    """The pool's shape is not in the environment: the pods read it from the pools file."""
    (deployment,) = of_kind(
        run(lambda: WorkerPool("p", pool_args(env={"LOG_LEVEL": "info"}))), "Deployment"
    )
    env = env_of(deployment)
    assert env["WORKER_POOL"] == "interactive"
    assert env["WORKER_POOLS_FILE"] == "/etc/worker-pools/pools.toml"
    assert not {k for k in env if k in POOL_ENV}
    assert env["HEALTH_STALLED_AFTER_S"] == "60"
    assert (env["METRICS_PORT"], env["OTEL_SERVICE_NAME"]) == ("9191", "orders-worker")
    assert env["LOG_LEVEL"] == "info"
    assert env["REDIS_URL"] == {
        "secretKeyRef": {"key": "redis-url", "name": "orders-worker-broker"}
    }
    assert env["DATABASE_URL"]["secretKeyRef"]["name"] == "orders-worker-database"
    (no_db,) = of_kind(run(lambda: WorkerPool("p", pool_args(database_secret=None))), "Deployment")
    assert "DATABASE_URL" not in env_of(no_db)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"handler_memory": "64Mi"}, "memory guard: pool 'interactive' needs 1378Mi"),
        ({"min_replicas": 5}, r"min_replicas \(5\)"),
    ],
)
def test_worker_pool_refuses_before_registering_anything(
    changes: dict[str, Any], message: str
) -> None:
    mocks = RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project="p", stack="s", preview=False)
    bad = pool_args(
        pool=dataclasses.replace(
            POOL,
            **changes,
            **({"handler_memory_bytes": 64 * 2**20} if "handler_memory" in changes else {}),
        )
    )
    with pytest.raises(GuardError, match=message):
        WorkerPool("p", bad)
    with pytest.raises(GuardError, match=r"grace period 40 s must exceed shutdown_timeout_ms"):
        WorkerPool("p", pool_args(grace_margin_s=0))
    assert mocks.resources == []


def scaler_args(**changes: Any) -> BacklogScalerArgs:
    args = BacklogScalerArgs(
        pool="interactive",
        project="orders-worker",
        namespace="ns",
        target="orders-worker-interactive",
        queues=("notifications", "emails"),
        broker_namespace="dramatiq",
        min_replicas=2,
        max_replicas=4,
        backlog_age_target_s=5,
        per_replica=16,
        processes=2,
        broker=BROKER,
        broker_secret="orders-worker-broker",
    )
    return dataclasses.replace(args, **changes)


def test_backlog_scaler_triggers_on_load_age_and_the_ready_lists_only() -> None:
    objects = run(lambda: BacklogScaler("s", scaler_args()))
    auth, scaled = of_kind(objects, "TriggerAuthentication")[0], of_kind(objects, "ScaledObject")[0]
    assert auth["spec"]["secretTargetRef"] == [
        {"key": "redis-password", "name": "orders-worker-broker", "parameter": "password"}
    ]
    spec = scaled["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 4)
    # KEDA's fallback cannot hold a Value trigger; a missing metric blocks scale-down instead.
    assert "fallback" not in spec
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "orders-worker-interactive",
    }
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 900
    assert behavior["scaleDown"]["policies"] == [{"periodSeconds": 60, "type": "Pods", "value": 1}]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 30
    assert behavior["scaleUp"]["policies"] == [
        {"periodSeconds": 15, "type": "Percent", "value": 200},
        {"periodSeconds": 15, "type": "Pods", "value": 8},
    ]
    triggers = {t["name"]: t for t in spec["triggers"]}
    # No delay-list trigger: a message not yet due would wake a pool at zero, whose drain
    # hands it back and wakes it again (one pod start per cooldown). A due one is the age's.
    lanes = {
        f"ready-{q}{lane}" for q in ("notifications", "emails") for lane in ("", "-high", "-low")
    }
    assert set(triggers) == {"load", "age", *lanes}
    load, age = triggers["load"], triggers["age"]
    assert (load["metricType"], load["metadata"]["threshold"]) == ("AverageValue", "16")
    scope = 'namespace="ns",job="ns/orders-worker-workers",worker_template_pool="interactive"'
    assert load["metadata"]["query"] == (
        f'sum(max by (queue) (queue_depth{{{scope},queue=~"notifications|emails"}}))'
        f" + (sum(worker_inflight_jobs{{{scope}}}) or vector(0))"
    )
    # The age is a Value: desired = ceil(replicas x age / target), not ceil(age / target).
    assert (age["metricType"], age["metadata"]["threshold"]) == ("Value", "5")
    due = 'queue=~"notifications|emails|notifications\\\\.DQ|emails\\\\.DQ"'
    assert age["metadata"]["query"] == f"max(queue_oldest_message_seconds{{{scope},{due}}})"
    assert {t["metadata"]["ignoreNullValues"] for t in (load, age)} == {"false"}
    redis = [t for t in spec["triggers"] if t["type"] == "redis"]
    # Each queue's own list first, then its priority lanes' (a message sent with a
    # priority waits there: at zero replicas it wakes the pool too).
    assert [t["metadata"]["listName"] for t in redis] == [
        "dramatiq:notifications",
        "dramatiq:notifications.high",
        "dramatiq:notifications.low",
        "dramatiq:emails",
        "dramatiq:emails.high",
        "dramatiq:emails.low",
    ]
    assert {t["metadata"]["activationListLength"] for t in redis} == {"0"}
    assert {t["metadata"]["address"] for t in redis} == {"redis-master.redis:6380"}
    assert triggers["ready-emails"]["metadata"]["listLength"] == "16"
    assert {t["authenticationRef"]["name"] for t in redis} == {auth["metadata"]["name"]}
    assert cpu_trigger_problems(objects) == []
    for obj in objects:
        validate_strict(obj)


def test_backlog_scaler_without_a_password_has_no_trigger_authentication() -> None:
    objects = run(lambda: BacklogScaler("s", scaler_args(broker=BrokerSpec(host="redis"))))
    assert [o["kind"] for o in objects] == ["ScaledObject"]
    assert all("authenticationRef" not in t for t in objects[0]["spec"]["triggers"])


def sandbox_args(service: ServiceSpec, **changes: Any) -> SandboxPoolArgs:
    """The arguments of the service's sandbox pool in namespace ``sb``, then ``changes``."""
    pool = next(p for p in service.pools if p.sandbox)
    defaults: dict[str, Any] = {
        "project": "o",
        "image": "i",
        "namespace": "sb",
        "broker": BROKER,
        "pools_file": pools_file_text(),
        "timing": TIMING,
    }
    return SandboxPoolArgs(pool=pool, **{**defaults, **changes})


def test_sandbox_pool_is_locked_down(service: ServiceSpec) -> None:
    args = sandbox_args(
        service,
        project="orders-worker",
        image="img:1",
        namespace="orders-worker-sandbox",
        sandbox=service.sandbox,
    )
    objects = run(lambda: SandboxPool("sandbox", args))
    assert sandbox_problems(objects, "orders-worker-sandbox", broker_port=6380) == []
    (runtime_class,) = of_kind(objects, "RuntimeClass")
    assert runtime_class["handler"] == "runsc"
    (deployment,) = of_kind(objects, "Deployment")
    assert deployment["spec"]["template"]["spec"]["runtimeClassName"] == "gvisor"
    assert restricted_problems(deployment) == []
    (quota,) = of_kind(objects, "ResourceQuota")
    assert quota["spec"]["hard"]["pods"] == "6"
    (scrape,) = [o for o in objects if o["metadata"]["name"] == "allow-scrape"]
    assert scrape["spec"]["ingress"][0]["ports"] == [{"port": 9191, "protocol": "TCP"}]
    assert len(of_kind(objects, "PodMonitor")) == 1
    for obj in objects:
        validate_strict(obj)
    without = dataclasses.replace(
        args, sandbox=dataclasses.replace(service.sandbox, runtime_class=None)
    )
    plain = run(lambda: SandboxPool("sandbox", without))
    assert of_kind(plain, "RuntimeClass") == []
    assert "runtimeClassName" not in of_kind(plain, "Deployment")[0]["spec"]["template"]["spec"]


def test_sandbox_policy_check_notices_an_extra_egress_rule(service: ServiceSpec) -> None:
    args = sandbox_args(service)
    objects = run(lambda: SandboxPool("sandbox", args))
    assert sandbox_problems(objects, "sb", broker_port=6380) == []
    allow = next(o for o in objects if o["metadata"]["name"] == "allow-broker")
    allow["spec"]["egress"].append({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]})
    assert sandbox_problems(objects, "sb", broker_port=6380)


def test_sandbox_policy_check_covers_plain_environment_values(service: ServiceSpec) -> None:
    for env in (
        {"DATABASE_URL": "postgresql://app:pw@db/app"},
        {"PARTNER": "https://user:pw@partner.example.com"},
        {"API_TOKEN": "abc"},
    ):
        args = sandbox_args(service, env=env)
        objects = run(lambda args=args: SandboxPool("sandbox", args))
        (name,) = env
        assert f"sb: pod gets {name} in plain text" in sandbox_problems(objects, "sb", 6380)


def test_sandbox_policy_check_notices_a_wider_ingress_rule(service: ServiceSpec) -> None:
    args = sandbox_args(service, pools_file="x")
    objects = run(lambda: SandboxPool("sandbox", args))
    scrape = next(o for o in objects if o["metadata"]["name"] == "allow-scrape")
    scrape["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}})
    assert sandbox_problems(objects, "sb", broker_port=6380)


def test_worker_service_renders_every_pool_isolated_and_valid(service: ServiceSpec) -> None:
    objects = run(lambda: WorkerService("orders-worker", service))
    assert (
        len(of_kind(objects, "Deployment"))
        == len(of_kind(objects, "ScaledObject"))
        == len(service.pools)
        == 5
    )
    assert isolation_problems(objects) == []
    assert cpu_trigger_problems(objects) == []
    assert sandbox_problems(objects, "orders-worker-sandbox") == []
    for deployment in of_kind(objects, "Deployment"):
        assert restricted_problems(deployment) == []
    for obj in objects:
        validate_strict(obj)
    secrets = {
        (s["metadata"]["namespace"], s["metadata"]["name"]) for s in of_kind(objects, "Secret")
    }
    assert secrets == {
        ("orders-worker", "orders-worker-broker"),
        ("orders-worker", "orders-worker-database"),
        ("orders-worker-sandbox", "orders-worker-broker"),
    }
    assert all(
        v == "<secret>" for s in of_kind(objects, "Secret") for v in s["stringData"].values()
    )
    external = next(
        d for d in of_kind(objects, "Deployment") if d["metadata"]["name"].endswith("external")
    )
    assert "DATABASE_URL" not in env_of(external)


def test_worker_service_over_budget_is_refused_before_anything_exists(service: ServiceSpec) -> None:
    pools = tuple(
        dataclasses.replace(p, max_replicas=16) if p.name == "bulk" else p for p in service.pools
    )
    mocks = RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project="p", stack="s", preview=False)
    with pytest.raises(GuardError) as refused:
        WorkerService("svc", dataclasses.replace(service, pools=pools))
    assert "postgres: pools use 115 > budget 110" in str(refused.value)
    assert "bulk (16 + 2) x (2 x 2 + 1) = 90, critical (3 + 2) x (1 x 4 + 1) = 25" in str(
        refused.value
    )
    assert mocks.resources == []


def test_strict_validation_rejects_unknown_fields() -> None:
    objects = run(
        lambda: WorkerService(
            "svc",
            dataclasses.replace(
                ServiceSpec("o", "i", "o", (POOL,), BROKER, "", POOL_ENV, TIMING),
                pools=(dataclasses.replace(POOL, uses=()),),
            ),
        )
    )
    scaled = of_kind(objects, "ScaledObject")[0]
    scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behaviour"] = {}
    with pytest.raises(ValueError, match="behaviour"):
        validate_strict(scaled)
    deployment = of_kind(objects, "Deployment")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(Exception, match="livenessProbes"):
        validate_strict(deployment)


def test_scheduler_renders_two_restricted_replicas_without_a_scaler(service: ServiceSpec) -> None:
    spec = dataclasses.replace(service, scheduler=SchedulerSpec(schedules=("nightly",)))
    objects = run(lambda: WorkerService("orders-worker", spec))
    (scheduler,) = [
        d for d in of_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-scheduler")
    ]
    assert scheduler["spec"]["replicas"] == 2
    assert scheduler["metadata"]["labels"]["app.kubernetes.io/component"] == "scheduler"
    targets = {s["spec"]["scaleTargetRef"]["name"] for s in of_kind(objects, "ScaledObject")}
    assert scheduler["metadata"]["name"] not in targets
    assert restricted_problems(scheduler) == []
    assert isolation_problems(objects) == []
    pod = scheduler["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["orders-worker", "scheduler"]
    assert container["resources"] == {
        "limits": {"memory": "192Mi"},
        "requests": {"cpu": "50m", "memory": "192Mi"},
    }
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    env = env_of(scheduler)
    assert env["SCHEDULER_LEADER_TTL_MS"] == "10000"
    assert env["REDIS_URL"]["secretKeyRef"]["name"] == "orders-worker-broker"
    assert "WORKER_POOL" not in env and "DATABASE_URL" not in env
    pdbs = [
        p
        for p in of_kind(objects, "PodDisruptionBudget")
        if p["metadata"]["name"] == (scheduler["metadata"]["name"])
    ]
    assert pdbs and pdbs[0]["spec"]["selector"] == scheduler["spec"]["selector"]
    workers = [d for d in of_kind(objects, "Deployment") if d is not scheduler]
    for worker in workers:  # no pool's selector picks the scheduler's pods
        selector = worker["spec"]["selector"]["matchLabels"]
        labels = scheduler["spec"]["template"]["metadata"]["labels"]
        assert not selector.items() <= labels.items()
    for obj in objects:
        validate_strict(obj)


def test_no_schedules_still_a_scheduler_and_bad_numbers_are_refused(service: ServiceSpec) -> None:
    """Without schedules the scheduler still runs: it exports every pool's backlog, which a
    pool at zero pods cannot (its alerts and its age trigger read it)."""
    objects = run(
        lambda: WorkerService("svc", dataclasses.replace(service, scheduler=SchedulerSpec()))
    )
    assert [d for d in of_kind(objects, "Deployment") if "scheduler" in d["metadata"]["name"]]
    without = run(lambda: WorkerService("svc", dataclasses.replace(service, scheduler=None)))
    assert not [d for d in of_kind(without, "Deployment") if "scheduler" in d["metadata"]["name"]]
    mocks = RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project="p", stack="s", preview=False)
    bad = SchedulerSpec(schedules=("x",), leader_ttl_ms=60_000, stalled_after_s=30)
    with pytest.raises(GuardError, match="stalled_after_s"):
        WorkerService("svc", dataclasses.replace(service, scheduler=bad))
    assert mocks.resources == []
