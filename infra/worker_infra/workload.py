"""One restricted workload: Deployment, token-less ServiceAccount and PodDisruptionBudget.

The worker pools (:mod:`.pool`) and the scheduler (:mod:`.scheduler`) run the same kind of
pod: one container running ``<project> <component>`` under the Pod Security Standard
"restricted" with a read-only root filesystem, a size-limited ``/tmp``, the stack-merged
pools file mounted from a ConfigMap, a ``healthcheck live`` liveness probe and a
``metrics`` port; its Deployment never surges and carries the checkov skips; a
PodDisruptionBudget lets one pod go at a time. This module owns that shape; the callers
state only what differs (:class:`Workload`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import pulumi
import pulumi_kubernetes as k8s

from .poolsfile import CHECKSUM_ANNOTATION, POOLS_KEY, POOLS_MOUNT
from .rollout import TIMEOUT_ANNOTATION, rollout_timeout_s

#: Checkov checks a workload Deployment may not meet on purpose, each with its reason. They
#: render as ``checkov.io/skipN: CHECK=reason`` annotations on the Deployments they apply to
#: (:func:`checkov_skips`), so the reason sits next to the object it excuses (a reason must
#: not contain "=": checkov splits on it).
CHECKOV_SKIPS = {
    "CKV_K8S_11": (
        "no CPU limit on purpose: CFS throttling stalls heartbeats and probes under load;"
        " CPU is reserved by the request (the sandbox pod, which runs untrusted code, has one)"
    ),
    "CKV_K8S_15": (
        "IfNotPresent on purpose: the image is pinned by digest, so the node's copy is the"
        " image; a tag (mutable) is pulled Always"
    ),
    "CKV_K8S_35": (
        "the worker reads its broker and database URLs from its environment (the settings"
        " contract); they come from secretKeyRef and never as plain values (guarded)"
    ),
    "CKV_K8S_43": (
        "the image reference is the stack image setting, a tag pulled Always: set it to"
        " repo@sha256:<digest> to pin a digest"
    ),
}
TMP_SIZE = "512Mi"
#: The RollingUpdate strategy of every workload: never surge (the capacity budget counts
#: no extra pod), replace one pod at a time.
MAX_SURGE, MAX_UNAVAILABLE = 0, 1
#: Spread of a workload's pods when :attr:`Workload.spread` is set (most to least wide).
SPREAD_KEYS = ("topology.kubernetes.io/zone", "kubernetes.io/hostname")


def pinned_by_digest(image: str) -> bool:
    """Whether ``image`` names a digest (``repo@sha256:...``), which cannot change."""
    return "@sha256:" in image


def image_pull_policy(image: str) -> str:
    """``IfNotPresent`` for an image pinned by digest, ``Always`` for a tag: a tag is
    mutable (``dev``, ``staging``, even a release tag can be pushed again), and a node's
    cached copy of it may be another image than the one the stack names."""
    return "IfNotPresent" if pinned_by_digest(image) else "Always"


def checkov_skips(w: Workload) -> dict[str, str]:
    """The checks of :data:`CHECKOV_SKIPS` that ``w``'s Deployment does not meet: no CPU
    limit (CKV_K8S_11), IfNotPresent for a digest (CKV_K8S_15), a tag and no digest
    (CKV_K8S_43), secrets in the environment (CKV_K8S_35, always)."""
    digest = pinned_by_digest(w.image)
    wanted = {
        "CKV_K8S_11": w.cpu_limit is None,
        "CKV_K8S_15": digest,
        "CKV_K8S_35": True,
        "CKV_K8S_43": not digest,
    }
    return {check: CHECKOV_SKIPS[check] for check, skip in wanted.items() if skip}


def checkov_annotations(skips: Mapping[str, str]) -> dict[str, str]:
    """The ``checkov.io/skipN`` annotations of ``skips`` (for a Deployment)."""
    return {
        f"checkov.io/skip{n}": f"{check}={reason}"
        for n, (check, reason) in enumerate(sorted(skips.items()), 1)
    }


def restricted_pod_security(run_as_user: int) -> k8s.core.v1.PodSecurityContextArgs:
    """Pod-level part of the Pod Security Standard "restricted"."""
    return k8s.core.v1.PodSecurityContextArgs(
        run_as_non_root=True,
        run_as_user=run_as_user,
        run_as_group=run_as_user,
        fs_group=run_as_user,
        seccomp_profile=k8s.core.v1.SeccompProfileArgs(type="RuntimeDefault"),
    )


def restricted_container_security() -> k8s.core.v1.SecurityContextArgs:
    """Container-level part of "restricted", plus a read-only root filesystem."""
    return k8s.core.v1.SecurityContextArgs(
        allow_privilege_escalation=False,
        privileged=False,
        run_as_non_root=True,
        read_only_root_filesystem=True,
        capabilities=k8s.core.v1.CapabilitiesArgs(drop=["ALL"]),
        seccomp_profile=k8s.core.v1.SeccompProfileArgs(type="RuntimeDefault"),
    )


def container_env(
    plain: Mapping[str, str], secrets: Sequence[tuple[str, str, str]]
) -> list[k8s.core.v1.EnvVarArgs]:
    """The ``plain`` variables as values, then each ``(variable, secret, key)`` of
    ``secrets`` as a ``secretKeyRef`` (a secret never appears as a value)."""
    env = [k8s.core.v1.EnvVarArgs(name=k, value=v) for k, v in plain.items()]
    env += [
        k8s.core.v1.EnvVarArgs(
            name=var,
            value_from=k8s.core.v1.EnvVarSourceArgs(
                secret_key_ref=k8s.core.v1.SecretKeySelectorArgs(name=secret, key=key)
            ),
        )
        for var, secret, key in secrets
    ]
    return env


@dataclass(frozen=True)
class Workload:
    """What one restricted workload states; :func:`restricted_workload` builds the rest.

    Parameters:
      name: name of the Deployment, ServiceAccount and PodDisruptionBudget
        (``<project>-<pool>``, ``<project>-scheduler``).
      namespace: their namespace.
      selector: labels selecting the pods (unique per workload within the namespace).
      labels: labels of every object and pod (``selector`` included).
      project: the service; its console script is the container command.
      component: the subcommand (``worker``, ``scheduler``), also the container's name.
      image: image reference with tag.
      env: the container's environment (see :func:`container_env`).
      replicas: the Deployment's replica count.
      cpu: CPU request.
      cpu_limit: CPU limit; None (the default): none (see :data:`CHECKOV_SKIPS`).
      memory: memory request and limit.
      stalled_after_s: ``healthcheck live --stalled-after`` of the liveness probe.
      readiness: the readiness probe.
      grace_period_s: ``terminationGracePeriodSeconds``.
      metrics_port: the ``metrics`` container port.
      run_as_user: UID and GID of the container (non-root).
      pools_config_map, pools_checksum: the stack-merged pools file's ConfigMap (mounted at
        :data:`.poolsfile.POOLS_MOUNT`) and its SHA-256 (a pod-template annotation: a change
        rolls the pods); None (the default): no mount, the image's pools.toml.
      min_ready_seconds: the Deployment's ``minReadySeconds`` (default None).
      runtime_class, priority_class: of the pods (default None: the cluster's defaults).
      spread: spread the pods over zones and hosts (default False).
      owns_replicas: the Deployment keeps its replica count; False (a scaler owns it):
        Pulumi sets ``replicas`` once and then ignores it (default True).
      rollout_replicas: the most pods a rollout may have to replace (a scaled pool's
        capped maximum); None (the default): ``replicas``. Sizes Pulumi's wait
        (:mod:`.rollout`).
    """

    name: str
    namespace: pulumi.Input[str]
    selector: dict[str, str]
    labels: dict[str, str]
    project: str
    component: str
    image: str
    env: list[k8s.core.v1.EnvVarArgs]
    replicas: int
    cpu: str
    memory: str
    stalled_after_s: int
    readiness: k8s.core.v1.ProbeArgs
    grace_period_s: int
    metrics_port: int
    run_as_user: int
    cpu_limit: str | None = None
    pools_config_map: str | None = None
    pools_checksum: str | None = None
    min_ready_seconds: int | None = None
    runtime_class: str | None = None
    priority_class: str | None = None
    spread: bool = False
    owns_replicas: bool = True
    rollout_replicas: int | None = None

    @property
    def rollout_timeout_s(self) -> int:
        """Seconds Pulumi waits at most for this workload's rollout (:mod:`.rollout`)."""
        return rollout_timeout_s(
            self.replicas if self.rollout_replicas is None else self.rollout_replicas,
            MAX_SURGE,
            MAX_UNAVAILABLE,
            self.min_ready_seconds or 0,
            self.grace_period_s,
        )

    def command(self, *words: str) -> list[str]:
        """The service's console script with ``words``."""
        return [self.project, *words]


def readiness_probe(
    *, command: list[str] | None = None, http_path: str | None = None
) -> k8s.core.v1.ProbeArgs:
    """The readiness probe: run ``command`` or GET ``http_path`` on the ``metrics`` port
    (give one; both default None), every 10 s, unready after 3 failures of 5 s."""
    return k8s.core.v1.ProbeArgs(
        exec_=None if command is None else k8s.core.v1.ExecActionArgs(command=command),
        http_get=None
        if http_path is None
        else k8s.core.v1.HTTPGetActionArgs(path=http_path, port="metrics"),
        period_seconds=10,
        timeout_seconds=5,
        failure_threshold=3,
    )


class WorkloadResources(NamedTuple):
    """The objects :func:`restricted_workload` creates."""

    service_account: k8s.core.v1.ServiceAccount
    deployment: k8s.apps.v1.Deployment
    pdb: k8s.policy.v1.PodDisruptionBudget


def _volumes(
    w: Workload,
) -> tuple[list[k8s.core.v1.VolumeMountArgs], list[k8s.core.v1.VolumeArgs]]:
    """``/tmp`` (an emptyDir of :data:`TMP_SIZE`) and, with a ConfigMap, the pools file."""
    mounts = [k8s.core.v1.VolumeMountArgs(name="tmp", mount_path="/tmp")]
    volumes = [
        k8s.core.v1.VolumeArgs(
            name="tmp", empty_dir=k8s.core.v1.EmptyDirVolumeSourceArgs(size_limit=TMP_SIZE)
        )
    ]
    if w.pools_config_map:
        mounts.append(
            k8s.core.v1.VolumeMountArgs(name="pools", mount_path=POOLS_MOUNT, read_only=True)
        )
        volumes.append(
            k8s.core.v1.VolumeArgs(
                name="pools",
                config_map=k8s.core.v1.ConfigMapVolumeSourceArgs(
                    name=w.pools_config_map,
                    items=[k8s.core.v1.KeyToPathArgs(key=POOLS_KEY, path=POOLS_KEY)],
                ),
            )
        )
    return mounts, volumes


def _container(w: Workload, mounts: list[k8s.core.v1.VolumeMountArgs]) -> k8s.core.v1.ContainerArgs:
    """The one container: ``<project> <component>``, restricted, probed, memory-limited."""
    return k8s.core.v1.ContainerArgs(
        name=w.component,
        image=w.image,
        image_pull_policy=image_pull_policy(w.image),
        command=w.command(w.component),
        env=w.env,
        ports=[
            k8s.core.v1.ContainerPortArgs(
                name="metrics", container_port=w.metrics_port, protocol="TCP"
            )
        ],
        resources=k8s.core.v1.ResourceRequirementsArgs(
            requests={"cpu": w.cpu, "memory": w.memory},
            limits={"memory": w.memory, **({"cpu": w.cpu_limit} if w.cpu_limit else {})},
        ),
        liveness_probe=k8s.core.v1.ProbeArgs(
            exec_=k8s.core.v1.ExecActionArgs(
                command=w.command("healthcheck", "live", "--stalled-after", str(w.stalled_after_s))
            ),
            initial_delay_seconds=10,
            period_seconds=15,
            timeout_seconds=5,
            failure_threshold=3,
        ),
        readiness_probe=w.readiness,
        security_context=restricted_container_security(),
        volume_mounts=mounts,
    )


def _pod_spec(w: Workload) -> k8s.core.v1.PodSpecArgs:
    """The pod: its own token-less ServiceAccount, no service links, restricted."""
    mounts, volumes = _volumes(w)
    spread = [
        k8s.core.v1.TopologySpreadConstraintArgs(
            max_skew=1,
            topology_key=key,
            when_unsatisfiable="ScheduleAnyway",
            label_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=w.selector),
            match_label_keys=["pod-template-hash"],
        )
        for key in SPREAD_KEYS
    ]
    return k8s.core.v1.PodSpecArgs(
        service_account_name=w.name,
        automount_service_account_token=False,
        enable_service_links=False,
        termination_grace_period_seconds=w.grace_period_s,
        runtime_class_name=w.runtime_class,
        priority_class_name=w.priority_class,
        topology_spread_constraints=spread if w.spread else None,
        security_context=restricted_pod_security(w.run_as_user),
        containers=[_container(w, mounts)],
        volumes=volumes,
    )


def restricted_workload(resource: str, w: Workload, parent: pulumi.Resource) -> WorkloadResources:
    """Create ``w``'s ServiceAccount, Deployment and PodDisruptionBudget as children of
    ``parent`` (resource names ``<resource>-sa``, ``-deployment``, ``-pdb``).

    The Deployment rolls without surge, one pod at a time, and Pulumi waits for the rollout
    at most :attr:`Workload.rollout_timeout_s` (its ``pulumi.com/timeoutSeconds``); the
    PodDisruptionBudget lets one pod go at a time and always lets an unhealthy pod be
    evicted.
    """
    child = pulumi.ResourceOptions(parent=parent)
    meta = k8s.meta.v1.ObjectMetaArgs(name=w.name, namespace=w.namespace, labels=w.labels)
    selector = k8s.meta.v1.LabelSelectorArgs(match_labels=w.selector)
    service_account = k8s.core.v1.ServiceAccount(
        f"{resource}-sa", metadata=meta, automount_service_account_token=False, opts=child
    )
    pod_annotations = {CHECKSUM_ANNOTATION: w.pools_checksum or ""} if w.pools_config_map else {}
    deployment = k8s.apps.v1.Deployment(
        f"{resource}-deployment",
        metadata=k8s.meta.v1.ObjectMetaArgs(
            name=w.name,
            namespace=w.namespace,
            labels=w.labels,
            annotations={
                **checkov_annotations(checkov_skips(w)),
                TIMEOUT_ANNOTATION: str(w.rollout_timeout_s),
            },
        ),
        spec=k8s.apps.v1.DeploymentSpecArgs(
            replicas=w.replicas,
            revision_history_limit=5,
            min_ready_seconds=w.min_ready_seconds,
            selector=selector,
            strategy=k8s.apps.v1.DeploymentStrategyArgs(
                type="RollingUpdate",
                rolling_update=k8s.apps.v1.RollingUpdateDeploymentArgs(
                    max_surge=MAX_SURGE, max_unavailable=MAX_UNAVAILABLE
                ),
            ),
            template=k8s.core.v1.PodTemplateSpecArgs(
                metadata=k8s.meta.v1.ObjectMetaArgs(
                    labels=w.labels, annotations=pod_annotations or None
                ),
                spec=_pod_spec(w),
            ),
        ),
        # The same bound twice: the annotation (rendered, reviewable) and the engine's custom
        # timeouts, which pulumi-kubernetes prefers over it.
        opts=pulumi.ResourceOptions(
            parent=parent,
            ignore_changes=None if w.owns_replicas else ["spec.replicas"],
            custom_timeouts=pulumi.CustomTimeouts(
                create=f"{w.rollout_timeout_s}s", update=f"{w.rollout_timeout_s}s"
            ),
        ),
    )
    pdb = k8s.policy.v1.PodDisruptionBudget(
        f"{resource}-pdb",
        metadata=meta,
        spec=k8s.policy.v1.PodDisruptionBudgetSpecArgs(
            max_unavailable=1, selector=selector, unhealthy_pod_eviction_policy="AlwaysAllow"
        ),
        opts=child,
    )
    return WorkloadResources(service_account, deployment, pdb)
