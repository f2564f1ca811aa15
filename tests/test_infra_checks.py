"""Independent checks of the rendered stacks: checkov finds no failed check on any stack (each
skip carries its reason on the object), and network-config-analyzer proves the sandbox pods
reach only DNS and the Redis pods, and only the monitoring namespace reaches them (metrics port).

Both tools pin packages the template venv pins differently (network-config-analyzer pins
PyYAML==6.0, checkov packaging<24 and networkx<2.7), so they run from their own venv
(requirements-checks.txt), created once and cached at .venv/checks.
"""

from __future__ import annotations

import copy
import fcntl
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from bakery import PYTHON, TEMPLATE, make_manifests

STACKS = ("dev", "staging", "prod")
CHECKS_REQUIREMENTS = TEMPLATE / "requirements-checks.txt"
Objects = list[dict[str, Any]]


@pytest.fixture(scope="session")
def checks_bin() -> Path:
    """The bin/ of a venv with checkov and nca (pinned), built once; a lock serialises xdist."""
    venv = Path(sys.prefix) / "checks"
    marker = venv / ".installed"
    wanted = CHECKS_REQUIREMENTS.read_text()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / "checks.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists() or marker.read_text() != wanted:
            subprocess.run([PYTHON, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run(
                [
                    str(venv / "bin" / "pip"),
                    "install",
                    "--quiet",
                    "-r",
                    str(CHECKS_REQUIREMENTS),
                ],
                check=True,
                timeout=900,
            )
            marker.write_text(wanted)
    return venv / "bin"


def render(project: Path) -> dict[str, tuple[Path, Path]]:
    """stack -> (project dir, build/manifests/<stack>.yaml), via the baked `make manifests`."""
    out = {}
    for stack in STACKS:
        result = make_manifests(project, stack)
        assert result.returncode == 0, result.stderr
        out[stack] = project, project / "build" / "manifests" / f"{stack}.yaml"
    return out


@pytest.fixture(scope="module")
def manifests(bake: Callable[..., Path]) -> dict[str, tuple[Path, Path]]:
    """The default bake's stacks (the one with a sandbox pool)."""
    return render(bake())


@pytest.fixture(scope="module")
def minimal_manifests(bake: Callable[..., Path]) -> dict[str, tuple[Path, Path]]:
    """The smallest bake's stacks (no database, no sandbox pool)."""
    return render(bake(project="lean-worker", database="none", sandbox_pool="no"))


def checkov(bin_dir: Path, files: list[Path]) -> list[dict[str, Any]]:
    args = [str(bin_dir / "checkov"), "--framework", "kubernetes", "-o", "json"]
    for file in files:
        args += ["-f", str(file)]
    # --skip-download: no call to the vendor's platform (offline, and nothing leaves the host).
    result = subprocess.run(
        [*args, "--skip-download"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.stdout.strip(), result.stderr[-2000:]
    report = json.loads(result.stdout)
    return report if isinstance(report, list) else [report]


def test_checkov_passes_every_stack_and_every_skip_has_its_reason(
    checks_bin: Path,
    manifests: dict[str, tuple[Path, Path]],
    minimal_manifests: dict[str, tuple[Path, Path]],
) -> None:
    from worker_infra.workload import CHECKOV_SKIPS

    files = [m for _, m in [*manifests.values(), *minimal_manifests.values()]]
    (report,) = checkov(checks_bin, files)
    results = report["results"]
    failed = [
        f"{f['file_path']}: {f['check_id']} {f['resource']} ({f['check_name']})"
        for f in results["failed_checks"]
    ]
    assert not failed, "\n".join(failed)
    assert report["summary"]["parsing_errors"] == 0
    checked = {Path(p["file_abs_path"]).resolve() for p in results["passed_checks"]}
    assert checked == {f.resolve() for f in files}
    # Every skip is one of ours, with our words next to it (none without a reason).
    skipped = results["skipped_checks"]
    assert skipped
    for check in skipped:
        assert check["check_id"] in CHECKOV_SKIPS, check["check_id"]
        assert (
            check["check_result"]["suppress_comment"]
            == CHECKOV_SKIPS[check["check_id"]]
        )
        assert check["resource"].startswith("Deployment."), check["resource"]


def test_checkov_would_fail_without_the_reasoned_skips(
    checks_bin: Path, manifests: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """The skips are what stands between the stack and a failure, and nothing else is skipped:
    stripped of its annotations, prod fails exactly the skipped checks, on exactly the
    Deployments that carried them (the sandbox has a CPU limit: no CKV_K8S_11 skip; a tag
    is pulled Always: no CKV_K8S_15 skip)."""
    from worker_infra.workload import CHECKOV_SKIPS

    _, prod = manifests["prod"]
    objects = list(yaml.safe_load_all(prod.read_text()))
    carried = set()
    for obj in objects:
        annotations = obj["metadata"].get("annotations", {})
        for key in [k for k in annotations if k.startswith("checkov.io/skip")]:
            check = annotations.pop(key).split("=", 1)[0]
            carried.add(
                (
                    check,
                    f"{obj['kind']}.{obj['metadata']['namespace']}."
                    f"{obj['metadata']['name']}",
                )
            )
    assert {check for check, _ in carried} == set(CHECKOV_SKIPS) - {"CKV_K8S_15"}
    assert not [c for c in carried if c[0] == "CKV_K8S_11" and "sandbox" in c[1]]
    stripped = tmp_path / "prod.yaml"
    stripped.write_text(yaml.safe_dump_all(objects))
    (report,) = checkov(checks_bin, [stripped])
    assert not report["results"]["skipped_checks"]
    failed = {
        (f["check_id"], f["resource"]) for f in report["results"]["failed_checks"]
    }
    assert {check for check, _ in failed} == {check for check, _ in carried}
    assert {r for c, r in failed if c == "CKV_K8S_11"} == {
        r for c, r in carried if c == "CKV_K8S_11"
    }


# --- NetworkPolicy connectivity (network-config-analyzer) ----------------------------------


def namespace(name: str) -> dict[str, Any]:
    # The API server sets kubernetes.io/metadata.name on every namespace; nca needs it given.
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}},
    }


def pod(
    name: str, ns: str, labels: dict[str, str], port: int, protocol: str = "TCP"
) -> Any:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "containers": [
                {
                    "name": name,
                    "image": "example",
                    "ports": [{"containerPort": port, "protocol": protocol}],
                }
            ]
        },
    }


def cluster(
    project: Path, stack: str, rendered: Objects
) -> tuple[Objects, dict[str, Any]]:
    """The stack's Namespaces, Deployments and NetworkPolicies, plus the cluster around them as
    the stack config describes it: kube-dns in kube-system, the Redis pods (namespace and
    selector from the stack's `redis`), a Prometheus in the monitoring namespace, and decoys
    (a non-DNS pod in kube-system, a non-Redis pod beside Redis, a pod in `default`, a second
    pod in the sandbox namespace) that must stay unreachable."""
    config = yaml.safe_load((project / "infra" / f"Pulumi.{stack}.yaml").read_text())[
        "config"
    ]
    name = yaml.safe_load((project / "infra" / "Pulumi.yaml").read_text())["name"]
    redis = config[f"{name}:redis"]
    monitoring = config.get(f"{name}:monitoringNamespace", "monitoring")
    objects = [
        copy.deepcopy(o)
        for o in rendered
        if o["kind"] in ("Namespace", "Deployment", "NetworkPolicy")
    ]
    for obj in objects:
        if obj["kind"] == "Namespace":
            obj["metadata"]["labels"]["kubernetes.io/metadata.name"] = obj["metadata"][
                "name"
            ]
    (sandbox,) = [
        o
        for o in objects
        if o["kind"] == "Deployment"
        and o["spec"]["template"]["metadata"]["labels"].get("worker-template/pool")
        == "sandbox"
    ]
    # A pool at zero (dev) has no pod to analyse; two replicas also keep nca from reporting a
    # lone pod's connection to itself as an edge inside the namespace.
    sandbox["spec"]["replicas"] = max(2, sandbox["spec"]["replicas"])
    sandbox_ns = sandbox["metadata"]["namespace"]
    redis_ns = redis["namespace"]
    objects += [
        namespace("kube-system"),
        namespace(redis_ns),
        namespace(monitoring),
        namespace("default"),
        pod("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, 53, "UDP"),
        pod("metrics-server", "kube-system", {"k8s-app": "metrics-server"}, 443),
        pod("redis", redis_ns, redis["podSelector"], redis.get("port", 6379)),
        pod(
            "redis-exporter",
            redis_ns,
            {"app.kubernetes.io/name": "redis-exporter"},
            9121,
        ),
        pod("prometheus", monitoring, {"app.kubernetes.io/name": "prometheus"}, 9090),
        pod("intruder", "default", {"app": "intruder"}, 8080),
        pod("neighbour", sandbox_ns, {"app": "neighbour"}, 8080),
    ]
    facts = {
        "sandbox": sandbox_ns,
        "redis": (redis_ns, redis.get("port", 6379)),
        "monitoring": monitoring,
        "metrics_port": sandbox["spec"]["template"]["spec"]["containers"][0]["ports"][
            0
        ]["containerPort"],
    }
    return objects, facts


def connectivity(
    bin_dir: Path, objects: Objects, tmp_path: Path
) -> list[dict[str, Any]]:
    """nca's connectivity map (per pod) as rules: src, dst, connections."""
    resources = tmp_path / "resources.yaml"
    resources.write_text(yaml.safe_dump_all(objects))
    (tmp_path / "connectivity.yaml").unlink(
        missing_ok=True
    )  # nca appends to --file_out
    result = subprocess.run(
        [
            str(bin_dir / "nca"),
            "--connectivity",
            "-r",
            str(resources),
            "-o",
            "yaml",
            "--output_endpoints",
            "pods",
            "--file_out",
            str(tmp_path / "connectivity.yaml"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (query,) = yaml.safe_load((tmp_path / "connectivity.yaml").read_text())
    rules: list[dict[str, Any]] = []
    for explanation in query["explanation"]:
        rules += explanation["rules"]
    return rules


def conn(rule: dict[str, Any]) -> set[tuple[str, int]]:
    out = set()
    for c in rule["connection"]:
        if c == "All connections":
            out.add(("ALL", 0))
        else:
            out |= {(c["Protocol"], port) for port in c["Ports"]}
    return out


def sandbox_edges(rules: list[dict[str, Any]], sandbox: str) -> set[tuple[Any, ...]]:
    """Every allowed edge into or out of the sandbox namespace: (direction, peer ns or
    ip block, peer pods, connections)."""
    edges: set[tuple[Any, ...]] = set()
    for rule in rules:
        src, dst = rule.get("src_ns", []), rule.get("dst_ns", [])
        if sandbox in src:
            assert rule.get("src_pods") == ["*"], rule
            peer = tuple(dst) or tuple(rule["dst_ip_block"])
            edges.add(
                ("out", peer, tuple(rule.get("dst_pods", [])), frozenset(conn(rule)))
            )
        if sandbox in dst:
            assert rule.get("dst_pods") == ["*"], rule
            peer = tuple(src) or tuple(rule["src_ip_block"])
            edges.add(
                ("in", peer, tuple(rule.get("src_pods", [])), frozenset(conn(rule)))
            )
    return edges


def expected_edges(facts: dict[str, Any]) -> set[tuple[Any, ...]]:
    redis_ns, redis_port = facts["redis"]
    return {
        ("out", ("kube-system",), ("kube-dns",), frozenset({("TCP", 53), ("UDP", 53)})),
        ("out", (redis_ns,), ("redis",), frozenset({("TCP", redis_port)})),
        (
            "in",
            (facts["monitoring"],),
            ("*",),
            frozenset({("TCP", facts["metrics_port"])}),
        ),
    }


@pytest.mark.parametrize("stack", STACKS)
def test_sandbox_reaches_only_dns_and_redis_and_only_monitoring_reaches_it(
    checks_bin: Path,
    manifests: dict[str, tuple[Path, Path]],
    stack: str,
    tmp_path: Path,
) -> None:
    project, manifest = manifests[stack]
    objects, facts = cluster(
        project, stack, list(yaml.safe_load_all(manifest.read_text()))
    )
    edges = sandbox_edges(connectivity(checks_bin, objects, tmp_path), facts["sandbox"])
    assert edges == expected_edges(facts)


def policy(objects: Objects, name: str) -> dict[str, Any]:
    (found,) = [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == name
    ]
    return found


def test_the_analysis_sees_a_widened_policy(
    checks_bin: Path, manifests: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """The analysis is not vacuous: a scrape rule admitting every namespace, or a broker rule
    without its pod selector, shows up as the extra edges it opens."""
    project, manifest = manifests["prod"]
    objects, facts = cluster(
        project, "prod", list(yaml.safe_load_all(manifest.read_text()))
    )
    open_scrape = copy.deepcopy(objects)
    policy(open_scrape, "allow-scrape")["spec"]["ingress"][0]["from"] = [
        {"namespaceSelector": {}}
    ]
    edges = sandbox_edges(
        connectivity(checks_bin, open_scrape, tmp_path), facts["sandbox"]
    )
    assert any(e[0] == "in" and "default" in e[1] for e in edges), edges
    any_pod = copy.deepcopy(objects)
    del policy(any_pod, "allow-broker")["spec"]["egress"][0]["to"][0]["podSelector"]
    edges = sandbox_edges(connectivity(checks_bin, any_pod, tmp_path), facts["sandbox"])
    redis_ns, _ = facts["redis"]
    assert ("out", (redis_ns,), ("*",), frozenset({("TCP", 6379)})) in edges, edges
