"""The baked service's infra: `make manifests` for every stack, strictly valid, policies hold,
and stacks that break a guard are refused with the pools and numbers named."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from worker_infra.policy import (
    cpu_trigger_problems,
    isolation_problems,
    of_kind,
    restricted_problems,
    sandbox_problems,
    validate_strict,
)

from bakery import PYTHON

STACKS = ("dev", "staging", "prod")
CONTEXTS = {
    "default": {},
    "minimal": {"project": "lean-worker", "database": "none", "sandbox_pool": "no"},
}
Objects = list[dict[str, Any]]


def workers(objects: Objects) -> Objects:
    """The pools' Deployments (the scheduler's is not a pool)."""
    return [
        d
        for d in of_kind(objects, "Deployment")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    ]


def make_manifests(project: Path, stack: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-s", "manifests", f"STACK={stack}", f"PYTHON={PYTHON}"],
        check=False,
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )


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
def test_every_object_validates_strictly(rendered: Any, context: str, stack: str) -> None:
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
    (scheduler,) = [d for d in of_kind(objects, "Deployment") if d not in workers(objects)]
    assert scheduler["metadata"]["name"] == f"{project.name}-scheduler"
    assert scheduler["spec"]["replicas"] == 2
    assert scheduler["spec"]["template"]["spec"]["containers"][0]["command"] == [
        project.name,
        "scheduler",
    ]
    assert "WORKER_POOL" not in _env(scheduler) and "DATABASE_URL" not in _env(scheduler)
    targets = {s["spec"]["scaleTargetRef"]["name"] for s in of_kind(objects, "ScaledObject")}
    assert scheduler["metadata"]["name"] not in targets
    sandbox_ns = f"{project.name}-sandbox"
    if context == "default":
        assert sandbox_problems(objects, sandbox_ns) == []
    else:
        assert not [o for o in objects if o["metadata"].get("namespace") == sandbox_ns]
        assert not [o for o in of_kind(objects, "Secret") if "database" in o["metadata"]["name"]]
        assert "DATABASE_URL" not in (project / "build" / "manifests" / f"{stack}.yaml").read_text()


def _env(deployment: dict[str, Any]) -> dict[str, Any]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def stack_config(project: Path, stack: str) -> dict[str, Any]:
    data = yaml.safe_load((project / "infra" / f"Pulumi.{stack}.yaml").read_text())["config"]
    return {k.split(":", 1)[1]: v for k, v in data.items()}


@pytest.mark.parametrize(("context", "stack"), CASES)
def test_capacity_inequality_holds_in_the_rendered_objects(
    rendered: Any, context: str, stack: str
) -> None:
    """Recomputed from the rendered Deployments and ScaledObjects, not from worker_infra."""
    project, objects = rendered[context, stack]
    pools_toml = tomllib.loads((project / "pools.toml").read_text())
    budgets = {
        name: {**d, **stack_config(project, stack).get("downstream", {}).get(name, {})}
        for name, d in pools_toml.get("downstream", {}).items()
    }
    max_replicas = {
        s["spec"]["scaleTargetRef"]["name"]: s["spec"]["maxReplicaCount"]
        for s in of_kind(objects, "ScaledObject")
    }
    used = dict.fromkeys(budgets, 0)
    for deployment in workers(objects):
        env = _env(deployment)
        uses = pools_toml["pools"][env["WORKER_POOL"]].get("uses", [])
        replicas = max_replicas[deployment["metadata"]["name"]]
        for name in uses:
            per = budgets[name].get("per_process", "db_pool_size")
            per_process = int(
                env["DB_POOL_SIZE"] if per == "db_pool_size" else env["WORKER_CONCURRENCY"]
            )
            used[name] += replicas * int(env["WORKER_PROCESSES"]) * per_process
    for name, budget in budgets.items():
        assert used[name] <= budget["capacity"] - budget["reserved"], (stack, name, used[name])


def test_numbers_render_as_integers_and_secrets_stay_secret(rendered: Any) -> None:
    project, objects = rendered["default", "prod"]
    (interactive,) = [
        d for d in of_kind(objects, "Deployment") if d["metadata"]["name"].endswith("interactive")
    ]
    assert type(interactive["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]) is int
    assert all(type(s["spec"]["maxReplicaCount"]) is int for s in of_kind(objects, "ScaledObject"))
    assert all(set(s["stringData"].values()) == {"<secret>"} for s in of_kind(objects, "Secret"))
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
        config["pools"]["interactive"]["max_replicas"] = 3  # staging: 3 x 8 = 24 ...
        config["pools"]["bulk"]["max_replicas"] = 10  # ... + 10 x 2 x 2 = 40 + critical 2 x 4 = 8

    stderr = refused(edited_copy(default_project, tmp_path, "staging", grow), "staging")
    ours = [line for line in stderr.splitlines() if not line.startswith("make")]
    assert len(ours) == 1 and ours[0].startswith("manifests: stack 'staging' refused: ")
    assert "postgres: pools use 72 > budget 60 (capacity 100 - reserved 40)" in stderr
    assert "interactive 3 x 1 x 8 = 24, bulk 10 x 2 x 2 = 40, critical 2 x 1 x 4 = 8" in stderr


def test_lowered_capacity_is_refused(default_project: Path, tmp_path: Path) -> None:
    def shrink(config: dict[str, Any]) -> None:
        config["downstream"]["partner_api"] = {"capacity": 10, "reserved": 4}

    stderr = refused(edited_copy(default_project, tmp_path, "dev", shrink), "dev")
    assert "partner_api: pools use 8 > budget 6 (capacity 10 - reserved 4)" in stderr
    assert "external 1 x 1 x 4 = 4, critical 1 x 1 x 4 = 4" in stderr


def test_bad_timing_stacks_are_refused(default_project: Path, tmp_path: Path) -> None:
    def no_margin(config: dict[str, Any]) -> None:
        config["graceMarginS"] = 0

    stderr = refused(edited_copy(default_project, tmp_path / "a", "dev", no_margin), "dev")
    assert "grace period 40 s <= shutdown timeout 40000 ms" in stderr

    def slow_jobs(config: dict[str, Any]) -> None:
        config["pools"]["critical"]["job_timeout_ms"] = 45_000

    stderr = refused(edited_copy(default_project, tmp_path / "b", "prod", slow_jobs), "prod")
    assert "pools.critical" in stderr and "45000" in stderr and "40000" in stderr


def test_memory_guard_refuses_a_stack(default_project: Path, tmp_path: Path) -> None:
    def heavy(config: dict[str, Any]) -> None:
        config["pools"]["bulk"]["handler_memory"] = "256Mi"

    stderr = refused(edited_copy(default_project, tmp_path, "dev", heavy), "dev")
    assert "memory guard: pool 'bulk' needs 1216Mi" in stderr and "1Gi" in stderr


def test_stack_otlp_endpoint_reaches_every_pool_but_the_sandbox(
    default_project: Path, tmp_path: Path
) -> None:
    endpoint = "http://otel-collector.observability.svc:4318"

    def trace(config: dict[str, Any]) -> None:
        config["otlpEndpoint"] = endpoint

    project = edited_copy(default_project, tmp_path, "dev", trace)
    result = make_manifests(project, "dev")
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all((project / "build/manifests/dev.yaml").read_text()))
    pools = {d["metadata"]["name"]: _env(d) for d in workers(objects)}
    sandboxed = {name for name in pools if "sandbox" in name}
    assert sandboxed and len(pools) > len(sandboxed)
    for name, env in pools.items():
        if name in sandboxed:  # egress is DNS + broker only: exporting could only time out
            assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env and env["OTEL_SDK_DISABLED"] == "true"
        else:
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint, name
    # Without the key nothing is set: tracing stays off.
    assert make_manifests(default_project, "dev").returncode == 0
    text = (default_project / "build/manifests/dev.yaml").read_text()
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in text
