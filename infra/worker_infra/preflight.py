"""Preflight: what a stack needs from its cluster and its broker, checked before anything
is created, so ``pulumi preview`` fails with one line per missing step instead of
``pulumi up`` hanging or failing half-way.

- the KEDA CRDs (every pool's ScaledObject and TriggerAuthentication);
- the Prometheus Operator CRDs, unless the stack turns the PodMonitors and the
  PrometheusRule off (``podMonitor: false``, ``prometheusRule: false``);
- the sandbox's RuntimeClass (``sandbox.runtimeClass``), unless the stack creates it
  (``sandbox.runtimeHandler``);
- the sandbox's Redis ACL user, which only the broker's operator can create: the line
  gives the ``ACL SETUSER`` command (with the password taken from the stack config, never
  printed) and the stack option that records it was run;
- no Deployment whose selector would change: Kubernetes cannot change it in place, and
  under a fixed name Pulumi would delete the pool before its replacement exists.

The cluster is read through a :class:`ClusterView` (:func:`cluster_view`): the live
cluster of the stack's context (the ``kubernetes`` client, read-only), or what
:func:`using` installs (a test's fake; :data:`OFFLINE` for the offline render, which
renders what would be deployed and checks nothing live).
"""

from __future__ import annotations

import contextlib
import contextvars
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .acl import ACL_COMMANDS, acl_key_patterns
from .args import ClusterSpec, ServiceSpec
from .errors import GuardError
from .pool import pool_labels

#: CRDs of KEDA (every pool's scaler).
KEDA_CRDS = ("scaledobjects.keda.sh", "triggerauthentications.keda.sh")
KEDA_INSTALL = (
    "helm repo add kedacore https://kedacore.github.io/charts && "
    "helm install keda kedacore/keda --namespace keda --create-namespace"
)
#: CRDs of the Prometheus Operator (PodMonitor, PrometheusRule).
POD_MONITOR_CRD = "podmonitors.monitoring.coreos.com"
PROMETHEUS_RULE_CRD = "prometheusrules.monitoring.coreos.com"
PROMETHEUS_INSTALL = (
    "helm repo add prometheus-community https://prometheus-community.github.io/helm-charts "
    "&& helm install prometheus-operator-crds prometheus-community/prometheus-operator-crds"
)


class ClusterView(Protocol):
    """What the preflight reads of a cluster (read-only)."""

    def has_crd(self, name: str) -> bool:
        """Whether the CustomResourceDefinition ``name`` (``<plural>.<group>``) exists."""
        ...

    def has_runtime_class(self, name: str) -> bool:
        """Whether the RuntimeClass ``name`` exists."""
        ...

    def deployment_selector(self, namespace: str, name: str) -> Mapping[str, str] | None:
        """``spec.selector.matchLabels`` of the live Deployment, None when there is none."""
        ...


@dataclass(frozen=True)
class Offline:
    """The offline render's view: nothing live is checked (it renders what would be
    deployed; ``pulumi preview`` checks the cluster)."""

    def has_crd(self, name: str) -> bool:
        return True

    def has_runtime_class(self, name: str) -> bool:
        return True

    def deployment_selector(self, namespace: str, name: str) -> Mapping[str, str] | None:
        return None


OFFLINE = Offline()
_VIEW: contextvars.ContextVar[ClusterView | None] = contextvars.ContextVar(
    "worker_infra_cluster_view", default=None
)


@contextlib.contextmanager
def using(view: ClusterView) -> Iterator[None]:
    """Make :func:`cluster_view` return ``view`` inside the block (tests, offline render)."""
    token = _VIEW.set(view)
    try:
        yield
    finally:
        _VIEW.reset(token)


class KubeCluster:
    """The live cluster of a kubeconfig context, read with the ``kubernetes`` client."""

    def __init__(self, cluster: ClusterSpec) -> None:
        from kubernetes import client, config

        kubeconfig = cluster.kubeconfig
        if kubeconfig is not None and "\n" in kubeconfig:
            import yaml

            api = config.new_client_from_config_dict(
                yaml.safe_load(kubeconfig), context=cluster.context
            )
        else:
            api = config.new_client_from_config(config_file=kubeconfig, context=cluster.context)
        self._client = client
        self._api = api

    def _found(self, call: Any, *args: str) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return call(*args)
        except ApiException as error:
            if error.status == 404:
                return None
            raise GuardError(
                f"preflight: the cluster refused to read {args}: {error.status} {error.reason}"
            ) from None

    def has_crd(self, name: str) -> bool:
        api = self._client.ApiextensionsV1Api(self._api)
        return self._found(api.read_custom_resource_definition, name) is not None

    def has_runtime_class(self, name: str) -> bool:
        api = self._client.NodeV1Api(self._api)
        return self._found(api.read_runtime_class, name) is not None

    def deployment_selector(self, namespace: str, name: str) -> Mapping[str, str] | None:
        api = self._client.AppsV1Api(self._api)
        live = self._found(api.read_namespaced_deployment, name, namespace)
        if live is None:
            return None
        return dict(live.spec.selector.match_labels or {})


def current() -> ClusterView | None:
    """The view :func:`using` installed, None outside such a block."""
    return _VIEW.get()


def cluster_view(cluster: ClusterSpec) -> ClusterView:
    """The view :func:`using` installed, else the live cluster of ``cluster``'s context."""
    view = _VIEW.get()
    if view is not None:
        return view
    from kubernetes.config import ConfigException

    try:
        return KubeCluster(cluster)
    except (ConfigException, OSError, ValueError) as error:
        where = cluster.context or "the current context"
        raise GuardError(
            f"preflight: cannot read the cluster of {where}: {' '.join(str(error).split())}"
        ) from None


def acl_setuser_command(user: str, namespace: str) -> str:
    """The ``redis-cli ACL SETUSER`` command that creates the sandbox's user (its rule of
    :func:`.acl.acl_rule`), the password read from the stack config by the shell."""
    words = [
        *(shlex.quote(w) for w in ("redis-cli", "ACL", "SETUSER", user, "reset", "on")),
        '">$(pulumi config get sandboxRedisPassword)"',
        *(shlex.quote(w) for w in ("resetchannels", *acl_key_patterns(namespace), *ACL_COMMANDS)),
    ]
    return " ".join(words)


def problems(spec: ServiceSpec, view: ClusterView) -> list[str]:
    """One line per missing prerequisite of ``spec`` on the cluster ``view`` shows (none
    for :data:`OFFLINE`: the offline render checks nothing live, the ACL user included)."""
    if isinstance(view, Offline):
        return []
    found: list[str] = []
    missing_keda = [crd for crd in KEDA_CRDS if not view.has_crd(crd)]
    if missing_keda:
        found.append(
            f"KEDA is not installed (CRD {', '.join(missing_keda)} missing; every pool's "
            f"scaler needs it): {KEDA_INSTALL}"
        )
    prometheus = [
        (crd, option)
        for crd, option, wanted in (
            (POD_MONITOR_CRD, "podMonitor: false", spec.scaling.pod_monitor),
            (PROMETHEUS_RULE_CRD, "prometheusRule: false", spec.prometheus_rule),
        )
        if wanted and not view.has_crd(crd)
    ]
    for crd, option in prometheus:
        found.append(
            f"the Prometheus Operator CRD {crd} is missing: {PROMETHEUS_INSTALL}; or, on a "
            f"cluster without the Prometheus Operator, set {option} in the stack"
        )
    sandboxed = [p for p in spec.pools if p.sandbox]
    sb = spec.sandbox
    if (
        sandboxed
        and sb.runtime_class
        and not sb.runtime_handler
        and not view.has_runtime_class(sb.runtime_class)
    ):
        found.append(
            f"RuntimeClass {sb.runtime_class!r} (sandbox.runtimeClass) is missing: "
            "install gVisor on the nodes (https://gvisor.dev/docs/user_guide/install/) "
            "and create it, or set sandbox.runtimeHandler (e.g. runsc) to have this "
            "stack create it; on a cluster without gVisor remove sandbox.runtimeClass"
        )
    if sandboxed and sb.broker_user and not sb.broker_acl_installed:
        found.append(
            f"the broker has no ACL user {sb.broker_user!r} for the sandbox pool yet (only "
            "the broker's operator can create it; the sandbox's pods log in as it): run "
            f"{acl_setuser_command(sb.broker_user, sandboxed[0].broker_namespace)} against "
            "the broker (or add the stack output sandboxBrokerAcl to its aclfile), then "
            "set sandbox.brokerAclInstalled: true in the stack"
        )
    found += selector_problems(spec, view)
    return found


def selector_problems(spec: ServiceSpec, view: ClusterView) -> list[str]:
    """Deployments whose live ``spec.selector`` differs from the one this stack renders."""
    found = []
    sandbox_ns = spec.sandbox.namespace or f"{spec.namespace}-sandbox"
    for pool in spec.pools:
        namespace = sandbox_ns if pool.sandbox else spec.namespace
        name = f"{spec.project}-{pool.slug}"
        wanted = pool_labels(spec.project, pool.slug)
        live = view.deployment_selector(namespace, name)
        if live is not None and dict(live) != wanted:
            found.append(
                f"Deployment {namespace}/{name}: spec.selector would change from "
                f"{dict(live)} to {wanted}; Kubernetes cannot change it in place and "
                "Pulumi would delete the pool before its replacement exists: delete the "
                "Deployment in a maintenance window or give the pool a new name"
            )
    return found


def check(spec: ServiceSpec, view: ClusterView) -> None:
    """Raise :class:`GuardError` listing every problem (one line each) of :func:`problems`."""
    found = problems(spec, view)
    if found:
        raise GuardError("\n".join(f"preflight: {line}" for line in found))


__all__: Sequence[str] = (
    "OFFLINE",
    "ClusterView",
    "KubeCluster",
    "check",
    "cluster_view",
    "current",
    "problems",
    "using",
)
