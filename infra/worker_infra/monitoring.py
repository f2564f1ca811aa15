"""PodMonitor: how the Prometheus Operator scrapes a namespace's worker pods.

The Operator ignores ``prometheus.io/*`` annotations; without a PodMonitor (or a
ServiceMonitor) the scaler's load and age triggers get no data.
"""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from .pool import POOL_LABEL


def pod_monitor(
    name: str,
    namespace: str,
    project: str,
    interval_s: int,
    labels: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> k8s.apiextensions.CustomResource:
    """A PodMonitor scraping every worker pod of ``project`` in ``namespace`` on its
    ``metrics`` port, with the pool label copied onto the series."""
    return k8s.apiextensions.CustomResource(
        name,
        api_version="monitoring.coreos.com/v1",
        kind="PodMonitor",
        metadata={"name": f"{project}-workers", "namespace": namespace, "labels": labels},
        spec={
            "selector": {"matchLabels": {"app.kubernetes.io/name": project}},
            "namespaceSelector": {"matchNames": [namespace]},
            "podTargetLabels": [POOL_LABEL],
            "podMetricsEndpoints": [
                {"port": "metrics", "path": "/metrics", "interval": f"{interval_s}s"}
            ],
        },
        opts=opts,
    )
