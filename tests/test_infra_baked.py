"""The baked service's infra: `make manifests` for every stack, strictly valid, policies hold,
and stacks that break a guard are refused with the pools and numbers named."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from worker_infra.policy import (
    Endpoint,
    cpu_trigger_problems,
    endpoint,
    isolation_problems,
    of_kind,
    pod_env,
    pod_pool,
    pod_pools_file,
    reachable,
    restricted_problems,
    sandbox_problems,
    validate_strict,
    workers,
)

from bakery import PYTHON, make_manifests, project_env
from worker_runtime.console import server as console_server
from worker_runtime import pools

STACKS = ("dev", "staging", "prod")
CONTEXTS = {
    "default": {},
    "minimal": {"project": "lean-worker", "database": "none", "sandbox_pool": "no"},
}
Objects = list[dict[str, Any]]


@pytest.fixture(scope="module")
def rendered(bake: Callable[..., Path]) -> dict[tuple[str, str], tuple[Path, Objects]]:
    """(context, stack) -> (project dir, rendered objects), via `make manifests`."""
    out = {}
    for context, answers in CONTEXTS.items():
        project = bake(**answers)
        for stack in STACKS:
            result = make_manifests(project, stack)
            assert result.returncode == 0, result.stderr
            text = (project / "build" / "manifests" / f"{stack}.yaml").read_text()
            out[context, stack] = project, list(yaml.safe_load_all(text))
    return out


CASES = [(c, s) for c in CONTEXTS for s in STACKS]


@pytest.mark.parametrize(("context", "stack"), CASES)
def test_every_object_validates_strictly(
    rendered: Any, context: str, stack: str
) -> None:
    _, objects = rendered[context, stack]
    assert objects
    for obj in objects:
        validate_strict(obj)


@pytest.mark.parametrize(("context", "stack"), CASES)
def test_policies_hold(rendered: Any, context: str, stack: str) -> None:
    project, objects = rendered[context, stack]
    pools = tomllib.loads((project / "pools.toml").read_text())["pools"]
    for deployment in of_kind(objects, "Deployment"):
        assert restricted_problems(deployment) == []
    assert cpu_trigger_problems(objects) == []
    assert isolation_problems(objects) == []
    assert len(workers(objects)) == len(of_kind(objects, "ScaledObject")) == len(pools)
    # The scheduler: its own Deployment (schedules in pools.toml), 2 replicas, no scaler.
    (scheduler,) = [
        d for d in of_kind(objects, "Deployment") if d not in workers(objects)
    ]
    assert scheduler["metadata"]["name"] == f"{project.name}-scheduler"
    assert scheduler["spec"]["replicas"] == 2
    assert scheduler["spec"]["template"]["spec"]["containers"][0]["command"] == [
        project.name,
        "scheduler",
    ]
    assert "WORKER_POOL" not in pod_env(scheduler) and "DATABASE_URL" not in pod_env(
        scheduler
    )
    targets = {
        s["spec"]["scaleTargetRef"]["name"] for s in of_kind(objects, "ScaledObject")
    }
    assert scheduler["metadata"]["name"] not in targets
    sandbox_ns = f"{project.name}-sandbox"
    if context == "default":
        assert sandbox_problems(objects, sandbox_ns) == []
    else:
        assert not [o for o in objects if o["metadata"].get("namespace") == sandbox_ns]
        assert not [
            o for o in of_kind(objects, "Secret") if "database" in o["metadata"]["name"]
        ]
        assert (
            "DATABASE_URL"
            not in (project / "build" / "manifests" / f"{stack}.yaml").read_text()
        )


def stack_config(project: Path, stack: str) -> dict[str, Any]:
    data = yaml.safe_load((project / "infra" / f"Pulumi.{stack}.yaml").read_text())[
        "config"
    ]
    return {k.split(":", 1)[1]: v for k, v in data.items()}


@pytest.mark.parametrize("stack", STACKS)
def test_the_sandbox_cannot_reach_a_console_or_exporter(rendered: Any, stack: str) -> None:
    """The rendered NetworkPolicies, evaluated as Kubernetes defines them
    (worker_infra.policy.reachable; no CNI enforces them here: the e2e cluster's nodes are
    kwok's): a sandbox pod reaches DNS and the broker, and no port of any worker, scheduler
    or other sandbox pod: neither the exporter (METRICS_PORT, where CONSOLE_IN_EXPORTER
    mounts the console) nor the console's own port."""
    project, objects = rendered["default", stack]
    policies = of_kind(objects, "NetworkPolicy")
    sandbox_ns = f"{project.name}-sandbox"
    (sandbox,) = [
        d for d in of_kind(objects, "Deployment") if d["metadata"]["namespace"] == sandbox_ns
    ]
    source = endpoint(objects, sandbox)
    redis = stack_config(project, stack)["redis"]
    broker = Endpoint(
        redis["namespace"],
        {"kubernetes.io/metadata.name": redis["namespace"]},
        redis["podSelector"],
    )
    dns = Endpoint(
        "kube-system", {"kubernetes.io/metadata.name": "kube-system"}, {"k8s-app": "kube-dns"}
    )
    # What the rules admit (the evaluation is not a blanket no).
    assert reachable(policies, source, broker, int(redis["port"]))
    assert reachable(policies, source, dns, 53, "UDP")
    assert not reachable(policies, source, broker, 9191)
    console_port = console_server.DEFAULT_PORT
    targets = of_kind(objects, "Deployment")
    assert len(targets) == len(workers(objects)) + 1  # every pool's, the scheduler's
    for deployment in targets:
        target = endpoint(objects, deployment, ip="10.1.2.3")
        ports = {
            port["containerPort"]
            for c in deployment["spec"]["template"]["spec"]["containers"]
            for port in c.get("ports", [])
        }
        assert ports  # the exporter's METRICS_PORT
        for port in sorted(ports | {console_port, int(redis["port"])}):
            assert not reachable(policies, source, target, port), (
                deployment["metadata"]["name"],
                port,
            )
    # The same evaluation finds a policy that would open the way.
    opened = {
        "kind": "NetworkPolicy",
        "metadata": {"namespace": sandbox_ns, "name": "planted"},
        "spec": {
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": project.name}
                            }
                        }
                    ]
                }
            ],
        },
    }
    worker = endpoint(objects, workers(objects)[0])
    assert reachable([*policies, opened], source, worker, 9191)
    assert sandbox_problems([*objects, opened], sandbox_ns) != []


@pytest.mark.parametrize(("context", "stack"), CASES)
def test_capacity_inequality_holds_in_the_rendered_objects(
    rendered: Any, context: str, stack: str
) -> None:
    """Recomputed from the rendered objects (the pools file the pods mount and the
    ScaledObjects), not from worker_infra: every pod that may hold connections at once,
    the two draining next to the maximum included, plus the readiness probe's."""
    project, objects = rendered[context, stack]
    max_replicas = {
        s["spec"]["scaleTargetRef"]["name"]: s["spec"]["maxReplicaCount"]
        for s in of_kind(objects, "ScaledObject")
    }
    deployments = workers(objects)
    budgets = {
        name: budget
        for deployment in deployments
        for name, budget in pod_pools_file(objects, deployment).get("downstream", {}).items()
    }
    used = dict.fromkeys(budgets, 0)
    for deployment in deployments:
        pool = pod_pool(objects, deployment)
        pods = max_replicas[deployment["metadata"]["name"]] + 2
        for name in pool["uses"]:
            db = budgets[name]["per_process"] == "db_pool_size"
            per_process = (
                pool.get("db_pool_size", pool["concurrency"])
                if db
                else pool["concurrency"]
            )
            used[name] += pods * (pool["processes"] * per_process + (1 if db else 0))
    for name, budget in budgets.items():
        assert used[name] <= budget["capacity"] - budget["reserved"], (
            stack,
            name,
            used[name],
        )


def test_numbers_render_as_integers_and_secrets_stay_secret(rendered: Any) -> None:
    project, objects = rendered["default", "prod"]
    (interactive,) = [
        d
        for d in of_kind(objects, "Deployment")
        if d["metadata"]["name"].endswith("interactive")
    ]
    assert (
        type(interactive["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
        is int
    )
    assert all(
        type(s["spec"]["maxReplicaCount"]) is int
        for s in of_kind(objects, "ScaledObject")
    )
    assert all(
        set(s["stringData"].values()) == {"<secret>"}
        for s in of_kind(objects, "Secret")
    )
    for stack in STACKS:
        # Secrets are set per stack with `pulumi config set --secret`: never plain text here.
        config = stack_config(project, stack)
        for key in ("redisPassword", "databaseUrl"):
            assert key not in config or set(config[key]) == {"secure"}, (stack, key)
    program = (project / "infra" / "__main__.py").read_text()
    assert 'config.require_secret("redisPassword")' in program
    assert 'config.require_secret("databaseUrl")' in program
    text = (project / "build" / "manifests" / "prod.yaml").read_text()
    assert text.count("\n---\n") + 1 == len(objects)
    assert of_kind(objects, "RuntimeClass") == [] and {
        d["spec"]["template"]["spec"].get("runtimeClassName")
        for d in of_kind(objects, "Deployment")
    } == {None, "gvisor"}


def test_stacks_differ_in_replica_ranges_and_capacity(rendered: Any) -> None:
    maxima = {
        stack: sorted(
            s["spec"]["maxReplicaCount"]
            for s in of_kind(rendered["default", stack][1], "ScaledObject")
        )
        for stack in STACKS
    }
    assert maxima["dev"] < maxima["staging"] < maxima["prod"]


@pytest.mark.parametrize("context", list(CONTEXTS))
def test_baked_infra_has_no_template_leftovers_and_passes_ruff(
    bake: Callable[..., Path], context: str
) -> None:
    infra = bake(**CONTEXTS[context]) / "infra"
    for path in infra.iterdir():
        if path.is_file():
            assert "{{" not in path.read_text() and "{%" not in path.read_text(), path
    requirements = (infra / "requirements.txt").read_text()
    assert (
        "worker-infra @ git+https://github.com/example-org/worker-template@v0.1.0#subdirectory=infra"
        in requirements
    )
    for args in (["check", "--select=E,F,W,I,B,UP,SIM,RUF,S,N"], ["format", "--check"]):
        result = subprocess.run(
            [
                PYTHON,
                "-m",
                "ruff",
                *args,
                "--line-length",
                "100",
                "--target-version",
                "py311",
                "--isolated",
                str(infra),
            ],
            check=False,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def edited_copy(
    project: Path, tmp_path: Path, stack: str, edit: Callable[[dict[str, Any]], None]
) -> Path:
    """A copy of ``project`` whose ``Pulumi.<stack>.yaml`` config went through ``edit``."""
    copy = tmp_path / project.name
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns("build"))
    path = copy / "infra" / f"Pulumi.{stack}.yaml"
    data = yaml.safe_load(path.read_text())
    prefix = f"{project.name}:"
    config = {k.removeprefix(prefix): v for k, v in data["config"].items()}
    edit(config)
    data["config"] = {prefix + k: v for k, v in config.items()}
    path.write_text(yaml.safe_dump(data))
    return copy


def refused(project: Path, stack: str) -> str:
    result = make_manifests(project, stack)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert not (project / "build" / "manifests" / f"{stack}.yaml").exists()
    return result.stderr


def test_over_budget_stack_is_refused_with_its_numbers(
    default_project: Path, tmp_path: Path
) -> None:
    def grow(config: dict[str, Any]) -> None:
        config["pools"]["bulk"]["max_replicas"] = (
            17  # staging: (17 + 2) x (2 x 2 + 1) = 95
        )

    stderr = refused(edited_copy(default_project, tmp_path, "staging", grow), "staging")
    ours = [line for line in stderr.splitlines() if not line.startswith("make")]
    assert len(ours) == 1 and ours[0].startswith("manifests: stack 'staging' refused: ")
    assert "postgres: pools use 115 > budget 110 (capacity 150 - reserved 40)" in stderr
    # Only the pools that use it count (interactive uses no database).
    assert (
        "bulk (17 + 2) x (2 x 2 + 1) = 95, critical (2 + 2) x (1 x 4 + 1) = 20"
    ) in stderr
    assert "interactive" not in stderr


def test_lowered_capacity_is_refused(default_project: Path, tmp_path: Path) -> None:
    def shrink(config: dict[str, Any]) -> None:
        config["downstream"]["partner_api"] = {"capacity": 10, "reserved": 4}

    stderr = refused(edited_copy(default_project, tmp_path, "dev", shrink), "dev")
    assert "partner_api: pools use 24 > budget 6 (capacity 10 - reserved 4)" in stderr
    assert "external (1 + 2) x (1 x 4) = 12, critical (1 + 2) x (1 x 4) = 12" in stderr


def test_bad_timing_stacks_are_refused(default_project: Path, tmp_path: Path) -> None:
    def no_margin(config: dict[str, Any]) -> None:
        config["graceMarginS"] = 0

    stderr = refused(
        edited_copy(default_project, tmp_path / "a", "dev", no_margin), "dev"
    )
    assert "grace period 40 s must exceed shutdown_timeout_ms (40000)" in stderr

    # A margin within the supervisor's kill after the drain (KILL_AFTER_DRAIN_S, 10 s):
    # the kubelet's SIGKILL would come first. The numbers come from the baked service.
    kill_after = pools.KILL_AFTER_DRAIN_S
    assert kill_after == 10.0
    for margin in (5, 10):

        def small_margin(config: dict[str, Any], margin: int = margin) -> None:
            config["graceMarginS"] = margin

        stderr = refused(
            edited_copy(default_project, tmp_path / f"m{margin}", "prod", small_margin),
            "prod",
        )
        assert (
            f"timing guard: pool 'interactive': grace period {40 + margin} s must exceed "
            "shutdown_timeout_ms (40000) + the supervisor's kill after 10 s = 50 s"
        ) in stderr

    def slow_jobs(config: dict[str, Any]) -> None:
        config["pools"]["critical"]["job_timeout_ms"] = 45_000

    stderr = refused(
        edited_copy(default_project, tmp_path / "b", "prod", slow_jobs), "prod"
    )
    assert "pools.critical" in stderr and "45000" in stderr and "40000" in stderr


def test_memory_guard_refuses_a_stack(default_project: Path, tmp_path: Path) -> None:
    def heavy(config: dict[str, Any]) -> None:
        config["pools"]["bulk"]["handler_memory"] = "256Mi"

    stderr = refused(edited_copy(default_project, tmp_path, "dev", heavy), "dev")
    assert "memory guard: pool 'bulk' needs 1378Mi" in stderr and "1280Mi" in stderr
    assert "supervisor 50Mi + 2 probes x 56Mi" in stderr


# ---- what the guards checked is what runs -------------------------------------------------


def boot(
    project: Path, objects: Objects, deployment: dict[str, Any], tmp: Path
) -> dict[str, Any]:
    """The effective config of a rendered pod: the baked `config` command run with the
    pod's environment and the pools file of its ConfigMap (secrets as stand-ins)."""
    env = {k: v for k, v in pod_env(deployment).items() if isinstance(v, str)}
    refs = {k for k, v in pod_env(deployment).items() if not isinstance(v, str)}
    path = tmp / f"{deployment['metadata']['name']}.toml"
    path.write_text(mounted_text(objects, deployment))
    env["WORKER_POOLS_FILE"] = str(path)
    if "REDIS_URL" in refs:
        env["REDIS_URL"] = "redis://:pw@redis:6379/0"
    if "DATABASE_URL" in refs:
        env["DATABASE_URL"] = "postgresql://app:pw@db/app"
    result = subprocess.run(
        [PYTHON, "-m", project.name.replace("-", "_"), "config", "--json"],
        env=project_env(project, **env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    config["_secrets"] = sorted(refs)
    return config


def mounted_config_map(objects: Objects, deployment: dict[str, Any]) -> dict[str, Any]:
    """The ConfigMap of the pools file a Deployment's pods mount."""
    (volume,) = [
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "pools"
    ]
    (config_map,) = [
        c
        for c in of_kind(objects, "ConfigMap")
        if c["metadata"]["namespace"] == deployment["metadata"]["namespace"]
        and c["metadata"]["name"] == volume["configMap"]["name"]
    ]
    return config_map


def mounted_text(objects: Objects, deployment: dict[str, Any]) -> str:
    text: str = mounted_config_map(objects, deployment)["data"]["pools.toml"]
    return text


def deployment_of(objects: Objects, pool: str) -> dict[str, Any]:
    (found,) = [d for d in workers(objects) if pod_env(d)["WORKER_POOL"] == pool]
    return found


@pytest.mark.parametrize(("context", "stack"), CASES)
def test_every_rendered_pod_boots_with_the_pool_the_guards_checked(
    rendered: Any, context: str, stack: str, tmp_path: Path
) -> None:
    project, objects = rendered[context, stack]
    for deployment in workers(objects):
        pool = pod_pool(objects, deployment)
        config = boot(project, objects, deployment, tmp_path)
        assert config["WORKER_QUEUES"] == pool["queues"]
        assert config["WORKER_CONCURRENCY"] == pool["concurrency"]
        assert config["WORKER_PROCESSES"] == pool["processes"]
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        text = mounted_text(objects, deployment)
        assert (
            annotations["worker-template/pools-sha256"]
            == hashlib.sha256(text.encode()).hexdigest()
        )


def overridden(
    default_project: Path,
    tmp_path: Path,
    stack: str,
    edit: Callable[[dict[str, Any]], None],
) -> tuple[Path, Objects]:
    project = edited_copy(default_project, tmp_path, stack, edit)
    result = make_manifests(project, stack)
    assert result.returncode == 0, result.stderr
    text = (project / "build" / "manifests" / f"{stack}.yaml").read_text()
    return project, list(yaml.safe_load_all(text))


def _pools_model(project: Path) -> Any:
    """The pool model the baked project runs: worker_runtime's."""
    from worker_runtime import pools as model

    return model


#: A distinct, valid value per pool-shaping field of interactive (staging), and the
#: effective variable the booted pod must show for it.
ENV_OVERRIDES = {
    "queues": ["notifications", "emails"],
    "processes": 3,
    "concurrency": 6,
    "job_timeout_ms": 20_000,
    "shutdown_timeout_ms": 35_000,
    "max_attempts": 7,
    "prefetch": 12,
    "db_pool_size": 9,
    "priority_bound": 5,
}
#: Infra-only fields: an override and where it must show in the rendered objects.
INFRA_OVERRIDES: dict[str, tuple[Any, Callable[[Objects, dict[str, Any]], Any]]] = {
    "memory": (
        "1500Mi",
        lambda o, d: d["spec"]["template"]["spec"]["containers"][0]["resources"][
            "limits"
        ]["memory"],
    ),
    "cpu": (
        "300m",
        lambda o, d: d["spec"]["template"]["spec"]["containers"][0]["resources"][
            "requests"
        ]["cpu"],
    ),
    "handler_memory": ("40Mi", lambda o, d: pod_pool(o, d)["handler_memory"]),
    "min_replicas": (2, lambda o, d: _scaled(o, d)["spec"]["minReplicaCount"]),
    "max_replicas": (5, lambda o, d: _scaled(o, d)["spec"]["maxReplicaCount"]),
    "backlog_age_target_s": (
        7,
        lambda o, d: int(_trigger(o, d, "age")["metadata"]["threshold"]),
    ),
    "critical": (
        True,
        lambda o, d: (
            d["spec"]["template"]["spec"].get("priorityClassName")
            == of_kind(o, "PriorityClass")[0]["metadata"]["name"]
        ),
    ),
    "sandbox": (False, lambda o, d: d["metadata"]["namespace"] == "orders-worker"),
}


def _scaled(objects: Objects, deployment: dict[str, Any]) -> dict[str, Any]:
    (found,) = [
        s
        for s in of_kind(objects, "ScaledObject")
        if s["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    ]
    return found


def _trigger(objects: Objects, deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [
        t for t in _scaled(objects, deployment)["spec"]["triggers"] if t["name"] == name
    ]
    return found


def test_every_pool_field_reaches_the_pod_or_is_declared_infra_only(
    default_project: Path, tmp_path: Path
) -> None:
    """Each field of the pool model, set by a stack override, shows in the rendered pod's
    effective config (booted from its env and mounted file) or in the rendered objects."""
    model = _pools_model(default_project)
    fields = list(model.Pool.model_fields)
    how = {name: model.reaches(name) for name in fields}
    env_fields = {n for n, h in how.items() if h.startswith("env:")}
    assert env_fields == set(ENV_OVERRIDES), (
        "a pool field reaching the env has no check here"
    )
    infra_fields = {n for n, h in how.items() if h == "infra"}
    assert infra_fields == set(INFRA_OVERRIDES), (
        "an infra-only pool field has no check here"
    )
    assert {n for n, h in how.items() if h == "worker"} == {"uses"}

    def edit(config: dict[str, Any]) -> None:
        pool = config["pools"]["interactive"]
        pool.update(ENV_OVERRIDES)
        pool.update({k: v for k, (v, _) in INFRA_OVERRIDES.items()})
        pool["uses"] = ["postgres", "partner_api"]
        config["downstream"]["postgres"]["capacity"] = 400
        config["downstream"]["partner_api"]["capacity"] = 400

    project, objects = overridden(default_project, tmp_path, "staging", edit)
    deployment = deployment_of(objects, "interactive")
    config = boot(project, objects, deployment, tmp_path)
    for field, value in ENV_OVERRIDES.items():
        assert config[how[field].removeprefix("env:")] == value, field
    for field, (value, shown) in INFRA_OVERRIDES.items():
        assert shown(objects, deployment) in (value, True), field
    assert pod_pool(objects, deployment)["uses"] == ["postgres", "partner_api"]
    assert "DATABASE_URL" in config["_secrets"]


@pytest.mark.parametrize(
    "name", ["WORKER_PROCESSES", "WORKER_CONCURRENCY", "DB_POOL_SIZE"]
)
def test_prod_env_cannot_override_the_pool_shape(
    default_project: Path, tmp_path: Path, name: str
) -> None:
    def sneak(config: dict[str, Any]) -> None:
        config["env"] = {"LOG_LEVEL": "INFO", name: "64"}

    stderr = refused(edited_copy(default_project, tmp_path, "prod", sneak), "prod")
    assert f"env {name}: shapes the pool" in stderr


def test_env_cannot_carry_database_url_into_the_sandbox(
    default_project: Path, tmp_path: Path
) -> None:
    def sneak(config: dict[str, Any]) -> None:
        config["env"] = {"DATABASE_URL": "postgresql://app:pw@db/app"}

    stderr = refused(edited_copy(default_project, tmp_path, "prod", sneak), "prod")
    assert "env DATABASE_URL: set by worker_infra itself" in stderr

    def disguised(config: dict[str, Any]) -> None:
        config["env"] = {"PG": "postgresql://app:pw@db/app"}

    stderr = refused(
        edited_copy(default_project, tmp_path / "b", "prod", disguised), "prod"
    )
    assert "env PG: looks like a secret or a connection string" in stderr


def test_a_stack_cannot_turn_off_the_sandbox(
    default_project: Path, tmp_path: Path
) -> None:
    def unsandbox(config: dict[str, Any]) -> None:
        config["pools"]["sandbox"]["sandbox"] = False

    stderr = refused(edited_copy(default_project, tmp_path, "prod", unsandbox), "prod")
    assert "pools.sandbox.sandbox: a deployment cannot turn off the sandbox" in stderr


def test_prefetch_reaches_the_pod(default_project: Path, tmp_path: Path) -> None:
    def prefetch(config: dict[str, Any]) -> None:
        config["pools"]["interactive"]["prefetch"] = 32

    project, objects = overridden(default_project, tmp_path, "prod", prefetch)
    config = boot(project, objects, deployment_of(objects, "interactive"), tmp_path)
    assert config["WORKER_PREFETCH"] == 32


def test_db_pool_below_concurrency_is_refused_by_the_model(
    default_project: Path, tmp_path: Path
) -> None:
    def small(config: dict[str, Any]) -> None:
        config["pools"]["interactive"]["db_pool_size"] = 2

    stderr = refused(edited_copy(default_project, tmp_path, "prod", small), "prod")
    assert (
        "pools.interactive: Value error, db_pool_size (2) is below concurrency (8)"
        in stderr
    )


def test_uses_changes_reach_the_pod_consistently(
    default_project: Path, tmp_path: Path
) -> None:
    """postgres dropped from critical's uses renders it without DATABASE_URL and the pod
    boots (it no longer needs one); uses: [postgres] on external gets the secret and the
    worker uses it."""

    def swap(config: dict[str, Any]) -> None:
        config["pools"]["critical"]["uses"] = ["partner_api"]
        config["pools"]["external"]["uses"] = ["postgres", "partner_api"]

    project, objects = overridden(default_project, tmp_path, "prod", swap)
    critical = boot(project, objects, deployment_of(objects, "critical"), tmp_path)
    assert "DATABASE_URL" not in critical["_secrets"]
    assert critical["DATABASE_URL"] is None
    external = boot(project, objects, deployment_of(objects, "external"), tmp_path)
    assert "DATABASE_URL" in external["_secrets"]
    assert external["DB_POOL_SIZE"] == 4
    model = _pools_model(project)
    pools = model.load_pools(
        _write(
            tmp_path / "ext.toml",
            pod_pools_file(objects, deployment_of(objects, "external")),
        )
    )
    assert pools.pools["external"].uses == ["postgres", "partner_api"]


def _write(path: Path, data: dict[str, Any]) -> Path:
    import tomli_w

    path.write_text(tomli_w.dumps(data))
    return path


def test_the_stack_names_its_cluster(default_project: Path, tmp_path: Path) -> None:
    def ambient(config: dict[str, Any]) -> None:
        del config["cluster"]

    stderr = refused(edited_copy(default_project, tmp_path, "prod", ambient), "prod")
    assert "cluster guard: stack 'prod' names no kube context" in stderr
    for stack in ("staging", "prod"):
        assert stack_config(default_project, stack)["cluster"]["context"]


def test_a_pre_created_namespace_is_not_created(
    default_project: Path, tmp_path: Path
) -> None:
    def precreated(config: dict[str, Any]) -> None:
        config["createNamespace"] = False

    _, objects = overridden(default_project, tmp_path, "prod", precreated)
    assert of_kind(objects, "Namespace") == []


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (apt-get install prometheus)")
def test_make_alerts_check_runs_the_promtool_cases(default_project: Path) -> None:
    """The baked `make alerts-check` (its CI's manifests job) runs the promtool cases of
    every rule of every pool (worker_infra.ruletests) on ops/alerts.yaml."""
    done = subprocess.run(
        ["make", "alerts-check", f"PYTHON={PYTHON}"], cwd=default_project, capture_output=True,
        text=True, timeout=900, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"ops/alerts.yaml: \d+ promtool cases pass", done.stdout), done.stdout


def test_monitoring_labels_reach_what_prometheus_selects(
    default_project: Path, tmp_path: Path
) -> None:
    """kube-prometheus-stack selects PodMonitors and PrometheusRules by ``release``: the
    stack's ``monitoringLabels`` put it on every one of them; a bad label is one line."""

    def release(config: dict[str, Any]) -> None:
        config["monitoringLabels"] = {"release": "kube-prometheus-stack"}

    _, objects = overridden(default_project, tmp_path, "prod", release)
    selected = of_kind(objects, "PodMonitor") + of_kind(objects, "PrometheusRule")
    assert len(selected) == 3
    for obj in selected:
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"

    def bad(config: dict[str, Any]) -> None:
        config["monitoringLabels"] = {"release": "kube prometheus stack"}

    stderr = refused(edited_copy(default_project, tmp_path / "bad", "prod", bad), "prod")
    (line,) = [line for line in stderr.splitlines() if "monitoringLabels" in line]
    assert "'release': 'kube prometheus stack'" in line


def test_cluster_wiring(rendered: Any) -> None:
    _, objects = rendered["default", "prod"]
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/managed-by") == "pulumi", obj["metadata"]
        assert labels.get("app.kubernetes.io/instance") == "orders-worker-prod"
        assert labels.get("app.kubernetes.io/version") == "v0.1.0"
    (priority,) = of_kind(objects, "PriorityClass")
    # Cluster-scoped: named by the stack and by its immutable value.
    assert priority["metadata"]["name"] == "orders-worker-prod-critical-100000"
    critical = deployment_of(objects, "critical")
    assert (
        critical["spec"]["template"]["spec"]["priorityClassName"]
        == priority["metadata"]["name"]
    )
    assert (
        "priorityClassName"
        not in deployment_of(objects, "bulk")["spec"]["template"]["spec"]
    )
    for pdb in of_kind(objects, "PodDisruptionBudget"):
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    for deployment in workers(objects):
        assert deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    monitors = of_kind(objects, "PodMonitor")
    assert {m["metadata"]["namespace"] for m in monitors} == {
        "orders-worker",
        "orders-worker-sandbox",
    }


def test_stack_otlp_endpoint_reaches_every_pool_but_the_sandbox(
    default_project: Path, tmp_path: Path
) -> None:
    endpoint = "http://otel-collector.observability.svc:4318"

    def trace(config: dict[str, Any]) -> None:
        config["otlpEndpoint"] = endpoint

    project = edited_copy(default_project, tmp_path, "dev", trace)
    result = make_manifests(project, "dev")
    assert result.returncode == 0, result.stderr
    objects = list(
        yaml.safe_load_all((project / "build/manifests/dev.yaml").read_text())
    )
    pools = {d["metadata"]["name"]: pod_env(d) for d in workers(objects)}
    sandboxed = {name for name in pools if "sandbox" in name}
    assert sandboxed and len(pools) > len(sandboxed)
    for name, env in pools.items():
        if (
            name in sandboxed
        ):  # egress is DNS + broker only: exporting could only time out
            assert (
                "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
                and env["OTEL_SDK_DISABLED"] == "true"
            )
        else:
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint, name
    # Without the key nothing is set: tracing stays off.
    assert make_manifests(default_project, "dev").returncode == 0
    text = (default_project / "build/manifests/dev.yaml").read_text()
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in text


# ---- the first `pulumi up` on a real cluster (#24) -----------------------------------------


@pytest.mark.parametrize(("context", "stack"), CASES)
def test_the_pools_file_is_an_immutable_config_map_named_by_its_content(
    rendered: Any, context: str, stack: str
) -> None:
    """Each ReplicaSet reads its own file: a changed file is a new ConfigMap (and so a new
    pod template), never an edit under running pods. Each pool mounts its own
    (``<project>-<pool>-pools-<sha>``), the scheduler the routing and schedules
    (``<project>-pools-<sha>``)."""
    project, objects = rendered[context, stack]
    for config_map in of_kind(objects, "ConfigMap"):
        text = config_map["data"]["pools.toml"]
        digest = hashlib.sha256(text.encode()).hexdigest()
        assert config_map["immutable"] is True
        assert config_map["metadata"]["name"].startswith(project.name)
        assert config_map["metadata"]["name"].endswith(f"-pools-{digest[:10]}")
    mounted = set()
    for deployment in of_kind(objects, "Deployment"):
        config_map = mounted_config_map(objects, deployment)
        pool = pod_env(deployment).get("WORKER_POOL")
        slug = f"-{pool.replace('_', '-')}" if pool else ""
        digest = hashlib.sha256(config_map["data"]["pools.toml"].encode()).hexdigest()
        assert config_map["metadata"]["name"] == f"{project.name}{slug}-pools-{digest[:10]}"
        mounted.add(config_map["metadata"]["name"])
    assert mounted == {c["metadata"]["name"] for c in of_kind(objects, "ConfigMap")}


def test_a_stack_override_of_one_pool_is_a_new_config_map_of_that_pool_alone(
    rendered: Any, default_project: Path, tmp_path: Path
) -> None:
    """bulk's backlog target changed in the stack file: bulk's ConfigMap is new, every
    other pool's and the scheduler's are the same, so no other Deployment rolls."""

    def younger(config: dict[str, Any]) -> None:
        config["pools"]["bulk"]["backlog_age_target_s"] = 7

    _, before = rendered["default", "dev"]
    _, after = overridden(default_project, tmp_path, "dev", younger)
    names = [
        {c["metadata"]["name"] for c in of_kind(o, "ConfigMap")}
        for o in (before, after)
    ]
    (gone,), (new,) = names[0] - names[1], names[1] - names[0]
    assert "-bulk-pools-" in gone and "-bulk-pools-" in new
    templates = [
        {d["metadata"]["name"]: d["spec"]["template"] for d in of_kind(o, "Deployment")}
        for o in (before, after)
    ]
    assert [n for n in templates[0] if templates[0][n] != templates[1][n]] == [
        next(n for n in templates[0] if n.endswith("-bulk"))
    ]


def rollout_rows(objects: Objects) -> list[tuple[str, int, int, int, int]]:
    """(pool, replicas, minReadySeconds, grace, Pulumi's timeout) of each Deployment,
    recomputed from the rendered objects: steps of one pod (start + minReadySeconds),
    then the last old pod's grace."""
    from worker_infra.rollout import POD_START_S, TIMEOUT_ANNOTATION

    caps = {
        s["spec"]["scaleTargetRef"]["name"]: s["spec"]["maxReplicaCount"]
        for s in of_kind(objects, "ScaledObject")
    }
    rows = []
    for d in of_kind(objects, "Deployment"):
        name, spec = d["metadata"]["name"], d["spec"]
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
        replicas = caps.get(name, spec["replicas"])
        ready = spec.get("minReadySeconds", 0)
        grace = spec["template"]["spec"]["terminationGracePeriodSeconds"]
        timeout = int(d["metadata"]["annotations"][TIMEOUT_ANNOTATION])
        assert timeout == max(1, replicas) * (POD_START_S + ready) + grace, name
        rows.append((name.split("-")[-1], replicas, ready, grace, timeout))
    return rows


def test_pulumis_waits_are_bounded_by_each_rollout_and_documented(
    rendered: Any,
) -> None:
    """Every Deployment carries pulumi.com/timeoutSeconds sized from its own rollout (the
    default 10 minutes fails `pulumi up` in the middle of prod's bulk rollout); the table
    in docs/infra.md is these numbers."""
    from bakery import TEMPLATE

    docs = (TEMPLATE / "docs" / "infra.md").read_text()
    for stack in STACKS:
        for pool, replicas, ready, grace, timeout in rollout_rows(
            rendered["default", stack][1]
        ):
            row = (
                f"| {stack} | {pool} | {replicas} | {ready} | {grace} | {timeout} s "
                f"({round(timeout / 60)} min) |"
            )
            assert row in docs, row
    bulk = {r[0]: r[4] for r in rollout_rows(rendered["default", "prod"][1])}["bulk"]
    assert bulk > 600


@pytest.mark.parametrize(("context", "stack"), CASES)
def test_a_mutable_tag_is_pulled_always(
    rendered: Any, context: str, stack: str
) -> None:
    _, objects = rendered[context, stack]
    for deployment in of_kind(objects, "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert ":" in container["image"] and "@sha256:" not in container["image"]
        assert container["imagePullPolicy"] == "Always"
        skips = " ".join(deployment["metadata"]["annotations"].values())
        assert "CKV_K8S_15" not in skips and "CKV_K8S_43" in skips


def test_a_digest_is_pulled_if_not_present(
    default_project: Path, tmp_path: Path
) -> None:
    image = "registry.example.com/orders-worker@sha256:" + "0" * 64

    def pin(config: dict[str, Any]) -> None:
        config["image"] = image

    _, objects = overridden(default_project, tmp_path, "prod", pin)
    for deployment in of_kind(objects, "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["image"] == image
        assert container["imagePullPolicy"] == "IfNotPresent"
        skips = " ".join(deployment["metadata"]["annotations"].values())
        assert (
            "CKV_K8S_15=IfNotPresent on purpose: the image is pinned by digest" in skips
        )
        assert "CKV_K8S_43" not in skips


def test_sandbox_egress_for_node_local_dns_and_a_broker_by_address(
    default_project: Path, tmp_path: Path
) -> None:
    def outside(config: dict[str, Any]) -> None:
        config["redis"]["cidr"] = "10.0.12.0/28"
        config["sandbox"]["nodeLocalDns"] = "169.254.20.10"

    _, objects = overridden(default_project, tmp_path / "a", "prod", outside)
    blocks = ("10.0.12.0/28", "169.254.20.10/32")
    assert sandbox_problems(objects, "orders-worker-sandbox", ip_blocks=blocks) == []
    policies = {
        p["metadata"]["name"]: p["spec"]
        for p in of_kind(objects, "NetworkPolicy")
        if p["metadata"]["namespace"] == "orders-worker-sandbox"
    }
    assert policies["allow-broker"]["egress"][0]["to"] == [
        {"ipBlock": {"cidr": "10.0.12.0/28"}}
    ]
    assert {"ipBlock": {"cidr": "169.254.20.10/32"}} in policies["allow-dns"]["egress"][
        0
    ]["to"]

    def typo(config: dict[str, Any]) -> None:
        config["redis"]["cidr"] = "10.0.12.300"

    stderr = refused(edited_copy(default_project, tmp_path / "b", "prod", typo), "prod")
    assert (
        "sandbox egress: redis.cidr '10.0.12.300' is not an address or CIDR" in stderr
    )


#: Run the baked program as `pulumi preview` would, on a cluster the test describes.
PREFLIGHT_SCRIPT = """
import json, runpy, sys
from worker_infra import GuardError, preflight

class Cluster:
    def __init__(self, crds, runtime_classes):
        self.crds, self.runtime_classes = set(crds), set(runtime_classes)
    def has_crd(self, name):
        return name in self.crds
    def has_runtime_class(self, name):
        return name in self.runtime_classes
    def deployment_selector(self, namespace, name):
        return None

render = runpy.run_path(sys.argv[1])
with preflight.using(Cluster(**json.loads(sys.argv[3]))):
    try:
        objects = render["stack_objects"](sys.argv[2])
    except GuardError as error:
        print(error)
        sys.exit(3)
print(len(objects), "objects")
"""


def preview(project: Path, stack: str, tmp_path: Path, **cluster: list[str]) -> Any:
    script = tmp_path / "preview.py"
    script.write_text(PREFLIGHT_SCRIPT)
    return subprocess.run(
        [
            PYTHON,
            str(script),
            str(project / "infra" / "render.py"),
            stack,
            json.dumps(cluster),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_first_preview_on_a_bare_cluster_names_each_step(
    default_project: Path, tmp_path: Path
) -> None:
    """A fresh prod stack on a cluster without KEDA, the Prometheus Operator or gVisor, the
    sandbox's ACL user not yet installed: one line per step, nothing created; with the
    steps taken (or the stack options for a cluster without them) it renders."""
    from worker_infra.preflight import KEDA_CRDS

    result = preview(default_project, "prod", tmp_path, crds=[], runtime_classes=[])
    assert result.returncode == 3, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 5 and all(line.startswith("preflight: ") for line in lines)
    assert "KEDA is not installed" in lines[0]
    assert "podmonitors.monitoring.coreos.com" in lines[1]
    assert "prometheusrules.monitoring.coreos.com" in lines[2]
    assert "RuntimeClass 'gvisor'" in lines[3]
    assert "ACL SETUSER orders-worker-sandbox" in lines[4]

    def bare_cluster(config: dict[str, Any]) -> None:
        config["podMonitor"] = False
        config["prometheusRule"] = False
        config["sandbox"] = {"brokerAclInstalled": True}

    project = edited_copy(default_project, tmp_path / "bare", "prod", bare_cluster)
    result = preview(
        project, "prod", tmp_path, crds=list(KEDA_CRDS), runtime_classes=[]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("objects")


# ---- the simulation ------------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_the_rendered_scalers_meet_the_goals_in_simulation(
    rendered: Any, stack: str
) -> None:
    """The HPA algorithm as each rendered ScaledObject configures it, against the queue
    model: back under the age target within 3 minutes of a 10x step, never above the cap or
    a budget, at most 2 direction changes per hour under a steady load."""
    from worker_infra.simulate import problems, run

    _, objects = rendered["default", stack]
    results = run(objects)
    assert {r.pool for r in results} == {
        pod_env(d)["WORKER_POOL"] for d in workers(objects)
    }
    assert {r.case for r in results} == {
        "10x step",
        "spike 20x 60s",
        "diurnal 1x-5.5x",
        "steady 5x",
    }
    assert problems(results) == []
    for result in results:
        if result.case == "10x step":
            assert result.peak_replicas > min(2, result.cap - 1) or result.cap == 1


def test_make_simulate_prints_the_table(default_project: Path) -> None:
    result = subprocess.run(
        ["make", "-s", "simulate", "SIM_STACKS=dev", f"PYTHON={PYTHON}"],
        cwd=default_project,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "## stack dev" in result.stdout
    assert "| interactive | 10x step |" in result.stdout
    assert "goal missed" not in result.stdout


# ---- a fresh bake, following its README -----------------------------------------------------


@pytest.mark.slow
def test_a_fresh_bake_renders_prod_following_its_readme(tmp_path: Path) -> None:
    """`make infra-install` then `make manifests STACK=<each>`, with worker-infra and
    worker-runtime installed from their git pins (a repository of this checkout's infra/ and
    runtime/, tagged), in a venv of the system Python, as the baked README says."""
    from bakery import TEMPLATE, bake_project

    repo = tmp_path / "worker-template"
    for library in ("infra", "runtime"):
        shutil.copytree(
            TEMPLATE / library,
            repo / library,
            ignore=shutil.ignore_patterns("tests", "*.egg-info", "__pycache__", ".*_cache"),
        )
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    for command in (
        ["init", "-q"],
        ["add", "-A"],
        ["commit", "-qm", "infra"],
        ["tag", "v9.9.9"],
    ):
        subprocess.run([*git, *command], cwd=repo, check=True, capture_output=True)
    project = bake_project(
        tmp_path / "out", template_repo=f"file://{repo}", _template_ref="v9.9.9"
    )
    # Its recorded source (this checkout, which infra-install would prefer) left out: the pins.
    (project / "template-source.mk").unlink()
    readme = (project / "README.md").read_text()
    assert "make infra-install" in readme and "make manifests STACK=prod" in readme
    python = shutil.which("python3") or PYTHON
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VIRTUAL_ENV", "PYTHON"))
    }
    targets = [["infra-install", f"PYTHON={python}"]]
    targets += [["manifests", f"STACK={stack}"] for stack in STACKS]
    for target in targets:
        result = subprocess.run(
            ["make", "-s", *target],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        if target[0] == "infra-install":  # it says which worker-infra it used
            assert result.stdout.startswith(
                f"worker-infra: from the pinned tag git+file://{repo}@v9.9.9"
            ), result.stdout
    for stack in STACKS:
        path = project / "build" / "manifests" / f"{stack}.yaml"
        assert len(workers(list(yaml.safe_load_all(path.read_text())))) == 5, stack
