"""Prometheus for ``make e2e``: Debian's ``prometheus`` (2.42, which has no Kubernetes
service discovery) in the real node's network, scraping the pods the stack's PodMonitors
select through targets this harness writes (``file_sd``), as the Prometheus Operator would.

Every :data:`REFRESH_S` a thread reads the live PodMonitors and pods from the API server and
writes one target per selected pod and endpoint port, with the labels the Operator gives its
series: ``job="<namespace>/<podmonitor>"``, ``namespace``, ``pod``, ``container``,
``endpoint``, each ``podTargetLabels`` label (sanitized: ``worker-template/pool`` becomes
``worker_template_pool``), the endpoint's path and interval. What :mod:`worker_infra.scaler`
queries and :mod:`worker_infra.alerts` evaluates is therefore what a cluster with the Operator
holds. The PodMonitor's own fields are not validated here (the render tests do that).

Listens on the bridge's address (:data:`node.GATEWAY`:\\ :data:`PORT`), where the ScaledObjects'
``serverAddress`` points; the harness queries it through a relay on its own loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any

import node
import relay

if TYPE_CHECKING:
    import cluster as cl

PORT = 9090
REFRESH_S = 2.0
URL = f"http://{node.GATEWAY}:{PORT}"


def label_name(name: str) -> str:
    """A Kubernetes label name as Prometheus's Kubernetes discovery sanitizes it."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    want = selector.get("matchLabels", {})
    return all(labels.get(k) == v for k, v in want.items()) and not selector.get(
        "matchExpressions"
    )


def targets(monitors: list[dict[str, Any]], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """file_sd target groups for ``monitors`` over ``pods`` (see the module doc)."""
    groups = []
    for monitor in monitors:
        meta, spec = monitor["metadata"], monitor["spec"]
        names = spec.get("namespaceSelector", {}).get("matchNames") or [meta["namespace"]]
        for pod in pods:
            pmeta = pod["metadata"]
            ip = pod.get("status", {}).get("podIP")
            if not ip or pmeta["namespace"] not in names:
                continue
            if not matches(spec.get("selector", {}), pmeta.get("labels", {})):
                continue
            for endpoint in spec.get("podMetricsEndpoints", []):
                for container in pod["spec"]["containers"]:
                    for port in container.get("ports", []):
                        if port.get("name") != endpoint.get("port"):
                            continue
                        labels = {
                            "job": f"{meta['namespace']}/{meta['name']}",
                            "namespace": pmeta["namespace"],
                            "pod": pmeta["name"],
                            "container": container["name"],
                            "endpoint": endpoint["port"],
                            "__metrics_path__": endpoint.get("path", "/metrics"),
                        }
                        if "interval" in endpoint:
                            labels["__scrape_interval__"] = endpoint["interval"]
                        for name in spec.get("podTargetLabels", []):
                            if pmeta.get("labels", {}).get(name):
                                labels[label_name(name)] = pmeta["labels"][name]
                        groups.append(
                            {"targets": [f"{ip}:{port['containerPort']}"], "labels": labels}
                        )
    return groups


class Prometheus:
    """Debian's Prometheus in the node, its targets kept current (see the module doc)."""

    def __init__(self, cluster: cl.Cluster, real_node: node.Node) -> None:
        self.cluster = cluster
        self.node = real_node
        self.dir = cluster.dir / "prometheus"
        self.file = self.dir / "targets.json"
        self.process: cl.Process | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, daemon=True)
        self.relay: relay.Relay | None = None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.file.exists():
            self.file.write_text("[]")
        (self.dir / "prometheus.yml").write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
                    "scrape_configs": [
                        {
                            "job_name": "podmonitors",
                            "file_sd_configs": [
                                {"files": [str(self.file)], "refresh_interval": "5s"}
                            ],
                        }
                    ],
                },
                indent=1,
            )
        )
        self.process = self.node.spawn(
            "prometheus",
            [
                "prometheus",
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address={node.GATEWAY}:{PORT}",
                "--log.level=warn",
            ],
        )
        if self.relay is None:
            self.relay = relay.Relay(
                listen=(None, "127.0.0.1", 0), connect=(self.node.netns, node.GATEWAY, PORT)
            )
            self.node.relays.append(self.relay)
        self.cluster._wait(self.process, "Prometheus", lambda: self._get("/-/ready") is not None)
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self) -> None:
        """Prometheus ends (SIGTERM to its process group); the targets stay written."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.popen.pid, signal.SIGTERM)
        self.process.popen.wait(30)

    def close(self) -> None:
        self._stop.set()

    def _refresh(self) -> None:
        written = ""
        while not self._stop.wait(REFRESH_S):
            with contextlib.suppress(Exception):
                monitors = self.cluster.api(
                    "GET", "/apis/monitoring.coreos.com/v1/podmonitors"
                )["items"]
                pods = self.cluster.api("GET", "/api/v1/pods")["items"]
                text = json.dumps(targets(monitors, pods), indent=1, sort_keys=True)
                if text != written:
                    part = self.file.with_suffix(".part")
                    part.write_text(text)
                    part.replace(self.file)
                    written = text

    def _get(self, path: str) -> bytes | None:
        assert self.relay is not None
        try:
            url = f"http://127.0.0.1:{self.relay.port}{path}"
            with urllib.request.urlopen(url, timeout=5) as response:
                return bytes(response.read())
        except OSError:
            return None

    def query(self, promql: str) -> list[dict[str, Any]] | None:
        """The instant vector of ``promql`` (None while Prometheus does not answer)."""
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        if body is None:
            return None
        result: list[dict[str, Any]] = json.loads(body)["data"]["result"]
        return result

    def value(self, promql: str) -> float | None:
        """The single value of ``promql``, or None (no data, or no answer)."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None
