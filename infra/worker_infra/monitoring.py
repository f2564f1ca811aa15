"""How Prometheus sees a service: the PodMonitor, and the labels of the series it scrapes.

The Prometheus Operator ignores ``prometheus.io/*`` annotations; without a PodMonitor (or
a ServiceMonitor) the scaler's load and age triggers get no data. One PodMonitor per
namespace, ``<project>-workers``, scrapes every pod of the service there (worker pods and
the scheduler) on its ``metrics`` port. The Operator labels each series with:

- ``job="<namespace>/<project>-workers"`` (the PodMonitor's namespace and name): the
  service, so another service's series (same queue names, same schedule names) never
  mix in;
- ``namespace``, ``pod``, ``container``, ``endpoint``, ``instance``;
- ``worker_template_pool`` (:data:`POOL_SERIES_LABEL`): the pod label
  ``worker-template/pool`` through ``podTargetLabels``; the scheduler, which exports the
  backlog of every pool (it never scales to zero), sets the label on those series itself.

:class:`PoolSeries` writes the matchers of one pool's series; the alert rules
(:mod:`.alerts`), the ScaledObject queries (:mod:`.scaler`) and the dashboard use them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s
from worker_runtime import contract

from .errors import GuardError
from .pool import POOL_LABEL

#: Label of the pool on the scraped series (the PodMonitor copies the pod label
#: ``worker-template/pool``; Prometheus turns it into ``worker_template_pool``).
POOL_SERIES_LABEL = contract.POOL_SERIES_LABEL

_LABEL_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def pod_monitor_name(project: str) -> str:
    """Name of the service's PodMonitor in each of its namespaces."""
    return f"{project}-workers"


def scrape_job(namespace: str, project: str) -> str:
    """The ``job`` label the Operator gives the series of ``project``'s pods in ``namespace``."""
    return f"{namespace}/{pod_monitor_name(project)}"


def check_selector_labels(labels: Mapping[str, str], source: str = "monitoringLabels") -> None:
    """Refuse labels Kubernetes would reject, in one line naming each bad entry."""
    if not isinstance(labels, Mapping):
        raise GuardError(f"{source}: expected a map of label: value, got {labels!r}")
    bad = [
        f"{key!r}: {value!r}"
        for key, value in labels.items()
        if not isinstance(key, str)
        or not isinstance(value, str)
        or len(key.rpartition("/")[0]) > 253
        or not _LABEL_NAME.match(key)
        or not _LABEL_VALUE.match(value)
    ]
    if bad:
        raise GuardError(
            f"{source}: not valid Kubernetes labels (name: [prefix/]name of at most 63 "
            f"characters, value: at most 63 alphanumerics, '-', '_', '.'): {', '.join(bad)}"
        )


@dataclass(frozen=True)
class PoolSeries:
    """The series of one pool of a service, as Prometheus holds them.

    Parameters:
      project: the service.
      pool: the pool's slug (the value of :data:`POOL_SERIES_LABEL`).
      namespace: namespace of the pool's pods (the sandbox pool's own).
      service_namespace: namespace of the scheduler, which exports the backlog of every
        pool (default: ``namespace``).
    """

    project: str
    pool: str
    namespace: str
    service_namespace: str | None = None

    def _matchers(self, namespace: str, extra: str) -> str:
        matchers = (
            f'namespace="{namespace}",job="{scrape_job(namespace, self.project)}",'
            f'{POOL_SERIES_LABEL}="{self.pool}"'
        )
        return f"{matchers},{extra}" if extra else matchers

    def workers(self, extra: str = "") -> str:
        """Matchers of the series the pool's own pods export (``extra`` appended)."""
        return self._matchers(self.namespace, extra)

    def backlog(self, extra: str = "") -> str:
        """Matchers of the pool's ``queue_*`` series in the service's namespace: the
        scheduler's (present at zero pods) and, for an ordinary pool, its pods' copies
        (the same values: combine with ``max``)."""
        return self._matchers(self.service_namespace or self.namespace, extra)


def queues_regex(queues: tuple[str, ...] | list[str], suffix: str = "") -> str:
    """A PromQL regex matching exactly ``queues`` (each with ``suffix``, e.g. ``.DQ``)."""
    return "|".join(q + suffix.replace(".", "\\\\.") for q in queues)


def pod_monitor(
    name: str,
    namespace: str,
    project: str,
    interval_s: int,
    labels: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> k8s.apiextensions.CustomResource:
    """A PodMonitor scraping every pod of ``project`` in ``namespace`` on its ``metrics``
    port, with the pool label copied onto the series; ``labels`` include the stack's
    ``monitoring_labels`` (what the Prometheus's ``podMonitorSelector`` wants)."""
    return k8s.apiextensions.CustomResource(
        name,
        api_version="monitoring.coreos.com/v1",
        kind="PodMonitor",
        metadata={"name": pod_monitor_name(project), "namespace": namespace, "labels": labels},
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
