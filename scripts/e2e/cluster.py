#!/usr/bin/env python3
"""A real, steady Kubernetes control plane on loopback for ``make e2e``, with fake nodes.

Processes (each on a free loopback port, logs in ``<workdir>/logs/``):

- etcd (Debian's ``etcd-server``);
- kube-apiserver: token authentication (a token file; every client gets a kubeconfig with
  its own token), RBAC, the admission plugins a production cluster runs (NamespaceLifecycle,
  LimitRanger, ServiceAccount, PodSecurity, ResourceQuota, Priority, RuntimeClass; the
  default set besides) but not TaintNodesByCondition, which taints a new node not-ready;
- kube-controller-manager without the node lifecycle controller (under load it judged the
  fake node NotReady and marked every pod not Ready: #33), so the cluster is steady;
- kube-scheduler;
- kwok (``--manage-all-nodes``): one Node, annotated ``kwok.x-k8s.io/node: fake``, whose
  pods kwok marks Running and Ready :data:`POD_READY_MS` after scheduling and removes
  :data:`POD_DRAIN_MS` after deletion (nothing runs; admission, scheduling, ReplicaSets,
  quotas and rollouts are Kubernetes' own).

:meth:`Cluster.install_crds` adds the KEDA and Prometheus Operator CRDs the stacks use
(:data:`CRDS`; a bare cluster first shows the preflight's refusal): structural CRDs
that keep unknown fields (``x-kubernetes-preserve-unknown-fields``); their fields are
checked strictly against the projects' own schemas by the render tests
(``worker_infra.policy.validate_strict``), not here.

:class:`Cluster` is a context manager: every process it started is stopped (SIGTERM, then
SIGKILL after :data:`STOP_GRACE_S`) when the block ends, by success, failure or Ctrl-C; each
child also gets SIGKILL from the kernel if this process dies (``PR_SET_PDEATHSIG``), so a
killed harness leaves nothing running.

Run alone (``python3 scripts/e2e/cluster.py``) it starts the cluster, prints the
kubeconfig's path and waits for Ctrl-C.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Seconds a stopped process gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 10
#: Seconds each component may take to answer its health check.
START_TIMEOUT_S = 180
#: The fake node (kwok runs its pods).
NODE = "kwok-node-0"
#: Capacity of the fake node: ample, so only quotas and admission refuse pods.
NODE_CAPACITY = {"cpu": "64", "memory": "256Gi", "pods": "250"}
#: Service CIDR of the API server (no Service is ever reached: kwok runs no network).
SERVICE_CIDR = "10.96.0.0/16"
#: Admission plugins enabled besides the API server's defaults; and the one turned off.
ADMISSION = (
    "NamespaceLifecycle,LimitRanger,ServiceAccount,PodSecurity,ResourceQuota,Priority,"
    "RuntimeClass"
)
NO_ADMISSION = "TaintNodesByCondition"
#: Feature gates of the API server. WatchList off: with it, the API server turns a watch from
#: resourceVersion 0 (kwok's every watch) into a watch stream, which it then refuses over
#: Debian's etcd 3.4 (no RequestWatchProgress); kwok retried after a growing backoff (up
#: to a minute) and saw pods late: a deleted pod lingered ~55 s, not :data:`POD_DRAIN_MS`.
FEATURE_GATES = "WatchList=false"
#: Controllers of kube-controller-manager that are off: the node lifecycle controller (it
#: taints and evicts by node heartbeats; the fake node's are not the point).
CONTROLLERS = "*,-node-lifecycle-controller"

#: (group, plural, kind, versions, scope) of the CRDs the stacks use.
CRDS: tuple[tuple[str, str, str, tuple[str, ...], str], ...] = (
    ("keda.sh", "scaledobjects", "ScaledObject", ("v1alpha1",), "Namespaced"),
    ("keda.sh", "triggerauthentications", "TriggerAuthentication", ("v1alpha1",), "Namespaced"),
    ("keda.sh", "clustertriggerauthentications", "ClusterTriggerAuthentication", ("v1alpha1",),
     "Cluster"),
    ("monitoring.coreos.com", "podmonitors", "PodMonitor", ("v1",), "Namespaced"),
    ("monitoring.coreos.com", "servicemonitors", "ServiceMonitor", ("v1",), "Namespaced"),
    ("monitoring.coreos.com", "prometheusrules", "PrometheusRule", ("v1",), "Namespaced"),
)


#: kwok's pod stages (its "fast" pod-ready, after a delay, and a pod-delete that keeps a
#: deleted pod for a fixed drain): a pod is Ready :data:`POD_READY_MS` after it is
#: scheduled and gone :data:`POD_DRAIN_MS` after it is deleted, so a rollout's old pods
#: exist (and count against quotas) for a while, as a draining worker does. Only the
#: containers get a status: no pod of the stacks has an init container, and what reads a
#: pod (ReplicaSets, Deployments, quotas, the tests) reads its Ready condition.
POD_READY_MS = 2000
POD_DRAIN_MS = 5000
#: The status kwok gives a pod that is ready (a Go template of kwok's).
POD_READY_STATUS = """\
{{ $now := Now }}

conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: ContainersReady
{{ range .spec.readinessGates }}
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: {{ .conditionType | Quote }}
{{ end }}

containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: true
  restartCount: 0
  state:
    running:
      startedAt: {{ $now | Quote }}
{{ end }}

hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
phase: Running
startTime: {{ $now | Quote }}
"""


def pod_stage(name: str, when: dict[str, str], delay_ms: int, then: dict[str, Any]) -> str:
    """A kwok Stage (JSON, which kwok reads as YAML) of pods: ``when`` each key (a jq path)
    has its operator (``Exists``, ``DoesNotExist``), ``then`` after ``delay_ms``."""
    return json.dumps({
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": [
                {"key": key, "operator": operator} for key, operator in when.items()
            ]},
            "delay": {"durationMilliseconds": delay_ms},
            "next": then,
        },
    }, indent=1)


KWOK_STAGES = "\n---\n".join((
    pod_stage(
        "pod-ready",
        {".metadata.deletionTimestamp": "DoesNotExist", ".status.podIP": "DoesNotExist"},
        POD_READY_MS,
        {"statusTemplate": POD_READY_STATUS},
    ),
    pod_stage(
        "pod-delete",
        {".metadata.deletionTimestamp": "Exists"},
        POD_DRAIN_MS,
        {"finalizers": {"empty": True}, "delete": True},
    ),
))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (Linux ``PR_SET_PDEATHSIG``),
    and a session of its own (Ctrl-C in a terminal reaches the harness, which stops it)."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class Binaries:
    """Where the engines are (``scripts/e2e/build.py --bin-dirs`` folders, or PATH)."""

    dirs: tuple[Path, ...] = ()

    def find(self, name: str) -> str:
        for d in self.dirs:
            if (d / name).is_file():
                return str(d / name)
        for d in os.environ.get("PATH", "").split(os.pathsep):
            if d and (Path(d) / name).is_file():
                return str(Path(d) / name)
        raise FileNotFoundError(f"{name}: not built (make e2e-build) and not on PATH")


#: The aggregator's client certificate's name (``--requestheader-allowed-names``).
FRONT_PROXY_CLIENT = "front-proxy-client"


@dataclass(frozen=True)
class FrontProxy:
    """The API server's front-proxy CA and the client certificate it signs: the aggregator
    presents it to an aggregated API server, which then believes the ``X-Remote-User`` and
    ``X-Remote-Group`` headers (read from ``kube-system/extension-apiserver-authentication``)."""

    ca: Path
    client: Any

    @classmethod
    def make(cls, folder: Path) -> FrontProxy:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import pki

        authority = pki.ca(folder, "front-proxy-ca")
        return cls(authority.cert, pki.leaf(authority, folder, "client", FRONT_PROXY_CLIENT))


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class Cluster:
    """The control plane and a kwok node, as a context manager (see the module doc).

    Parameters:
      binaries: where kube-apiserver & co and kwok are.
      workdir: folder for data, certificates, kubeconfigs and logs (default: a new
        temporary folder, removed at the end unless ``keep``).
      say: progress lines (default: print to stderr).
    """

    binaries: Binaries = field(default_factory=Binaries)
    workdir: Path | None = None
    keep: bool = False
    #: ``"kwok"`` (a fake node, ``make e2e``) or ``"real"`` (:mod:`node`: containerd and the
    #: kubelet, ``make e2e``), with the OCI archives it imports and its sandbox image.
    node: str = "kwok"
    images: tuple[Path, ...] = ()
    sandbox_image: str = ""
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    processes: list[Process] = field(default_factory=list)
    server: str = ""
    token: str = ""
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    real_node: Any = None

    # ---- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="e2e-cluster-")
            self.workdir = Path(self._tmp.name)
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def dir(self) -> Path:
        assert self.workdir is not None
        return self.workdir

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (token of the ``system:masters`` group)."""
        return self.dir / "admin.kubeconfig"

    @property
    def ca(self) -> Path:
        """The API server's serving certificate and the CA that signed it (it makes both at
        its first start, for 127.0.0.1): what every client of it verifies."""
        return self.dir / "certs" / "apiserver.crt"

    def start(self) -> None:
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        self._credentials()
        self._etcd()
        self._apiserver()
        self._controllers()
        if self.node == "real":
            import node

            self.real_node = node.Node(self, self.images, self.sandbox_image)
            self.real_node.start()
        else:
            self._kwok()

    def stop(self) -> None:
        """Stop every process this cluster started, newest first: SIGTERM to its process
        group, SIGKILL after :data:`STOP_GRACE_S`. A real node first: all of it ends with its
        namespaces, then the host's cgroups and sysctls are as they were (:mod:`node`)."""
        if self.real_node is not None:
            self.real_node.stop()
            self.real_node = None
        for proc in reversed(self.processes):
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in reversed(self.processes):
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
        self.processes.clear()
        if self._tmp is not None and not self.keep:
            self._tmp.cleanup()
            self._tmp = None

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.processes]

    # ---- pieces -----------------------------------------------------------------------

    def _spawn(self, name: str, argv: Sequence[str]) -> Process:
        log = self.dir / "logs" / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(  # noqa: S603 (our own binaries, fixed arguments)
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 (no threads yet at this point)
                cwd=self.dir,
            )
        proc = Process(name, popen, log)
        self.processes.append(proc)
        return proc

    def _wait(self, proc: Process, what: str, ready: Callable[[], bool]) -> None:
        started = time.monotonic()
        deadline = started + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                tail = proc.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{tail}")
            with contextlib.suppress(Exception):
                if ready():
                    self.say(f"e2e: {what} ready in {time.monotonic() - started:.1f} s")
                    return
            time.sleep(0.5)
        tail = proc.log.read_text(errors="replace")[-3000:]
        raise TimeoutError(f"{what}: not ready after {START_TIMEOUT_S} s:\n{tail}")

    def _credentials(self) -> None:
        """Service-account signing key and one token per client."""
        key, pub = self.dir / "sa.key", self.dir / "sa.pub"
        subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True,
                       capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(pub)],
                       check=True, capture_output=True)
        self.tokens = {
            user: os.urandom(16).hex()
            for user in ("admin", "kube-controller-manager", "kube-scheduler", "kwok", "kubelet")
        }
        self.token = self.tokens["admin"]
        lines = [
            f'{token},{user},{user},"system:masters"' for user, token in self.tokens.items()
        ]
        (self.dir / "tokens.csv").write_text("\n".join(lines) + "\n")

    def _kubeconfig(self, user: str, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": {
                "server": self.server,
                "certificate-authority-data": base64.b64encode(self.ca.read_bytes()).decode(),
            }}],
            "users": [{"name": user, "user": {"token": self.tokens[user]}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user}}],
            "current-context": "e2e",
        }
        path.write_text(json.dumps(config, indent=1))
        return path

    def _etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        proc = self._spawn("etcd", [
            self.binaries.find("etcd"),
            "--name", "e2e",
            "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", self.etcd_url,
            "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"e2e=http://127.0.0.1:{peer}",
            "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}",
            "--quota-backend-bytes", str(2 * 1024**3),
        ])

        def healthy() -> bool:
            with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as r:
                return bool(json.loads(r.read())["health"] == "true")

        self._wait(proc, "etcd", healthy)

    def _get(self, url: str, token: str | None = None) -> tuple[int, bytes]:
        """A health probe of a process we started (each serves its own self-signed
        certificate, so the probe does not verify it)."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        request = urllib.request.Request(url)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def _apiserver(self) -> None:
        front_proxy = FrontProxy.make(self.dir / "front-proxy")
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        proc = self._spawn("kube-apiserver", [
            self.binaries.find("kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.dir / 'certs'}",
            f"--token-auth-file={self.dir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--anonymous-auth=false",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.dir / 'sa.pub'}",
            f"--service-account-signing-key-file={self.dir / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--enable-admission-plugins={ADMISSION}",
            f"--disable-admission-plugins={NO_ADMISSION}",
            f"--feature-gates={FEATURE_GATES}",
            # The loopback address is no valid endpoint of the kubernetes Service.
            "--endpoint-reconciler-type=none",
            # The aggregation layer's front proxy (an aggregated API, such as KEDA's metrics
            # adapter, trusts the user named in these headers only from this client cert).
            f"--requestheader-client-ca-file={front_proxy.ca}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={front_proxy.client.cert}",
            f"--proxy-client-key-file={front_proxy.client.key}",
            "--profiling=false",
            "--v=1",
        ])

        def ready() -> bool:
            status, body = self._get(f"{self.server}/readyz", self.tokens["admin"])
            return status == 200 and body.strip() == b"ok"

        self._wait(proc, "kube-apiserver", ready)
        self._kubeconfig("admin", self.kubeconfig)
        for user in ("kube-controller-manager", "kube-scheduler", "kwok"):
            self._kubeconfig(user, self.dir / f"{user}.kubeconfig")

    def _controllers(self) -> None:
        kcm_port, sched_port = free_port(), free_port()
        kcm_config = str(self.dir / "kube-controller-manager.kubeconfig")
        kcm = self._spawn("kube-controller-manager", [
            self.binaries.find("kube-controller-manager"),
            f"--kubeconfig={kcm_config}",
            f"--authentication-kubeconfig={kcm_config}",
            f"--authorization-kubeconfig={kcm_config}",
            "--bind-address=127.0.0.1",
            f"--secure-port={kcm_port}",
            "--leader-elect=false",
            f"--controllers={CONTROLLERS}",
            f"--service-account-private-key-file={self.dir / 'sa.key'}",
            f"--root-ca-file={self.dir / 'certs' / 'apiserver.crt'}",
            "--use-service-account-credentials=false",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--profiling=false",
            "--v=1",
        ])
        sched_config = str(self.dir / "kube-scheduler.kubeconfig")
        sched = self._spawn("kube-scheduler", [
            self.binaries.find("kube-scheduler"),
            f"--kubeconfig={sched_config}",
            f"--authentication-kubeconfig={sched_config}",
            f"--authorization-kubeconfig={sched_config}",
            "--bind-address=127.0.0.1",
            f"--secure-port={sched_port}",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ])
        for proc, port in ((kcm, kcm_port), (sched, sched_port)):
            self._wait(
                proc, proc.name,
                lambda port=port: self._get(f"https://127.0.0.1:{port}/healthz")[0] == 200,
            )

    def _kwok(self) -> None:
        port = free_port()
        stages = self.dir / "kwok-stages.yaml"
        stages.write_text(KWOK_STAGES)
        proc = self._spawn("kwok", [
            self.binaries.find("kwok"),
            f"--config={stages}",
            f"--kubeconfig={self.dir / 'kwok.kubeconfig'}",
            "--manage-all-nodes=true",
            f"--server-address=127.0.0.1:{port}",
        ])
        self._wait(proc, "kwok", lambda: self._get(f"http://127.0.0.1:{port}/healthz")[0] == 200)
        self.api("POST", "/api/v1/nodes", {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": NODE,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": NODE,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "topology.kubernetes.io/zone": "e2e-a",
                    "type": "kwok",
                },
            },
            "spec": {},
            "status": {"allocatable": NODE_CAPACITY, "capacity": NODE_CAPACITY},
        })

        def node_ready() -> bool:
            node = self.api("GET", f"/api/v1/nodes/{NODE}")
            conditions = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}
            taints = node["spec"].get("taints", [])
            return conditions.get("Ready") == "True" and not taints

        self._wait(proc, "fake node", node_ready)

    def install_crds(self, skip: tuple[str, ...] = ()) -> None:
        """The KEDA and Prometheus Operator CRDs (:data:`CRDS`) but those of the groups in
        ``skip`` (the real KEDA brings its own: :mod:`keda`), established."""
        crds = [c for c in CRDS if c[0] not in skip]
        for group, plural, kind, versions, scope in crds:
            self.api("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd(
                group, plural, kind, versions, scope))
        names = {f"{plural}.{group}" for group, plural, *_ in crds}

        def established() -> bool:
            items = self.api("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
            done = {
                i["metadata"]["name"]
                for i in items["items"]
                if any(c["type"] == "Established" and c["status"] == "True"
                       for c in i.get("status", {}).get("conditions", []))
            }
            return names <= done

        self._wait(self.processes[1], "KEDA and Prometheus Operator CRDs", established)

    # ---- the API --------------------------------------------------------------------

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """One call to the API server as admin; the decoded answer (raises on >= 400)."""
        context = ssl.create_default_context(cafile=str(self.ca))
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.server}{path}", data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=30, context=context) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as error:
            raise ApiError(error.code, error.read().decode(errors="replace")) from None


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body[:2000]}")
        self.status = status
        self.body = body


def crd(group: str, plural: str, kind: str, versions: Sequence[str], scope: str) -> dict[str, Any]:
    """A structural CRD that keeps unknown fields (spec and status)."""
    schema = {
        "type": "object",
        "properties": {
            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": scope,
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind,
                      "listKind": f"{kind}List"},
            "versions": [
                {"name": v, "served": True, "storage": i == 0,
                 "schema": {"openAPIV3Schema": schema}, "subresources": {"status": {}}}
                for i, v in enumerate(versions)
            ],
        },
    }


def binaries_from_cache() -> Binaries:
    """The engines' folders of ``scripts/e2e/build.py`` (its cache), built or not."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import build

    cache = build.cache_dir()
    return Binaries(tuple(cache / "bin" / e.key for e in build.ENGINES.values()))


@contextlib.contextmanager
def running(**kwargs: Any) -> Iterator[Cluster]:
    with Cluster(binaries=binaries_from_cache(), **kwargs) as cluster:
        yield cluster


def real_node_options() -> dict[str, Any]:
    """``Cluster`` options of a real node that runs only the sandbox image (images.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import build
    import images

    cache = build.cache_dir()
    pause = images.pause_image(cache)
    return {"node": "real", "images": (images.image_archive(cache, pause),),
            "sandbox_image": pause}


def main() -> int:
    """Start the cluster, print its kubeconfig's path, stop it on Ctrl-C (or SIGTERM).
    ``--node real``: a real node (:mod:`node`) instead of kwok's; ``--sweep``: only restore
    what a killed harness's real node left (its cgroups and sysctls), then exit."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--node", choices=("kwok", "real"), default="kwok")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if args.sweep:
        import node

        node.sweep_dead_runs(node.state_dir(), lambda line: print(line, file=sys.stderr))
        return 0
    options = real_node_options() if args.node == "real" else {}
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with running(keep=False, **options) as cluster:
            cluster.install_crds()
            print(cluster.kubeconfig, flush=True)
            while True:
                signal.pause()
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
