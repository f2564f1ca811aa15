#!/usr/bin/env python3
"""``make e2e``: a fresh bake's dev stack through the real Pulumi engine and the real
Kubernetes provider, against a real API server (:mod:`cluster`), read back from the API.

The engines come from ``scripts/e2e/build.py`` (``make e2e-build``); without them this
exits 2 naming the command. The Pulumi program is the bake's own ``infra/__main__.py``, run
as an Automation API inline program (the language host is not needed) with the bake's stack
file ``infra/Pulumi.dev.yaml`` as its config, a local file backend, and the built ``pulumi``
and ``pulumi-resource-kubernetes`` first on ``PATH``.

Steps (each prints its name and time; the first failed assertion stops the run, exit 1):

1. preflight: a preview against the bare cluster stops with one line per missing
   prerequisite (the KEDA and Prometheus Operator CRDs, the sandbox ACL user);
2. preview and up of the dev stack, the sandbox pool at one replica: the engine's counts, the
   objects in the API server, every pool's pods admitted (PodSecurity ``restricted``, the
   sandbox's ResourceQuota and LimitRange) and Ready;
3. a one-line pools.toml change to one pool: only its Deployment rolls, the other pools'
   pods and ReplicaSets stay, its old pods keep their old ConfigMap while they exist;
4. the rollback of that change: the pool alone rolls back onto the first up's ConfigMap,
   made again under its content name; the changed config is gone after its pods;
5. a change that forces replacement (the sandbox's namespace): the new pool exists and is
   Ready before the old one is deleted: the pool is never without a Ready pod;
6. wrong stacks refused by the real admission, the pool named in the engine's error, each
   refused ``up`` bounded by a short custom timeout (:data:`REFUSED_WAIT_S`): a sandbox
   quota too small for a rollout (its CPU below one pod's request: the next rollout's pod
   is refused by ResourceQuota) and a sandbox pod asking for a capability (PodSecurity);
7. destroy: nothing of the stack left in the API server.

``make e2e`` runs it (tests/test_e2e_cluster.py, which checks every step's ``ok`` line).

Usage: ``run.py [--keep DIR]`` (``--keep``: work in DIR and leave it, logs included).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import runpy
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parents[1]
sys.path.insert(0, str(HERE))

import build  # noqa: E402
import cluster as cl  # noqa: E402

PROJECT = "orders-worker"
NAMESPACE = PROJECT
SANDBOX_NS = f"{PROJECT}-sandbox"
STACK = "dev"
PASSPHRASE = "e2e"  # the local backend's secrets passphrase (throwaway state)
POOL_LABEL = "worker-template/pool"
#: Seconds between two reads of the watcher (pods, ReplicaSets, ConfigMaps).
WATCH_S = 0.5
#: The interactive pool's drain window in the e2e's dev stack (a stack override).
INTERACTIVE_DRAIN_MS = 5000
#: The bound (the Deployment's custom timeout) of an ``up`` whose pods admission refuses.
REFUSED_WAIT_S = 15


#: The step of the bare cluster, then each scenario's step name and :class:`Run` method, in
#: order; ``make e2e``'s test (tests/test_e2e_cluster.py) reads each ``e2e: <step> ok in``.
PREFLIGHT = "preflight refuses a bare cluster"
SCENARIOS = {
    "preview and up (dev stack)": "first_up",
    "one pool's change rolls that pool alone": "one_pool_change",
    "rollback restores the first config": "rollback",
    "replacement keeps a Ready pod": "replacement",
    "wrong stacks refused by the real admission": "refused",
    "destroy leaves nothing": "destroy",
}


class Failed(AssertionError):
    """An e2e assertion failed; the message says what was expected and what was read."""


def check(condition: object, message: str) -> None:
    if not condition:
        raise Failed(message)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(name: str, times: dict[str, float]) -> Iterator[None]:
    say(f"e2e: {name} ...")
    started = time.monotonic()
    try:
        yield
    except BaseException:
        say(f"e2e: {name} FAILED after {time.monotonic() - started:.1f} s")
        raise
    took = time.monotonic() - started
    times[name] = took
    say(f"e2e: {name} ok in {took:.1f} s")


# ---- the engines --------------------------------------------------------------------------


def engine_dirs(names: tuple[str, ...] = build.KWOK_E2E) -> list[Path]:
    """The built engines' folders; exit 2 naming the build command when one is missing."""
    cache = build.cache_dir()
    engines = [build.ENGINES[n] for n in names]
    missing = [e.key for e in engines if not (cache / "bin" / e.key / ".ok").exists()]
    if missing:
        say(f"e2e: engines not built in {cache}: {', '.join(missing)}; run `make e2e-build` "
            "(cold: about 50 min on 2 cores)")
        raise SystemExit(2)
    return [cache / "bin" / e.key for e in engines]


# ---- the bake and its stack ---------------------------------------------------------------


def bake(work: Path) -> Path:
    """A fresh bake of the template's defaults (``orders-worker``)."""
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(work)))


def edit_yaml(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    import yaml

    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def key(name: str) -> str:
    return f"{PROJECT}:{name}"


@dataclass
class Deployer:
    """The bake's dev stack under the Automation API (inline program, local backend)."""

    project: Path
    state: Path
    kubeconfig: Path
    transforms: list[Callable[[Any], Any]] = field(default_factory=list)

    @property
    def infra(self) -> Path:
        return self.project / "infra"

    def program(self) -> None:
        import pulumi

        for transform in self.transforms:
            pulumi.runtime.register_resource_transform(transform)
        for path in (str(self.project / "src"), str(self.infra)):
            if path not in sys.path:
                sys.path.insert(0, path)
        runpy.run_path(str(self.infra / "__main__.py"), run_name="__main__")

    def stack(self) -> Any:
        from pulumi import automation as auto

        (self.state / "backend").mkdir(parents=True, exist_ok=True)
        return auto.create_or_select_stack(
            stack_name=STACK,
            project_name=PROJECT,
            program=self.program,
            opts=auto.LocalWorkspaceOptions(
                work_dir=str(self.infra),
                pulumi_home=str(self.state / "home"),
                env_vars={
                    "PULUMI_BACKEND_URL": f"file://{self.state / 'backend'}",
                    "PULUMI_CONFIG_PASSPHRASE": PASSPHRASE,
                    "KUBECONFIG": str(self.kubeconfig),
                    "PULUMI_SKIP_UPDATE_CHECK": "true",
                    "PULUMI_DIY_BACKEND_NO_LEGACY_WARNING": "true",
                },
            ),
        )


class Ops:
    """The engine's per-resource operations of one run (its events), by URN, and its error
    diagnostics as (URN, message)."""

    def __init__(self) -> None:
        self.by_urn: dict[str, list[str]] = {}
        self.errors: list[tuple[str, str]] = []

    def __call__(self, event: Any) -> None:
        pre = getattr(event, "resource_pre_event", None)
        if pre is not None and pre.metadata is not None:
            op = str(getattr(pre.metadata.op, "value", pre.metadata.op))
            self.by_urn.setdefault(pre.metadata.urn, []).append(op)
        diagnostic = getattr(event, "diagnostic_event", None)
        if diagnostic is not None and diagnostic.severity == "error":
            self.errors.append((diagnostic.urn or "", diagnostic.message))

    def changed(self) -> dict[str, str]:
        """URN (type::name) -> its ops, joined by ``+`` (a replacement is
        ``create-replacement+replace+delete-replaced``), of every resource the run did not
        leave the same."""
        return {
            urn.split("::", 2)[-1]: "+".join(ops) for urn, ops in self.by_urn.items()
            if set(ops) - {"same", "read"}
        }


# ---- reading the API server ---------------------------------------------------------------


@dataclass
class Snapshot:
    at: float
    pods: list[dict[str, Any]]
    config_maps: set[tuple[str, str]]


def is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def mounted(pod: Mapping[str, Any]) -> str | None:
    for volume in pod["spec"].get("volumes", []):
        if "configMap" in volume and volume["name"] == "pools":
            return str(volume["configMap"]["name"])
    return None


class Watcher:
    """Reads every pod and ConfigMap of the service every :data:`WATCH_S` while a run goes
    on; the snapshots are what the assertions of the transitions read."""

    def __init__(self, cluster: cl.Cluster) -> None:
        self.cluster = cluster
        self.snapshots: list[Snapshot] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()

    def _read(self) -> None:
        selector = f"app.kubernetes.io/name={PROJECT}"
        pods = self.cluster.api("GET", f"/api/v1/pods?labelSelector={selector}")["items"]
        maps = self.cluster.api("GET", f"/api/v1/configmaps?labelSelector={selector}")["items"]
        self.snapshots.append(Snapshot(
            time.monotonic(),
            pods,
            {(m["metadata"]["namespace"], m["metadata"]["name"]) for m in maps},
        ))

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            with contextlib.suppress(Exception):
                self._read()

    def pods_of(self, pool: str) -> list[list[dict[str, Any]]]:
        return [
            [p for p in s.pods if p["metadata"]["labels"].get(POOL_LABEL) == pool]
            for s in self.snapshots
        ]

    def fewest_serving(self, pool: str) -> int:
        """The fewest pods of ``pool`` Ready and not terminating in any snapshot."""
        return min(
            sum(1 for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp"))
            for pods in self.pods_of(pool)
        )


def api_list(cluster: cl.Cluster, path: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.api("GET", path)["items"]
    return items


def deployments(cluster: cl.Cluster) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d
        for d in api_list(cluster, f"/apis/apps/v1/deployments?labelSelector="
                                   f"app.kubernetes.io/name={PROJECT}")
    }


def replica_sets(cluster: cl.Cluster, pool: str) -> list[dict[str, Any]]:
    return api_list(cluster, f"/apis/apps/v1/replicasets?labelSelector={POOL_LABEL}={pool}")


def cpu_millis(quantity: str) -> int:
    """A CPU quantity (``"250m"``, ``"1"``) in millicores."""
    return int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)


def wait_until(what: str, predicate: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(cl.ApiError):
            last = predicate()
            if last:
                return last
        time.sleep(1)
    raise Failed(f"{what}: not after {timeout:.0f} s (last read: {last!r})")


# ---- the scenarios ------------------------------------------------------------------------


@dataclass
class Run:
    cluster: cl.Cluster
    deployer: Deployer
    times: dict[str, float] = field(default_factory=dict)
    numbers: dict[str, Any] = field(default_factory=dict)
    #: pools.toml and interactive's ConfigMap before the one pool's change (the rollback's).
    first_pools: str = ""
    first_config: set[str | None] = field(default_factory=set)

    def up(
        self, what: str, expect_failure: bool = False
    ) -> tuple[Any, Ops, Watcher, str]:
        """``pulumi up`` (the inline program), watched; returns (result or None, ops,
        watcher, the engine's error text). ``expect_failure``: the up must fail."""
        from pulumi import automation as auto

        ops = Ops()
        stack = self.deployer.stack()
        error = ""
        result = None
        with Watcher(self.cluster) as watcher:
            try:
                result = stack.up(on_event=ops, color="never")
            except auto.errors.CommandError as failure:
                if not expect_failure:
                    raise Failed(f"{what}: pulumi up failed:\n{str(failure)[-6000:]}") from None
                error = str(failure)
        if expect_failure:
            check(error, f"{what}: pulumi up succeeded; expected a refusal")
        elif result is not None:
            check(result.summary.result == "succeeded", f"{what}: {result.summary.result}")
        return result, ops, watcher, error

    # 1 ---------------------------------------------------------------------------------
    def preflight(self) -> None:
        """Before the CRDs and the ACL step: preview stops, one line per missing step."""
        from pulumi import automation as auto

        stack = self.deployer.stack()
        for name in ("redisPassword", "databaseUrl", "sandboxRedisPassword"):
            stack.set_config(name, auto.ConfigValue(f"e2e-{name}", secret=True))
        try:
            stack.preview(color="never")
        except auto.errors.CommandError as failure:
            text = str(failure)
        else:
            raise Failed("preview against a cluster without the CRDs succeeded")
        for needed in ("scaledobjects.keda.sh", "triggerauthentications.keda.sh",
                       "podmonitors.monitoring.coreos.com",
                       "prometheusrules.monitoring.coreos.com", "ACL SETUSER"):
            check(needed in text, f"preflight: {needed!r} not named in:\n{text[-4000:]}")
        check("e2e-sandboxRedisPassword" not in text, "preflight printed the ACL password")

    # 2 ---------------------------------------------------------------------------------
    def first_up(self) -> None:

        def dev(data: dict[str, Any]) -> None:
            config = data["config"]
            config[key("pools")]["sandbox"]["min_replicas"] = 1
            # interactive drains in 5 s, not 40 (grace 20 s, not 55): step 3 rolls it, and
            # that roll waits for the old pod's drain (it holds no downstream resource, so
            # no minReadySeconds).
            config[key("pools")]["interactive"].update(
                job_timeout_ms=INTERACTIVE_DRAIN_MS - 1000,
                shutdown_timeout_ms=INTERACTIVE_DRAIN_MS,
            )
            config.setdefault(key("sandbox"), {})["brokerAclInstalled"] = True

        edit_yaml(self.deployer.infra / "Pulumi.dev.yaml", dev)
        stack = self.deployer.stack()
        preview = stack.preview(color="never")
        planned = dict(preview.change_summary)
        check(set(planned) == {"create"} and planned["create"] > 10,
              f"preview of a fresh stack: {planned}")
        self.numbers["preview"] = planned
        started = time.monotonic()
        result, ops, watcher, _ = self.up("first up")
        self.numbers["first up s"] = round(time.monotonic() - started, 1)
        changes = dict(result.summary.resource_changes or {})
        check(changes == planned, f"up created {changes}, preview planned {planned}")
        self.numbers["created"] = changes["create"]
        live = deployments(self.cluster)
        pools = {"interactive", "bulk", "external", "critical", "sandbox"}
        expected = {f"{PROJECT}-{p}" for p in pools} | {f"{PROJECT}-scheduler"}
        check(set(live) == expected, f"Deployments {sorted(live)}, expected {sorted(expected)}")
        for name, d in live.items():
            want = d["spec"]["replicas"]
            check(d["status"].get("readyReplicas", 0) == want,
                  f"{name}: {d['status'].get('readyReplicas', 0)} of {want} Ready")
            check(d["metadata"]["annotations"].get("pulumi.com/timeoutSeconds"),
                  f"{name}: no bounded wait annotation")
        check(live[f"{PROJECT}-sandbox"]["spec"]["replicas"] == 1, "sandbox not at one replica")
        ns = self.cluster.api("GET", f"/api/v1/namespaces/{SANDBOX_NS}")
        check(ns["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") == "restricted",
              f"{SANDBOX_NS}: {ns['metadata']['labels']}")
        (sandbox_pod,) = [p for p in api_list(self.cluster, f"/api/v1/namespaces/{SANDBOX_NS}/pods")]
        check(is_ready(sandbox_pod), "the sandbox pod is not Ready")
        limits = sandbox_pod["spec"]["containers"][0]["resources"]["limits"]
        check("cpu" in limits, f"sandbox pod without a CPU limit: {limits}")
        quota = self.cluster.api(
            "GET", f"/api/v1/namespaces/{SANDBOX_NS}/resourcequotas/sandbox-quota")
        used = quota["status"]["used"]
        check(used.get("pods") == "1", f"sandbox quota counts {used}")
        self.numbers["sandbox quota"] = {"hard": quota["status"]["hard"], "used": used}
        for namespace in (NAMESPACE, SANDBOX_NS):
            for m in api_list(self.cluster, f"/api/v1/namespaces/{namespace}/configmaps"
                                            f"?labelSelector=app.kubernetes.io/name={PROJECT}"):
                check(m.get("immutable") is True, f"ConfigMap {m['metadata']['name']} mutable")
        # Every live pod: a mutable tag pulled Always; its grace outlasts its pool's drain
        # window plus the supervisor's kill-after (read from the pool file it mounts).
        import tomllib

        from worker_runtime.pools import KILL_AFTER_DRAIN_S as kill_after
        for pod in api_list(self.cluster, f"/api/v1/pods?labelSelector={POOL_LABEL}"):
            name, spec = pod["metadata"]["name"], pod["spec"]
            check(spec["containers"][0]["imagePullPolicy"] == "Always",
                  f"{name}: pull policy {spec['containers'][0]['imagePullPolicy']} for a tag")
            cm = self.cluster.api("GET", f"/api/v1/namespaces/{pod['metadata']['namespace']}"
                                         f"/configmaps/{mounted(pod)}")
            pool = pod["metadata"]["labels"][POOL_LABEL]
            entry = next(v for k, v in tomllib.loads(cm["data"]["pools.toml"])["pools"].items()
                         if k.replace("_", "-") == pool)
            drain_s = entry["shutdown_timeout_ms"] / 1000
            check(spec["terminationGracePeriodSeconds"] > drain_s + kill_after,
                  f"{name}: grace {spec['terminationGracePeriodSeconds']} s <= drain {drain_s} "
                  f"+ kill-after {kill_after}")
        classes = [c["metadata"]["name"] for c in
                   api_list(self.cluster, "/apis/scheduling.k8s.io/v1/priorityclasses")]
        check(f"{PROJECT}-{STACK}-critical-100000" in classes, f"PriorityClasses {classes}")
        scaled = api_list(self.cluster, "/apis/keda.sh/v1alpha1/scaledobjects")
        check(len(scaled) == len(pools), f"{len(scaled)} ScaledObjects")

    # 3 ---------------------------------------------------------------------------------
    def one_pool_change(self) -> None:
        """interactive's concurrency 8 -> 6 in pools.toml: one pool rolls."""
        pools_toml = self.deployer.project / "pools.toml"
        text = pools_toml.read_text()
        block = text.index("[pools.interactive]")
        head, tail = text[:block], text[block:]
        check("concurrency = 8" in tail.split("[pools.", 2)[1], "interactive concurrency not 8")
        pools_toml.write_text(head + tail.replace("concurrency = 8", "concurrency = 6", 1))
        self.first_pools = text  # what the rollback restores
        before = deployments(self.cluster)
        rs_before = {p: {r["metadata"]["name"] for r in replica_sets(self.cluster, p)}
                     for p in ("interactive", "bulk", "external", "critical", "sandbox")}
        started = time.monotonic()
        result, ops, watcher, _ = self.up("pools change")
        self.numbers["pools change up s"] = round(time.monotonic() - started, 1)
        changed = ops.changed()
        self.numbers["pools change ops"] = changed
        check(changed and all("interactive" in urn for urn in changed),
              f"a change to interactive changed {changed}")
        after = deployments(self.cluster)
        for name, d in after.items():
            rolled = d["metadata"]["generation"] != before[name]["metadata"]["generation"]
            check(rolled == (name == f"{PROJECT}-interactive"),
                  f"{name}: generation {before[name]['metadata']['generation']} -> "
                  f"{d['metadata']['generation']}")
        for pool, names in rs_before.items():
            now = {r["metadata"]["name"] for r in replica_sets(self.cluster, pool)}
            if pool == "interactive":
                check(len(now - names) == 1, f"interactive ReplicaSets {names} -> {now}")
            else:
                check(now == names, f"{pool} ReplicaSets {names} -> {now}")
        first, last = watcher.snapshots[0], watcher.snapshots[-1]
        for pool in ("critical", "sandbox"):
            uids = [{p["metadata"]["uid"] for p in pods} for pods in watcher.pods_of(pool)]
            check(all(u == uids[0] for u in uids), f"{pool}: its pods changed during the up")
        # The old interactive pods: their ConfigMap existed as long as they ran. The engine
        # deletes it once the rollout is complete, which for a pool with no minReadySeconds
        # can be while an old pod still drains (terminating): the kubelet keeps a running
        # pod's mounted files, so the drain reads its own config to the end. Then the old
        # pods end within their grace and nothing of the old config is left.
        old = [p for p in first.pods if p["metadata"]["labels"].get(POOL_LABEL) == "interactive"]
        check(old, "no interactive pod before the change")
        self.first_config = {mounted(pod) for pod in old}
        for pod in old:
            uid, cm = pod["metadata"]["uid"], mounted(pod)
            running = [s for s in watcher.snapshots if any(
                p["metadata"]["uid"] == uid and not p["metadata"].get("deletionTimestamp")
                for p in s.pods)]
            missing = [s.at - first.at for s in running if (NAMESPACE, cm) not in s.config_maps]
            check(not missing, f"old pod {pod['metadata']['name']} ran without its ConfigMap "
                               f"{cm} (gone {missing[0]:.1f} s into the up)" if missing else "")
            check((NAMESPACE, cm) not in last.config_maps, f"old ConfigMap {cm} not cleaned up")
        grace = max(p["spec"]["terminationGracePeriodSeconds"] for p in old)
        uids = {p["metadata"]["uid"] for p in old}
        wait_until("the old interactive pods gone", lambda: not uids & {
            p["metadata"]["uid"]
            for p in api_list(self.cluster, f"/api/v1/namespaces/{NAMESPACE}/pods")}, grace + 60)
        self.numbers["interactive fewest serving during the roll"] = watcher.fewest_serving(
            "interactive")

    # 4 ---------------------------------------------------------------------------------
    def rollback(self) -> None:
        """pools.toml as it was before the change (a revert): interactive alone rolls back
        onto the first up's ConfigMap, made again under its content name, and the changed
        config is gone once its pods have ended."""
        (first_config,) = self.first_config
        changed_config = {mounted(p) for p in self.interactive_pods()}
        check(first_config not in changed_config, f"interactive still on {first_config}")
        (self.deployer.project / "pools.toml").write_text(self.first_pools)
        before = deployments(self.cluster)
        started = time.monotonic()
        _, ops, watcher, _ = self.up("rollback")
        self.numbers["rollback up s"] = round(time.monotonic() - started, 1)
        changed = ops.changed()
        check(changed and all("interactive" in urn for urn in changed),
              f"a rollback of interactive changed {changed}")
        for name, d in deployments(self.cluster).items():
            rolled = d["metadata"]["generation"] != before[name]["metadata"]["generation"]
            check(rolled == (name == f"{PROJECT}-interactive"), f"{name} rolled back too")
        check((NAMESPACE, first_config) in watcher.snapshots[-1].config_maps,
              f"the first ConfigMap {first_config} not made again")
        for pool in ("critical", "sandbox"):
            uids = [{p["metadata"]["uid"] for p in pods} for pods in watcher.pods_of(pool)]
            check(all(u == uids[0] for u in uids), f"{pool}: its pods changed in the rollback")
        # Every interactive pod on the first config again, Ready; the changed one gone.
        wait_until("interactive back on its first ConfigMap", lambda: (
            pods := self.interactive_pods()) and all(
                mounted(p) == first_config and is_ready(p) for p in pods), 120)
        wait_until("the changed ConfigMap gone", lambda: not changed_config & {
            m["metadata"]["name"]
            for m in api_list(self.cluster, f"/api/v1/namespaces/{NAMESPACE}/configmaps")}, 120)

    def interactive_pods(self) -> list[dict[str, Any]]:
        """The interactive pool's pods, those terminating left out."""
        return [p for p in api_list(self.cluster, f"/api/v1/namespaces/{NAMESPACE}/pods")
                if p["metadata"]["labels"].get(POOL_LABEL) == "interactive"
                and not p["metadata"].get("deletionTimestamp")]

    # 5 ---------------------------------------------------------------------------------
    def replacement(self) -> None:
        """The sandbox's namespace changes: every sandbox object is replaced; the new pool
        is Ready before the old one goes."""
        moved = f"{SANDBOX_NS}-b"

        def move(data: dict[str, Any]) -> None:
            data["config"][key("sandbox")]["namespace"] = moved

        edit_yaml(self.deployer.infra / "Pulumi.dev.yaml", move)
        started = time.monotonic()
        result, ops, watcher, _ = self.up("replacement")
        self.numbers["replacement up s"] = round(time.monotonic() - started, 1)
        changed = ops.changed()
        self.numbers["replacement ops"] = sorted(set(changed.values()))
        check(not any(op.startswith("delete-replaced") for op in changed.values()),
              f"a delete-before-replace: {changed}")
        check(any(op.startswith("create-replacement") for op in changed.values()),
              f"no create-before-delete replacement: {changed}")
        fewest = watcher.fewest_serving("sandbox")
        self.numbers["sandbox fewest serving during the replacement"] = fewest
        check(fewest >= 1, "the sandbox pool was without a Ready pod during the replacement")
        pods = api_list(self.cluster, f"/api/v1/namespaces/{moved}/pods")
        check(len(pods) == 1 and is_ready(pods[0]), f"{moved}: pods {len(pods)}")
        wait_until(f"{SANDBOX_NS} deleted", lambda: SANDBOX_NS not in {
            n["metadata"]["name"] for n in api_list(self.cluster, "/api/v1/namespaces")}, 120)

    # 6 ---------------------------------------------------------------------------------
    def refused(self) -> None:
        """Two wrong stacks, refused by the API server's own admission, the pool named.

        A quota too small for a rollout: the sandbox's ResourceQuota below ONE pod's CPU
        request (a quota pinned while the pool grew). The running pod stays (a quota is
        judged at admission, never evicts), and the next rollout's pod is refused by the
        real ResourceQuota admission whatever the rollout strategy (a pods quota is no
        probe: with ``maxSurge 0`` the old pod is gone before the new one is retried). The
        quota is lowered in its own ``up`` first and read back from the quota controller's
        status, so the refusal never races the quota's update.

        A capability: the next rollout's pod asks for ``NET_RAW``; PodSecurity
        ``restricted`` refuses it (it runs before ResourceQuota: the quota, restored in the
        same ``up``, cannot hide it). Each refused ``up`` waits at most
        :data:`REFUSED_WAIT_S` (the Deployment's custom timeout), not the pool's own bound.
        """
        namespace = f"{SANDBOX_NS}-b"
        (pod,) = api_list(self.cluster, f"/api/v1/namespaces/{namespace}/pods")
        request = cpu_millis(pod["spec"]["containers"][0]["resources"]["requests"]["cpu"])
        too_small = f"{request // 2}m"

        def small_quota(args: Any) -> Any:
            import pulumi

            if args.type_ != "kubernetes:core/v1:ResourceQuota" or "sandbox" not in args.name:
                return None
            props = copy.deepcopy(dict(args.props))
            props["spec"]["hard"]["requests.cpu"] = too_small
            return pulumi.ResourceTransformResult(props, args.opts)

        def sandbox_rollout(edit: Callable[[dict[str, Any]], None]) -> Callable[[Any], Any]:
            """A transform: the sandbox Deployment's pod template edited (a rollout), its
            wait bounded by :data:`REFUSED_WAIT_S`."""

            def transform(args: Any) -> Any:
                import pulumi

                if args.type_ != "kubernetes:apps/v1:Deployment" or "sandbox" not in args.name:
                    return None
                props = copy.deepcopy(dict(args.props))
                annotations = props["metadata"].setdefault("annotations", {})
                annotations["pulumi.com/timeoutSeconds"] = str(REFUSED_WAIT_S)
                edit(props["spec"]["template"])
                opts = args.opts
                opts.custom_timeouts = pulumi.CustomTimeouts(
                    create=f"{REFUSED_WAIT_S}s", update=f"{REFUSED_WAIT_S}s")
                return pulumi.ResourceTransformResult(props, opts)

            return transform

        def annotate(template: dict[str, Any]) -> None:
            template["metadata"].setdefault("annotations", {})["e2e/rollout"] = "quota"

        def net_raw(template: dict[str, Any]) -> None:
            container = template["spec"]["containers"][0]
            container["securityContext"]["capabilities"]["add"] = ["NET_RAW"]

        quota_path = f"/api/v1/namespaces/{namespace}/resourcequotas/sandbox-quota"
        # (a) the quota lowered: nothing rolls, the running pod stays.
        self.deployer.transforms = [small_quota]
        _, ops, _, _ = self.up("quota lowered")
        changed = ops.changed()
        check(list(changed) and all("quota" in urn for urn in changed),
              f"lowering the quota changed {changed}")
        wait_until("the quota controller's status of the lowered quota", lambda: self.cluster.api(
            "GET", quota_path)["status"]["hard"].get("requests.cpu") == too_small, 60)
        pods = api_list(self.cluster, f"/api/v1/namespaces/{namespace}/pods")
        check([p["metadata"]["uid"] for p in pods] == [pod["metadata"]["uid"]] and
              is_ready(pods[0]), "a lowered quota touched the running sandbox pod")
        # (b) a rollout under it: its pod refused by the ResourceQuota admission.
        self.deployer.transforms = [small_quota, sandbox_rollout(annotate)]
        error = self.refused_up("rollout under a quota below one pod")
        self.numbers["quota refusal"] = self.refusal(
            namespace, "exceeded quota: sandbox-quota", f"limited: requests.cpu={too_small}")
        self.numbers["quota refused up error"] = error[:300]
        # (c) the quota restored, a capability asked for: PodSecurity refuses it.
        self.deployer.transforms = [sandbox_rollout(net_raw)]
        error = self.refused_up("capability")
        self.numbers["capability refusal"] = self.refusal(
            namespace, "violates PodSecurity", "NET_RAW")
        self.numbers["capability refused up error"] = error[:300]
        # (d) the stack as baked: the pool Ready again.
        self.deployer.transforms = []
        self.up("restore after the refusals")
        pods = api_list(self.cluster, f"/api/v1/namespaces/{namespace}/pods")
        check(len(pods) == 1 and is_ready(pods[0]), f"{namespace}: {len(pods)} pods after "
                                                     "the restore")

    def refused_up(self, what: str) -> str:
        """``up`` expected to fail within :data:`REFUSED_WAIT_S` (+ the engine's own time),
        with an engine error on the sandbox pool's Deployment (its URN names the pool); that
        error's message."""
        started = time.monotonic()
        _, ops, _, error = self.up(what, expect_failure=True)
        waited = time.monotonic() - started
        (self.deployer.state / f"{what}.error.txt").write_text(error)
        self.numbers[f"{what} s"] = round(waited, 1)
        check(waited < REFUSED_WAIT_S + 90, f"{what}: the refused up waited {waited:.0f} s "
                                            f"for a {REFUSED_WAIT_S} s bound")
        deployment = f"::{PROJECT}-sandbox-pool-deployment"
        on_pool = [m for urn, m in ops.errors if urn.endswith(deployment)]
        check(on_pool, f"{what}: no engine error on the sandbox pool's Deployment "
                       f"({deployment}): {ops.errors}\n{error[-3000:]}")
        message = " ".join(on_pool[0].split())
        check(f"'{PROJECT}-sandbox'" in message, f"{what}: the error does not name the pool: "
                                                 f"{message}")
        return message

    def refusal(self, namespace: str, *words: str) -> str:
        """The sandbox ReplicaSet's pod refusal that says all of ``words`` (waited for: the
        ReplicaSet's condition and event follow the refused create)."""

        def found() -> str:
            return next((f for f in self.replica_failures(namespace).values()
                         if all(w in f for w in words)), "")

        try:
            return str(wait_until(f"a refusal saying {words}", found, 30))[:300]
        except Failed:
            raise Failed(f"no refusal saying {words} in {namespace}: "
                         f"{self.replica_failures(namespace)}") from None

    def replica_failures(self, namespace: str) -> dict[str, str]:
        """ReplicaSet -> its ReplicaFailure message or FailedCreate event, in ``namespace``."""
        out: dict[str, str] = {}
        for rs in api_list(self.cluster, f"/apis/apps/v1/namespaces/{namespace}/replicasets"):
            for c in rs.get("status", {}).get("conditions", []):
                if c["type"] == "ReplicaFailure":
                    out[rs["metadata"]["name"]] = c.get("message", "")
        for event in api_list(self.cluster, f"/api/v1/namespaces/{namespace}/events"):
            if event.get("reason") == "FailedCreate":
                out.setdefault(event["involvedObject"]["name"], event.get("message", ""))
        return out

    # 7 ---------------------------------------------------------------------------------
    def destroy(self) -> None:
        stack = self.deployer.stack()
        result = stack.destroy(color="never")
        deleted = dict(result.summary.resource_changes or {})
        self.numbers["destroyed"] = deleted
        check(result.summary.result == "succeeded", f"destroy: {result.summary.result}")

        def nothing_left() -> bool:
            namespaces = {n["metadata"]["name"] for n in api_list(self.cluster,
                                                                   "/api/v1/namespaces")}
            ours = {n for n in namespaces if n.startswith(PROJECT)}
            classes = [c for c in api_list(self.cluster,
                                           "/apis/scheduling.k8s.io/v1/priorityclasses")
                       if c["metadata"]["name"].startswith(PROJECT)]
            return not ours and not classes

        wait_until("nothing of the stack left", nothing_left, 180)
        selector = f"app.kubernetes.io/name={PROJECT}"
        for path in ("/api/v1/pods", "/api/v1/configmaps", "/api/v1/secrets",
                     "/apis/apps/v1/deployments", "/apis/keda.sh/v1alpha1/scaledobjects"):
            left = api_list(self.cluster, f"{path}?labelSelector={selector}")
            check(not left, f"{path}: {[i['metadata']['name'] for i in left]} left")
        stack.workspace.remove_stack(STACK)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", type=Path, help="work in this folder and leave it")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    dirs = engine_dirs()
    os.environ["PATH"] = os.pathsep.join([*map(str, dirs), os.environ.get("PATH", "")])
    os.environ["PULUMI_SKIP_UPDATE_CHECK"] = "true"
    started = time.monotonic()
    times: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        work = work_folder(stack, args.keep)
        with step("bake", times):
            project = bake(work / "bake")
        with step("cluster up", times):
            cluster = stack.enter_context(cl.Cluster(
                binaries=cl.Binaries(tuple(dirs)), workdir=work / "cluster", keep=True))
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        run = Run(cluster, Deployer(project, work / "pulumi", cluster.kubeconfig), times)
        with step(PREFLIGHT, times):
            run.preflight()
        with step("CRDs", times):
            cluster.install_crds()
        for name in SCENARIOS:
            with step(name, times):
                getattr(run, SCENARIOS[name])()
    say("e2e: numbers " + json.dumps(run.numbers, default=str))
    say(f"e2e: all steps ok in {time.monotonic() - started:.1f} s")
    return 0


def work_folder(stack: contextlib.ExitStack, keep: Path | None) -> Path:
    """``keep`` (made, left at the end), or a temporary folder removed at the end."""
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
        return keep
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="e2e-")))


def exit_code(main: Callable[[], int]) -> int:
    """``main()``'s exit code; a failed assertion is 1, Ctrl-C (or SIGTERM) 130, each said in
    one line (every process started is stopped on the way out)."""
    try:
        return main()
    except Failed as failure:
        say(f"e2e: FAILED: {failure}")
        return 1
    except KeyboardInterrupt:
        say("e2e: interrupted; every process started was stopped")
        return 130


if __name__ == "__main__":
    sys.exit(exit_code(main))
