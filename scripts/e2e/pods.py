#!/usr/bin/env python3
"""``make e2e``: a fresh bake's dev stack on real pods: its own image (built here on the
local base, :mod:`images`), the real node of :mod:`node` (containerd, runc, the kubelet), the
real Pulumi engine (:mod:`run`'s Deployer), asserting what the kubelet did.

The node's network holds what the pods reach by the bridge's address (:data:`node.GATEWAY`):
a Redis (the broker, and the jobs' ledger: outside the pods) and PostgreSQL (this machine's,
relayed from the bridge to its unix socket: the connection arrives as the harness's own user).
The harness reaches Redis through a relay on its own loopback. The bake gets one more actor
module before its image is built (:data:`E2E_ACTORS`: the ledger job).

Steps (each prints its name and time; the first failed assertion stops the run, exit 1):

0. KEDA and Prometheus: the real KEDA operator and metrics adapter (:mod:`keda`, its own
   CRDs and RBAC, the adapter an aggregated API authenticated by the front proxy) and
   Debian's Prometheus scraping what the PodMonitors select (:mod:`prom`);
1. up on real pods: every pool's Deployment has its pods Ready, by their real exec probes
   (``healthcheck ready``), under PodSecurity ``restricted``, from the image pinned by digest;
   every ScaledObject Ready (KEDA made its HPA);
1b. autoscaling on a real backlog (:mod:`autoscale`): up to the downstream-capped maximum
   and never past it, drained, held while Prometheus is stopped, down at the policy's pace;
1c. beside 1b (a thread: its waiting overlaps the autoscaling's): every process of the
   interactive pod's container stopped (SIGSTOP) while a job runs: the kubelet's liveness
   probe fails, the kubelet kills the container (SIGKILL after its grace: a stopped process
   handles no SIGTERM) and starts it again; the new container recovers the job the frozen
   one held and it is done, started twice, finished once;
2. a rolling change of one pool while its jobs run: every job of the ledger started once and
   finished once; the old pod ended within its grace period, with exit code 0 (the kubelet's
   SIGTERM, the worker's drain), not killed;
3. a handler wedged in one C call past its time limit: the runtime replaces its worker
   process (exit 75) inside the running container, no container restart; the job is
   delivered again and done, its two attempts counted;
3b. a handler past the pod's memory limit: the kernel's OOM killer (the container's cgroup,
   as the kubelet limited it) kills its worker process, the supervisor says so
   (``process_oom_killed``) and replaces it inside the running container (no container
   restart: kube-state-metrics' OOMKilled never comes), each kill charged an attempt until
   the job is dead-lettered; ``worker_oom_kills_total`` (``WorkerProcessOOMKilled``'s
   series) reaches Prometheus with the count;
4. destroy: nothing of the stack left.

Usage: ``pods.py [--keep DIR] [--only first_up,autoscale,...]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import autoscale
import cluster as cl
import images
import keda
import node
import prom
import relay
import run
from run import check, say, step
from worker_runtime import contract

import build

PROJECT = run.PROJECT
PACKAGE = PROJECT.replace("-", "_")
REDIS_PORT = 6379
POSTGRES_PORT = 5432
POSTGRES_SOCKET = "/var/run/postgresql/.s.PGSQL.5432"
#: The rolling step's jobs: one every FEED_INTERVAL_S, each taking JOB_S (below the dev
#: stack's 5 s drain), sent from before the change until the old pod is gone, so the old pod
#: holds some when the kubelet tells it to go.
FEED_INTERVAL_S = 0.25
JOB_S = 2.0

SCENARIOS = {
    "up on real pods": "first_up",
    "autoscaling on a real backlog": "autoscale",
    "a frozen pod is restarted by liveness, its job recovered": "frozen",
    "a rolling change runs every job once": "rolling",
    "a wedged handler is replaced after its time limit": "wedge",
    "a handler past the memory limit is OOM-killed, counted and dead-lettered": "oom",
    "destroy leaves nothing": "destroy",
}

#: Steps run beside another (their method: the other's), in a thread started with it and
#: joined after it, when both are run: a step that mostly waits costs no time of its own.
BESIDE = {"frozen": "autoscale"}
#: The frozen pod's job: shorter than the interactive pool's time limit (its job timeout,
#: 4 s in the e2e's stack), long enough to be running when the harness stops the container.
FROZEN_JOB_S = 3.5

#: The e2e's actor module, added to the bake before its image is built.
E2E_ACTORS = '''\
"""worker-template's e2e on real pods (scripts/e2e/pods.py): a job that writes a ledger."""

from __future__ import annotations

import os
import socket
import time

import redis

from worker_runtime.typed import JobArguments, actor


class LedgerJob(JobArguments):
    """One job of the ledger."""

    job_id: str
    seconds: float = 0.0


def record(job: LedgerJob) -> None:
    """Count its start and its end in the ledger (``e2e:started``, ``e2e:done``)."""
    ledger = redis.Redis.from_url(os.environ["REDIS_URL"])
    ledger.hincrby("e2e:started", job.job_id, 1)
    ledger.rpush(
        f"e2e:starts:{job.job_id}", f"{socket.gethostname()} pid {os.getpid()} at {time.time():.3f}"
    )
    time.sleep(job.seconds)
    ledger.hincrby("e2e:done", job.job_id, 1)
    ledger.hset("e2e:host", job.job_id, socket.gethostname())
    ledger.hset("e2e:finished", job.job_id, time.time())


@actor(queue_name="notifications", max_retries=4)
def e2e_ledger(job: LedgerJob) -> None:
    """A ledger job of the interactive pool (the rolling change)."""
    record(job)


@actor(queue_name="partner", max_retries=4)
def e2e_partner(job: LedgerJob) -> None:
    """A ledger job of the external pool (the autoscaling step's backlog)."""
    record(job)


@actor(queue_name="notifications", max_retries=4, time_limit=600_000)
def e2e_wedge(job: LedgerJob) -> None:
    """Wedged on its first delivery: one C call (no exception reaches it), no progress, past
    its time limit (the pool's job timeout caps the actor's): the runtime replaces its worker
    process; done on the next delivery."""
    ledger = redis.Redis.from_url(os.environ["REDIS_URL"])
    if ledger.hincrby("e2e:wedge", job.job_id, 1) == 1:
        time.sleep(3600)
    ledger.hincrby("e2e:done", job.job_id, 1)


@actor(queue_name="notifications", max_retries=0)
def e2e_oom(job: LedgerJob) -> None:
    """Grows 20 MiB every 10 ms, each page written, until the kernel's OOM killer (the
    container's memory limit) kills its worker process; counts each delivery."""
    ledger = redis.Redis.from_url(os.environ["REDIS_URL"])
    ledger.hincrby("e2e:oom", job.job_id, 1)
    held = []
    while True:
        held.append(b"x" * (20 * 1024 * 1024))
        time.sleep(0.01)
'''


def rfc3339(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()  # 3.11 reads the Z


class PodWatch:
    """Every version of the pods of a namespace (an API watch), so a pod's last status, the
    kubelet's terminated state included, is seen even if the pod is deleted right after."""

    def __init__(self, cluster: cl.Cluster, namespace: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.last: dict[str, dict[str, Any]] = {}
        #: Each pod's first version with a deletionTimestamp (its deletion's request + grace;
        #: the kubelet's own delete at the end moves it to that moment, with grace 0).
        self.deleted: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ssl

        context = ssl.create_default_context(cafile=str(self.cluster.ca))
        while not self._stop.is_set():
            path = f"/api/v1/namespaces/{self.namespace}/pods?watch=1&timeoutSeconds=30"
            request = urllib.request.Request(self.cluster.server + path)
            request.add_header("Authorization", f"Bearer {self.cluster.token}")
            with (
                contextlib.suppress(Exception),
                urllib.request.urlopen(request, timeout=60, context=context) as stream,
            ):
                for line in stream:
                    pod = json.loads(line)["object"]
                    self.last[pod["metadata"]["uid"]] = pod
                    if pod["metadata"].get("deletionTimestamp"):
                        self.deleted.setdefault(pod["metadata"]["uid"], pod)
                    if self._stop.is_set():
                        return

    def close(self) -> None:
        self._stop.set()


class Harness:
    """The bake, its image, the cluster with a real node, Redis and the relays."""

    def __init__(self, work: Path, stack: contextlib.ExitStack) -> None:
        self.work = work
        self.stack = stack
        self.password = secrets.token_hex(16)
        self.sandbox_password = secrets.token_hex(16)
        # The relay's connection reaches PostgreSQL as the harness's own user (peer).
        user = pwd.getpwuid(os.getuid()).pw_name
        self.database_url = (
            f"postgresql://{user}@{node.GATEWAY}:{POSTGRES_PORT}/postgres"
        )
        self.prometheus: prom.Prometheus
        self.keda: keda.Keda

    def bake(self, times: dict[str, float]) -> None:
        with step("bake", times):
            self.project = run.bake(self.work / "bake")
            actors = self.project / "src" / PACKAGE / "actors" / "e2e.py"
            actors.write_text(E2E_ACTORS)
        cache = build.cache_dir()
        with step("image (buildah on the local base)", times):
            ref = images.bake_image(cache, self.project, f"localhost/{PROJECT}:e2e")
            self.archive = images.image_archive(cache, ref)
            index = json.loads(
                subprocess.run(
                    ["tar", "-xOf", str(self.archive), "index.json"],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
            )
            self.image = f"localhost/{PROJECT}@{index['manifests'][0]['digest']}"
            pause = images.pause_image(cache)
            self.pause = (pause, images.image_archive(cache, pause))

    def cluster_up(self, times: dict[str, float], dirs: list[Path]) -> cl.Cluster:
        with step("cluster and real node up", times):
            self.cluster = self.stack.enter_context(
                cl.Cluster(
                    binaries=cl.Binaries(tuple(dirs)),
                    workdir=self.work / "cluster",
                    keep=True,
                    node="real",
                    images=(self.pause[1], self.archive),
                    sandbox_image=self.pause[0],
                )
            )
            real = self.cluster.real_node
            real.spawn(
                "redis",
                [
                    "redis-server",
                    "--bind",
                    node.GATEWAY,
                    "--port",
                    str(REDIS_PORT),
                    "--requirepass",
                    self.password,
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.cluster.dir),
                ],
            )
            to_redis = relay.Relay(
                listen=(None, "127.0.0.1", 0),
                connect=(real.netns, node.GATEWAY, REDIS_PORT),
            )
            real.relays.append(to_redis)
            real.relays.append(
                relay.Relay(
                    listen=(real.netns, node.GATEWAY, POSTGRES_PORT),
                    connect=(None, POSTGRES_SOCKET, 0),
                )
            )
            self.redis_url = f"redis://:{self.password}@127.0.0.1:{to_redis.port}/0"
            self.redis = self._redis()
            run.wait_until("Redis in the node", self.redis.ping, 30)
            self._acl()
        return self.cluster

    def _redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.redis_url, decode_responses=True)

    def _acl(self) -> None:
        """The sandbox pool's ACL user, as the broker's operator makes it (worker_infra)."""
        from worker_infra.acl import acl_rule

        rule = acl_rule(f"{PROJECT}-sandbox", self.sandbox_password, "dramatiq-sandbox")
        self.redis.execute_command("ACL", "SETUSER", *rule.split()[1:])

    def producer_env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "REDIS_URL": self.redis_url,
            "PYTHONPATH": str(self.project / "src"),
            "WORKER_POOLS_FILE": str(self.project / "pools.toml"),
        }
        env.pop("WORKER_POOL", None)
        return env

    def send(self, actor: str, *args: Any) -> None:
        """One message to ``actor``, by the bake's own producer."""
        code = (
            f"from {PACKAGE}.producer import enqueue\nenqueue({actor!r}, *{args!r})\n"
        )
        subprocess.run(
            [sys.executable, "-c", code],
            env=self.producer_env(),
            check=True,
            capture_output=True,
        )

    def feeder(
        self,
        interval_s: float,
        seconds: float,
        actor: str = "e2e_ledger",
        prefix: str = "j",
        top_up: tuple[str, int] | None = None,
    ) -> subprocess.Popen[str]:
        """The bake's own producer, sending ``actor``'s jobs ``<prefix>-0``, ``<prefix>-1``...
        every ``interval_s`` until its stdin is closed; then it prints how many it sent.
        ``top_up`` (a ready list's key, a length): only while that list is shorter."""
        key, most = top_up or ("", 0)
        code = (
            "import os, select, sys\n"
            "import redis\n"
            f"from {PACKAGE}.producer import enqueue\n"
            "broker = redis.Redis.from_url(os.environ['REDIS_URL'])\n"
            "sent = 0\n"
            "while True:\n"
            f"    ready, _, _ = select.select([sys.stdin], [], [], {interval_s})\n"
            "    if ready and not sys.stdin.read(1):\n"
            "        break\n"
            f"    if {most} and broker.llen({key!r}) >= {most}:\n"
            "        continue\n"
            f"    enqueue({actor!r}, f'{prefix}-{{sent}}', {seconds})\n"
            "    sent += 1\n"
            "print(sent)\n"
        )
        return subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.producer_env(),
        )

    @staticmethod
    def stop_feeder(feeder: subprocess.Popen[str]) -> int:
        """End a :meth:`feeder` (its stdin closed); how many jobs it sent."""
        assert feeder.stdin is not None
        feeder.stdin.close()
        assert feeder.stdout is not None
        sent = int(feeder.stdout.read().strip() or 0)
        feeder.wait(60)
        return sent


#: The exec probes' timeout here, and the bound of a Deployment's wait: each probe starts a
#: Python that imports the service, which took over 5 s (worker_infra's probe timeout) on
#: this 2-core machine at load 12-16 beside four other test suites; a probe timing out
#: restarted containers and failed the first up. A production node answers well within it.
PROBE_TIMEOUT_S = 30
WAIT_BOUND_S = 600


def loaded_machine(args: Any) -> Any:
    """A Pulumi transform: the Deployments' probe timeouts and wait bound of a loaded
    machine (:data:`PROBE_TIMEOUT_S`); everything else as the stack renders it."""
    import copy

    import pulumi

    if args.type_ != "kubernetes:apps/v1:Deployment":
        return None
    props = copy.deepcopy(dict(args.props))
    props["metadata"].setdefault("annotations", {})["pulumi.com/timeoutSeconds"] = str(
        WAIT_BOUND_S
    )
    for container in props["spec"]["template"]["spec"]["containers"]:
        for probe in ("livenessProbe", "readinessProbe"):
            if probe in container:
                container[probe]["timeoutSeconds"] = PROBE_TIMEOUT_S
    return pulumi.ResourceTransformResult(props, args.opts)


def container_processes(container_id: str) -> list[int]:
    """The host's pids of a container's processes (its cgroup path names its id)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if container_id in (proc / "cgroup").read_text():
                pids.append(int(proc.name))
    return pids


@contextlib.contextmanager
def beside(scenarios: Any, steps: list[tuple[str, str]], times: dict[str, float]) -> Any:
    """Run ``steps`` (name, method) in threads while the body runs; after it, wait for
    them and raise the first one's failure."""
    failures: list[BaseException] = []

    def one(name: str, method: str) -> None:
        try:
            with step(name, times):
                getattr(scenarios, method)()
        except BaseException as error:  # noqa: BLE001 (raised in the main thread)
            failures.append(error)

    threads = [threading.Thread(target=one, args=s, daemon=True) for s in steps]
    for thread in threads:
        thread.start()
    yield
    for thread in threads:
        thread.join(900)
        if thread.is_alive():
            failures.append(run.Failed("a step beside the last one still runs after 900 s"))
    if failures:
        raise failures[0]


class Scenarios:
    def __init__(self, harness: Harness, times: dict[str, float]) -> None:
        self.h = harness
        self.cluster = harness.cluster
        self.deployer = run.Deployer(
            harness.project, harness.work / "pulumi", harness.cluster.kubeconfig
        )
        self.deployer.transforms = [loaded_machine, autoscale.quick_scale_down]
        self.run = run.Run(harness.cluster, self.deployer, times)
        self.numbers = self.run.numbers

    def configure(self) -> None:
        from pulumi import automation as auto

        h = self.h

        def dev(data: dict[str, Any]) -> None:
            config = data["config"]
            config[run.key("image")] = h.image
            config[run.key("redis")].update(host=node.GATEWAY, port=REDIS_PORT)
            autoscale.stack_config(config, prom.URL)
            config[run.key("pools")]["sandbox"]["min_replicas"] = 1
            config[run.key("pools")]["interactive"].update(
                job_timeout_ms=run.INTERACTIVE_DRAIN_MS - 1000,
                shutdown_timeout_ms=run.INTERACTIVE_DRAIN_MS,
            )
            config.setdefault(run.key("sandbox"), {})["brokerAclInstalled"] = True

        run.edit_yaml(self.deployer.infra / "Pulumi.dev.yaml", dev)
        stack = self.deployer.stack()
        for name, value in (
            ("redisPassword", h.password),
            ("sandboxRedisPassword", h.sandbox_password),
            ("databaseUrl", h.database_url),
        ):
            stack.set_config(name, auto.ConfigValue(value, secret=True))

    # 1 ---------------------------------------------------------------------------------
    def first_up(self) -> None:
        self.configure()
        started = time.monotonic()
        self.run.up("first up")
        self.numbers["first up s"] = round(time.monotonic() - started, 1)
        live = run.deployments(self.cluster)
        for name, d in live.items():
            want = d["spec"]["replicas"]
            check(
                d["status"].get("readyReplicas", 0) == want,
                f"{name}: {d['status'].get('readyReplicas', 0)} of {want} Ready",
            )
        pods = run.api_list(
            self.cluster, f"/api/v1/pods?labelSelector={run.POOL_LABEL}"
        )
        check(pods, "no pod")
        for pod in pods:
            name = pod["metadata"]["name"]
            container = pod["spec"]["containers"][0]
            check(
                container["image"] == self.h.image,
                f"{name}: image {container['image']}",
            )
            check(
                container["imagePullPolicy"] == "IfNotPresent",
                f"{name}: pull policy {container['imagePullPolicy']} for a digest",
            )
            for probe in ("livenessProbe", "readinessProbe"):
                check(
                    "exec" in container.get(probe, {}), f"{name}: {probe} is not exec"
                )
            status = pod["status"]["containerStatuses"][0]
            check(status["ready"] and "running" in status["state"], f"{name}: {status}")
            check(
                pod["spec"]["nodeName"] == node.NODE,
                f"{name}: on {pod['spec']['nodeName']}",
            )
        for namespace in (run.NAMESPACE, run.SANDBOX_NS):
            ns = self.cluster.api("GET", f"/api/v1/namespaces/{namespace}")
            labels = ns["metadata"]["labels"]
            check(
                labels.get("pod-security.kubernetes.io/enforce") == "restricted",
                f"{namespace}: {labels}",
            )
        self.numbers["pods Ready"] = len(pods)
        # The real KEDA took every ScaledObject: its HPA made, its triggers built.
        def not_ready() -> dict[str, Any]:
            return {
                so["metadata"]["name"]: so.get("status")
                for so in run.api_list(self.cluster, "/apis/keda.sh/v1alpha1/scaledobjects")
                if not so.get("status", {}).get("hpaName")
                or not any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in so["status"].get("conditions", [])
                )
            }

        run.wait_until("every ScaledObject Ready", lambda: not not_ready(), 60)
        self.numbers["ScaledObjects Ready"] = len(
            run.api_list(self.cluster, "/apis/keda.sh/v1alpha1/scaledobjects")
        )

    # 1b --------------------------------------------------------------------------------
    def autoscale(self) -> None:
        autoscale.scenario(self, self.h.prometheus, self.h.keda)

    def pod_log_lines(self, name: str, uid: str, marker: str) -> list[dict[str, Any]]:
        """The JSON log lines holding ``marker`` of every container run of pod ``name``
        (``uid``), read from the kubelet's log folder."""
        logs = self.cluster.real_node.dir / "pod-logs"
        return [
            json.loads(line.split(" ", 3)[3])
            for log in logs.glob(f"{run.NAMESPACE}_{name}_{uid}/*/*.log")
            for line in log.read_text(errors="replace").splitlines()
            if marker in line
        ]

    # 1c --------------------------------------------------------------------------------
    def frozen(self) -> None:
        """The interactive pod's container frozen while its job runs: restarted by the
        kubelet's liveness probe; the job recovered by the new container and done."""
        (pod,) = self.run.interactive_pods()
        uid, name = pod["metadata"]["uid"], pod["metadata"]["name"]
        path = f"/api/v1/namespaces/{run.NAMESPACE}/pods/{name}"
        (status,) = pod["status"]["containerStatuses"]
        restarts, container = status["restartCount"], status["containerID"].split("://")[-1]
        check(container_processes(container), f"no process of {name}'s container {container}")
        job, redis = "f-1", self.h.redis
        self.h.send("e2e_ledger", job, FROZEN_JOB_S)
        sent = time.monotonic()
        while redis.hget("e2e:started", job) != "1":
            check(time.monotonic() - sent < 120, f"{job} never started")
            time.sleep(0.02)
        stopped = container_processes(container)
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic()
        check(redis.hget("e2e:done", job) is None, f"{job} finished before the freeze")
        self.numbers["frozen: processes stopped"] = len(stopped)

        def restarted() -> Any:
            (now,) = self.cluster.api("GET", path)["status"]["containerStatuses"]
            return now["restartCount"] > restarts and now.get("ready") and now

        now = run.wait_until("the frozen container restarted and Ready", restarted, 400)
        self.numbers["frozen: restarted and Ready after s"] = round(time.monotonic() - frozen, 1)
        check(now["restartCount"] == restarts + 1, f"restarted {now['restartCount'] - restarts}")
        ended = now["lastState"].get("terminated", {})
        check(ended.get("exitCode") == 137, f"the frozen container ended {ended} (not SIGKILL)")

        def said() -> dict[str, str]:
            events = run.api_list(self.cluster, f"/api/v1/namespaces/{run.NAMESPACE}/events")
            mine = {e["reason"]: e.get("message", "") for e in events
                    if e["involvedObject"].get("uid") == uid}
            liveness = "Liveness probe failed" in mine.get("Unhealthy", "")
            killed = "liveness" in mine.get("Killing", "")
            return mine if liveness and killed else {}

        events = run.wait_until("the kubelet's liveness events", said, 60)
        self.numbers["frozen: kubelet said"] = [events["Unhealthy"][:120], events["Killing"]]
        run.wait_until(f"{job} done", lambda: redis.hget("e2e:done", job) == "1", 120)
        self.numbers["frozen: done after s"] = round(time.monotonic() - frozen, 1)
        started = redis.hget("e2e:started", job)
        check(started == "2", f"{job} started {started} times, expected 2 (frozen, recovered)")
        recovered = self.pod_log_lines(name, uid, "recovered the messages of a dead worker")
        check(
            any(r.get("requeued", 0) >= 1 for r in recovered),
            f"no recovery of the frozen worker's messages in {name}'s log: {recovered}",
        )

    # 2 ---------------------------------------------------------------------------------
    def rolling(self) -> None:
        """interactive's concurrency 8 -> 6 while its ledger jobs keep coming."""
        watch = PodWatch(self.cluster, run.NAMESPACE)
        feeder = self.h.feeder(FEED_INTERVAL_S, JOB_S)
        try:
            (old,) = self.run.interactive_pods()
            run.wait_until(
                "the first jobs done", lambda: self.h.redis.hget("e2e:done", "j-0"), 60
            )
            pools_toml = self.deployer.project / "pools.toml"
            text = pools_toml.read_text()
            pools_toml.write_text(text.replace("concurrency = 8", "concurrency = 6", 1))
            started = time.monotonic()
            self.run.up("one pool's change")
            self.numbers["roll up s"] = round(time.monotonic() - started, 1)
            old_uid = old["metadata"]["uid"]
            run.wait_until(
                "the old pod gone",
                lambda: (
                    old_uid
                    not in {
                        p["metadata"]["uid"]
                        for p in run.api_list(
                            self.cluster, f"/api/v1/namespaces/{run.NAMESPACE}/pods"
                        )
                    }
                ),
                120,
            )
        finally:
            sent = self.h.stop_feeder(feeder)
        try:
            jobs = [f"j-{i}" for i in range(sent)]
            run.wait_until(
                "every job done",
                lambda: sum(1 for v in self.h.redis.hmget("e2e:done", jobs) if v) >= sent,
                180,
            )
            time.sleep(1)  # the watch's last events
        finally:
            watch.close()
        self.numbers["ledger jobs"] = sent
        started_counts = self.h.redis.hgetall("e2e:started")
        done_counts = self.h.redis.hgetall("e2e:done")
        hosts = self.h.redis.hgetall("e2e:host")
        twice = {
            j: (started_counts.get(j), done_counts.get(j))
            for j in jobs
            if started_counts.get(j) != "1" or done_counts.get(j) != "1"
        }
        check(not twice, f"jobs not run exactly once (started, done): {twice}; "
                         f"{self.twice_evidence(twice, watch)}")
        by_old = sum(1 for j in jobs if hosts.get(j) == old["metadata"]["name"])
        self.numbers["jobs by the old pod, by the new"] = [by_old, len(jobs) - by_old]
        check(
            0 < by_old < len(jobs),
            f"the old pod ran {by_old} of {len(jobs)}: no overlap",
        )
        last = watch.last.get(old["metadata"]["uid"])
        deleted = watch.deleted.get(old["metadata"]["uid"])
        check(
            last is not None and deleted is not None,
            "the watch never saw the old pod go",
        )
        assert last is not None and deleted is not None
        state = last["status"]["containerStatuses"][0]["state"]
        terminated = state.get("terminated")
        check(terminated, f"the old pod's last state: {state}")
        assert terminated is not None
        grace = deleted["metadata"]["deletionGracePeriodSeconds"]
        told = rfc3339(deleted["metadata"]["deletionTimestamp"]) - grace
        drained_s = rfc3339(terminated["finishedAt"]) - told
        self.numbers["old pod drained in s (grace)"] = [drained_s, grace]
        check(terminated["exitCode"] == 0, f"the old pod exited {terminated}")
        check(drained_s <= grace, f"the old pod took {drained_s} s, grace {grace}")
        # Work in hand when the kubelet said SIGTERM (at the deletion's request), finished by
        # the old pod after it: drained, not dropped.
        finished = self.h.redis.hgetall("e2e:finished")
        after = [
            j
            for j in jobs
            if hosts.get(j) == old["metadata"]["name"] and float(finished[j]) > told
        ]
        self.numbers["jobs the old pod finished after its SIGTERM"] = len(after)
        check(
            after, "the old pod finished no job after its SIGTERM: nothing was drained"
        )

    def twice_evidence(self, twice: dict[str, Any], watch: PodWatch) -> str:
        """What tells a redelivery's cause: each start's pod, process and time; the
        containers' restarts and last states; the workers' lines on recovery."""
        starts = {j: self.h.redis.lrange(f"e2e:starts:{j}", 0, -1) for j in twice}
        restarts = {
            p["metadata"]["name"]: [
                (c["restartCount"], c.get("lastState"))
                for c in p["status"].get("containerStatuses", [])
            ]
            for p in watch.last.values()
        }
        lines = []
        for log in sorted((self.cluster.real_node.dir / "pod-logs").rglob("*.log")):
            if f"{run.NAMESPACE}_" not in str(log):
                continue
            for line in log.read_text(errors="replace").splitlines():
                if any(w in line.lower() for w in ("recover", "requeue", "lost", "silent")):
                    lines.append(f"{log.parent.parent.name}: {line[:400]}")
        return f"starts {starts}; containers {restarts}; worker lines {lines[-30:]}"

    # 3 ---------------------------------------------------------------------------------
    def wedge(self) -> None:
        """A handler wedged in a C call past its time limit (the pool's job timeout): the
        runtime abandons it and replaces its worker process (exit 75, #39's time limit),
        inside the running container, well before liveness would fail; the job is
        delivered again and done, its attempts counted."""
        (pod,) = self.run.interactive_pods()
        uid, name = pod["metadata"]["uid"], pod["metadata"]["name"]
        path = f"/api/v1/namespaces/{run.NAMESPACE}/pods/{name}"
        restarts = pod["status"]["containerStatuses"][0]["restartCount"]
        self.h.send("e2e_wedge", "w-1")
        started = time.monotonic()
        run.wait_until(
            "the wedged job done on its next delivery",
            lambda: self.h.redis.hget("e2e:done", "w-1") == "1",
            300,
        )
        self.numbers["wedge to done s"] = round(time.monotonic() - started, 1)
        attempts = self.h.redis.hget("e2e:wedge", "w-1")
        check(attempts == "2", f"the wedged job ran {attempts} times, expected 2")
        replaced = self.pod_log_lines(name, uid, '"process_replaced"')
        check(
            any(r.get("exit_code") == 75 for r in replaced),
            f"no worker process replaced after the time limit in {name}'s log: {replaced}",
        )
        now = self.cluster.api("GET", path)["status"]["containerStatuses"][0]["restartCount"]
        self.numbers["wedge: container restarts"] = now - restarts
        check(now == restarts, f"the container restarted {now - restarts} times (liveness)")

    # 3b --------------------------------------------------------------------------------
    def oom(self) -> None:
        """A handler past the pod's memory limit, under the kubelet's real cgroup."""
        (pod,) = self.run.interactive_pods()
        uid, name = pod["metadata"]["uid"], pod["metadata"]["name"]
        path = f"/api/v1/namespaces/{run.NAMESPACE}/pods/{name}"
        restarts = pod["status"]["containerStatuses"][0]["restartCount"]
        dead = "dramatiq:notifications.XQ.msgs"
        self.h.send("e2e_oom", "m-1")
        started = time.monotonic()
        # Its own dead letter: another step's job dead-lettered meanwhile is not it.
        run.wait_until(
            "the growing job dead-lettered",
            lambda: any('"e2e_oom"' in b and '"m-1"' in b for b in self.h.redis.hvals(dead)),
            240,
        )
        self.numbers["oom: to the dead letters s"] = round(time.monotonic() - started, 1)
        deliveries = int(self.h.redis.hget("e2e:oom", "m-1") or 0)
        check(deliveries >= 2, f"the growing job ran {deliveries} times")
        # The supervisor logs a death once it has recovered the dead process's messages: the
        # last kill's line follows the dead letter its recovery wrote.
        with contextlib.suppress(run.Failed):
            run.wait_until(
                "a kill line per delivery",
                lambda: len(self.pod_log_lines(name, uid, '"process_oom_killed"')) >= deliveries,
                30,
            )
        killed = self.pod_log_lines(name, uid, '"process_oom_killed"')
        self.numbers["oom: deliveries, kills logged"] = [deliveries, len(killed)]
        check(
            len(killed) == deliveries and all(k.get("exit_code") == -9 for k in killed),
            f"{deliveries} deliveries, {len(killed)} OOM kills logged: {killed}",
        )
        now = self.cluster.api("GET", path)["status"]["containerStatuses"][0]["restartCount"]
        check(now == restarts, f"the container restarted {now - restarts} times")
        query = f'sum({contract.OOM_KILLS}{{worker_template_pool="interactive"}})'
        counted = run.wait_until(
            f"{query} at {deliveries} in Prometheus",
            lambda: (v := self.h.prometheus.value(query)) is not None and v >= deliveries and v,
            60,
        )
        self.numbers["oom: worker_oom_kills_total"] = counted

    # 4 ---------------------------------------------------------------------------------
    def destroy(self) -> None:
        self.run.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", type=Path, help="work in this folder and leave it")
    parser.add_argument(
        "--only", help="comma-separated steps' methods (first_up,autoscale,...; default all)"
    )
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else set(SCENARIOS.values())
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    dirs = run.engine_dirs((*build.KWOK_E2E, "kubelet", "keda"))
    os.environ["PATH"] = os.pathsep.join([*map(str, dirs), os.environ.get("PATH", "")])
    os.environ["PULUMI_SKIP_UPDATE_CHECK"] = "true"
    started = time.monotonic()
    times: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        work = run.work_folder(stack, args.keep)
        harness = Harness(work, stack)
        harness.bake(times)
        cluster = harness.cluster_up(times, dirs)
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        with step("CRDs", times):
            cluster.install_crds(skip=("keda.sh",))
        with step("KEDA and Prometheus", times):
            harness.prometheus = prom.Prometheus(cluster, cluster.real_node)
            harness.prometheus.start()
            stack.callback(harness.prometheus.close)
            harness.keda = keda.Keda(cluster, cluster.real_node)
            harness.keda.start()
        scenarios = Scenarios(harness, times)
        for name, method in SCENARIOS.items():
            if method not in only or BESIDE.get(method) in only:
                continue
            others = [(n, m) for n, m in SCENARIOS.items() if BESIDE.get(m) == method and m in only]
            with step(name, times), beside(scenarios, others, times):
                getattr(scenarios, method)()
    say("e2e: numbers " + json.dumps(scenarios.numbers, default=str))
    say(f"e2e: all steps ok in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run.exit_code(main))
