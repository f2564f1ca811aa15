"""The real KEDA (``make e2e``): its operator and its metrics adapter, built by
``make e2e-build`` (:mod:`build`, v2.21.0), with KEDA's own CRDs and RBAC from that module's
``config/`` folder, against the control plane of :mod:`cluster` and its real node (:mod:`node`).

- **identity**: both run as KEDA's ServiceAccount ``keda/keda-operator`` (a token from the
  TokenRequest API), bound by KEDA's own ClusterRoles and Roles (``config/rbac``,
  ``config/metrics-server``): no ``system:masters``;
- **operator**: in the node's network (it queries Prometheus and Redis at the bridge's
  address, :data:`node.GATEWAY`, as the ScaledObjects say), the API server through the
  node's relay; its metrics service (gRPC, mTLS with KEDA's CA) relayed to the host;
- **metrics adapter**: an aggregated API server on the host's loopback, registered as
  ``v1beta1.external.metrics.k8s.io`` (an ExternalName Service to ``localhost``, as no
  kube-proxy runs); the aggregator verifies its serving certificate (the APIService's
  ``caBundle``), and the adapter authenticates the aggregator by the front-proxy client
  certificate (:class:`cluster.FrontProxy`, read from ``extension-apiserver-authentication``)
  and authorizes the user it names (the HPA controller) by a SubjectAccessReview;
- everything ends with the cluster (its processes are the cluster's).
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import build
import pki
import relay

if TYPE_CHECKING:
    import cluster as cl
    import node as nd

NAMESPACE = "keda"
ACCOUNT = "keda-operator"
METRICS_SERVICE = "keda-metrics-apiserver"
OPERATOR_SERVICE = "keda-operator"
API_SERVICE = "v1beta1.external.metrics.k8s.io"
#: The operator's metrics service (gRPC) in the node's network.
GRPC_PORT = 9666
#: Seconds the ServiceAccount token lasts (longer than any run).
TOKEN_S = 6 * 3600
#: KEDA's manifests applied as they are (besides its CRDs): its namespace, ServiceAccount and
#: RBAC. Its Deployments, Service and APIService are what this module runs instead.
MANIFESTS = (
    "general/namespace.yaml",
    "service_account/service_account.yaml",
    "rbac/role.yaml",
    "rbac/role_binding.yaml",
    "rbac/aggregate_cluster_roles.yaml",
    "metrics-server/role.yaml",
    "metrics-server/role_binding.yaml",
)


def module_dir() -> Path:
    """KEDA's module source, as ``make e2e-build`` downloaded it (its ``config/``)."""
    path = (
        build.cache_dir() / "go" / "mod" / "github.com" / "kedacore" / "keda"
        / f"v2@{build.KEDA_VERSION}"
    )
    if not (path / "config").is_dir():
        raise FileNotFoundError(f"{path}: KEDA's module not downloaded (make e2e-build)")
    return path


def api_path(doc: dict[str, Any]) -> str:
    """The collection path of a manifest's object (``<kind>s``: every kind applied here)."""
    version = doc["apiVersion"]
    prefix = "/api/v1" if version == "v1" else f"/apis/{version}"
    namespace = doc["metadata"].get("namespace")
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"{prefix}{scope}/{doc['kind'].lower()}s"


def apply_files(cluster: cl.Cluster, files: list[Path]) -> None:
    import yaml

    for file in files:
        for doc in yaml.safe_load_all(file.read_text()):
            if doc:
                cluster.api("POST", api_path(doc), doc)


class Keda:
    """KEDA's operator and metrics adapter on a :class:`cluster.Cluster` with a real node."""

    def __init__(self, cluster: cl.Cluster, real_node: nd.Node) -> None:
        self.cluster = cluster
        self.node = real_node
        self.dir = cluster.dir / "keda"
        self.source = module_dir()

    def start(self) -> None:
        config = self.source / "config"
        apply_files(self.cluster, sorted((config / "crd" / "bases").glob("*.yaml")))
        apply_files(self.cluster, [config / m for m in MANIFESTS])
        self._wait_crds()
        kubeconfig = self._kubeconfig()
        certs = self._certs()
        env = [
            "env",
            f"KUBECONFIG={kubeconfig}",
            f"POD_NAMESPACE={NAMESPACE}",
            f"KEDA_CLUSTER_OBJECT_NAMESPACE={NAMESPACE}",
            "WATCH_NAMESPACE=",
        ]
        (self.dir / "scaler-cas").mkdir(exist_ok=True)
        health = self.node_port()
        operator = self.node.spawn(
            "keda-operator",
            [
                *env,
                self.cluster.binaries.find("operator"),
                "--zap-log-level=info",
                "--zap-encoder=console",
                "--metrics-bind-address=0",
                f"--health-probe-bind-address=127.0.0.1:{health}",
                f"--metrics-service-bind-address=127.0.0.1:{GRPC_PORT}",
                f"--cert-dir={certs}",
                "--enable-cert-rotation=false",
                f"--ca-dir={self.dir / 'scaler-cas'}",  # none: the scalers' own CAs
            ],
        )
        self.cluster._wait(
            operator,
            "KEDA operator",
            lambda: "ok" in self.node.run(
                "python3", "-c",
                "import urllib.request as u;"
                f"print(u.urlopen('http://127.0.0.1:{health}/readyz',timeout=2).read().decode())",
            ),
        )
        grpc = relay.Relay(
            listen=(None, "127.0.0.1", 0), connect=(self.node.netns, "127.0.0.1", GRPC_PORT)
        )
        self.node.relays.append(grpc)
        from cluster import free_port

        port = free_port()
        adapter = self.cluster._spawn(
            "keda-adapter",
            [
                *env,
                self.cluster.binaries.find("adapter"),
                f"--secure-port={port}",
                "--bind-address=127.0.0.1",
                f"--cert-dir={certs}",
                f"--tls-cert-file={certs / 'tls.crt'}",
                f"--tls-private-key-file={certs / 'tls.key'}",
                f"--client-ca-file={certs / 'ca.crt'}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--lister-kubeconfig={kubeconfig}",
                f"--port={free_port()}",
                f"--metrics-service-address=127.0.0.1:{grpc.port}",
                "--metrics-service-grpc-authority="
                f"{OPERATOR_SERVICE}.{NAMESPACE}.svc.cluster.local",
                "--zap-log-level=info",
            ],
        )
        self._register(port, certs / "ca.crt")
        self.cluster._wait(adapter, "KEDA metrics adapter (aggregated API)", self._available)

    def node_port(self) -> int:
        from node import cl_free_port

        return cl_free_port()

    def _wait_crds(self) -> None:
        def established() -> bool:
            items = self.cluster.api(
                "GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
            )["items"]
            keda = [i for i in items if i["spec"]["group"].endswith("keda.sh")]
            return len(keda) >= 6 and all(
                any(
                    c["type"] == "Established" and c["status"] == "True"
                    for c in i.get("status", {}).get("conditions", [])
                )
                for i in keda
            )

        self.cluster._wait(self.cluster.processes[1], "KEDA's CRDs", established)

    def _kubeconfig(self) -> Path:
        """A kubeconfig with a token of KEDA's ServiceAccount (TokenRequest API)."""
        review = self.cluster.api(
            "POST",
            f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{ACCOUNT}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": TOKEN_S},
            },
        )
        self.cluster.tokens["keda"] = review["status"]["token"]
        self.dir.mkdir(parents=True, exist_ok=True)
        return self.cluster._kubeconfig("keda", self.dir / "keda.kubeconfig")

    def _certs(self) -> Path:
        """KEDA's CA and one certificate for the operator's gRPC service, the adapter's
        serving and its gRPC client (KEDA's own cert manager makes the same one), named as
        KEDA reads them: ``ca.crt``, ``tls.crt``, ``tls.key``."""
        folder = self.dir / "certs"
        authority = pki.ca(self.dir / "pki", "keda-ca")
        names = [
            f"{service}.{NAMESPACE}.svc{suffix}"
            for service in (OPERATOR_SERVICE, METRICS_SERVICE)
            for suffix in ("", ".cluster.local")
        ]
        pair = pki.leaf(
            authority, self.dir / "pki", "keda", "keda", dns=[*names, "localhost"],
            ips=["127.0.0.1"],
        )
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(authority.cert, folder / "ca.crt")
        shutil.copy(pair.cert, folder / "tls.crt")
        shutil.copy(pair.key, folder / "tls.key")
        os.chmod(folder / "tls.key", 0o600)
        return folder

    def _register(self, port: int, ca: Path) -> None:
        """The adapter's Service (ExternalName: no kube-proxy here) and KEDA's APIService
        with the CA that signed its serving certificate."""
        self.cluster.api(
            "POST",
            f"/api/v1/namespaces/{NAMESPACE}/services",
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": METRICS_SERVICE, "namespace": NAMESPACE},
                "spec": {"type": "ExternalName", "externalName": "localhost"},
            },
        )
        self.cluster.api(
            "POST",
            "/apis/apiregistration.k8s.io/v1/apiservices",
            {
                "apiVersion": "apiregistration.k8s.io/v1",
                "kind": "APIService",
                "metadata": {"name": API_SERVICE},
                "spec": {
                    "service": {"name": METRICS_SERVICE, "namespace": NAMESPACE, "port": port},
                    "group": "external.metrics.k8s.io",
                    "version": "v1beta1",
                    "caBundle": base64.b64encode(ca.read_bytes()).decode(),
                    "groupPriorityMinimum": 100,
                    "versionPriority": 100,
                },
            },
        )

    def _available(self) -> bool:
        service = self.cluster.api(
            "GET", f"/apis/apiregistration.k8s.io/v1/apiservices/{API_SERVICE}"
        )
        conditions = {
            c["type"]: c["status"] for c in service.get("status", {}).get("conditions", [])
        }
        if conditions.get("Available") != "True":
            return False
        self.cluster.api("GET", "/apis/external.metrics.k8s.io/v1beta1")
        return True

    def external_metric(self, namespace: str, metric: str, scaled_object: str) -> Any:
        """One external metric through the aggregator, as the HPA reads it."""
        return self.cluster.api(
            "GET",
            f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{namespace}/{metric}"
            f"?labelSelector=scaledobject.keda.sh%2Fname%3D{scaled_object}",
        )
