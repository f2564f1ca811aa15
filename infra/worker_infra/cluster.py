"""The stack's cluster: an explicit Kubernetes provider from stack config."""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from .args import ClusterSpec
from .errors import GuardError


def cluster_provider(stack: str, cluster: ClusterSpec) -> k8s.Provider:
    """The provider every resource of the stack uses.

    Refuses (``GuardError``) a stack that names no kube context unless it explicitly
    allows the ambient one (``cluster.allowAmbient``, for a developer's own cluster):
    ``pulumi up --stack prod`` must never deploy to whatever context is current.
    """
    if cluster.context is None and not cluster.allow_ambient:
        raise GuardError(
            f"cluster guard: stack {stack!r} names no kube context; set cluster.context in "
            f"Pulumi.{stack}.yaml (the current context is never used by accident)"
        )
    return k8s.Provider(
        f"{stack}-cluster",
        context=cluster.context,
        kubeconfig=cluster.kubeconfig,
        opts=pulumi.ResourceOptions(),
    )
