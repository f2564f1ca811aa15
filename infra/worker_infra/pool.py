"""WorkerPool: one pool's Deployment, ServiceAccount and PodDisruptionBudget."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from .args import PoolSpec
from .guards import (
    DEFAULT_MEMORY_BASE,
    check_memory,
    check_replicas,
    check_timing,
    grace_period_s,
)
from .poolsfile import CHECKSUM_ANNOTATION, POOLS_FILE, POOLS_KEY, POOLS_MOUNT

#: Checkov checks the worker Deployments do not meet on purpose, each with its reason. They
#: render as ``checkov.io/skipN: CHECK=reason`` annotations on each Deployment, so the reason
#: sits next to the object it excuses (a reason must not contain "=": checkov splits on it).
CHECKOV_SKIPS = {
    "CKV_K8S_11": (
        "no CPU limit on purpose: CFS throttling stalls heartbeats and probes under load;"
        " CPU is reserved by the request (the sandbox quota caps its requests)"
    ),
    "CKV_K8S_15": (
        "IfNotPresent on purpose: a release is an immutable tag or digest, and Always makes"
        " every pod start depend on the registry"
    ),
    "CKV_K8S_35": (
        "the worker reads its broker and database URLs from its environment (the settings"
        " contract); they come from secretKeyRef and never as plain values (guarded)"
    ),
    "CKV_K8S_43": (
        "the image reference is the stack image setting: set it to repo@sha256:<digest>"
        " to pin a digest"
    ),
}


def checkov_annotations() -> dict[str, str]:
    """The ``checkov.io/skipN`` annotations of :data:`CHECKOV_SKIPS` (for a Deployment)."""
    return {
        f"checkov.io/skip{n}": f"{check}={reason}"
        for n, (check, reason) in enumerate(sorted(CHECKOV_SKIPS.items()), 1)
    }


POOL_LABEL = "worker-template/pool"
BROKER_URL_KEY = "redis-url"
BROKER_PASSWORD_KEY = "redis-password"
DATABASE_URL_KEY = "database-url"
TMP_SIZE = "512Mi"


def pool_labels(project: str, pool: PoolSpec) -> dict[str, str]:
    """Selector labels of a pool's pods (unique per pool within a namespace)."""
    return {"app.kubernetes.io/name": project, POOL_LABEL: pool.slug}


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


@dataclass(frozen=True)
class WorkerPoolArgs:
    """Arguments of :class:`WorkerPool`.

    Parameters:
      pool: the pool (queues, shape, timeouts, memory, replicas).
      project: the service; its console script is the container command.
      image: image reference with tag.
      namespace: namespace of every object.
      broker_secret: Secret holding ``redis-url`` (mounted as ``REDIS_URL``).
      pools_config_map: ConfigMap holding the stack-merged pools file (see :mod:`.poolsfile`).
      pools_checksum: SHA-256 of that file (pod-template annotation: a change rolls the pods).
      database_secret: Secret holding ``database-url`` (``DATABASE_URL``); None: no database.
      grace_margin_s: ``terminationGracePeriodSeconds`` = drain window + this (default 15).
      memory_base: per-process bytes of the memory guard (default 96 MiB).
      metrics_port: port of /metrics, /livez, /readyz (default 9191).
      runtime_class: RuntimeClass of the pods (e.g. ``"gvisor"``), None for the default.
      priority_class: PriorityClass of the pods, None for the cluster default.
      run_as_user: UID and GID of the container (default 10001, non-root).
      labels: extra labels on every object (``app.kubernetes.io/instance``, ...).
      env: extra plain environment variables (already checked by the environment guard).
    """

    pool: PoolSpec
    project: str
    image: str
    namespace: pulumi.Input[str]
    broker_secret: str
    pools_config_map: str
    pools_checksum: str
    database_secret: str | None = None
    grace_margin_s: int = 15
    memory_base: int = DEFAULT_MEMORY_BASE
    metrics_port: int = 9191
    runtime_class: str | None = None
    priority_class: str | None = None
    run_as_user: int = 10001
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


class WorkerPool(pulumi.ComponentResource):
    """One pool: Deployment, token-less ServiceAccount and PodDisruptionBudget.

    Refuses (``GuardError``) before creating anything when the pool's timing or memory
    guard fails. The Deployment's replica count belongs to the pool's scaler: Pulumi sets
    the floor once and then ignores ``spec.replicas``. The pool's shape reaches the pod
    only through the mounted pools file (``WORKER_POOL`` picks the entry).

    Transitions stay inside the capacity budget (see :mod:`.capacity`): rollouts never
    surge (``maxSurge: 0``) and, for a pool holding downstream resources, wait a grace
    period between replacements (``minReadySeconds``), so at most one old pod drains at a
    time. The PodDisruptionBudget lets one pod go at a time and always lets an unhealthy
    pod be evicted (a database outage must not block a node drain).

    Outputs: ``deployment_name``, ``service_account_name``.
    """

    def __init__(
        self, name: str, args: WorkerPoolArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        pool = args.pool
        grace_s = grace_period_s(pool, args.grace_margin_s)
        check_replicas(pool)
        check_timing(pool, grace_s)
        check_memory(pool, args.memory_base)
        super().__init__("worker-infra:index:WorkerPool", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        full_name = f"{args.project}-{pool.slug}"
        labels = pool_labels(args.project, pool)
        all_labels = {**args.labels, **labels, "app.kubernetes.io/component": "worker"}
        meta = k8s.meta.v1.ObjectMetaArgs(
            name=full_name, namespace=args.namespace, labels=all_labels
        )

        self.service_account = k8s.core.v1.ServiceAccount(
            f"{name}-sa", metadata=meta, automount_service_account_token=False, opts=child
        )
        self.deployment = k8s.apps.v1.Deployment(
            f"{name}-deployment",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=full_name,
                namespace=args.namespace,
                labels=all_labels,
                annotations=checkov_annotations(),
            ),
            spec=k8s.apps.v1.DeploymentSpecArgs(
                replicas=pool.min_replicas,
                revision_history_limit=5,
                min_ready_seconds=grace_s if pool.uses else None,
                selector=k8s.meta.v1.LabelSelectorArgs(match_labels=labels),
                strategy=k8s.apps.v1.DeploymentStrategyArgs(
                    type="RollingUpdate",
                    rolling_update=k8s.apps.v1.RollingUpdateDeploymentArgs(
                        max_surge=0, max_unavailable=1
                    ),
                ),
                template=k8s.core.v1.PodTemplateSpecArgs(
                    metadata=k8s.meta.v1.ObjectMetaArgs(
                        labels=all_labels,
                        annotations={CHECKSUM_ANNOTATION: args.pools_checksum},
                    ),
                    spec=self._pod_spec(args, full_name, grace_s, labels),
                ),
            ),
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["spec.replicas"]),
        )
        self.pdb = k8s.policy.v1.PodDisruptionBudget(
            f"{name}-pdb",
            metadata=meta,
            spec=k8s.policy.v1.PodDisruptionBudgetSpecArgs(
                max_unavailable=1,
                selector=k8s.meta.v1.LabelSelectorArgs(match_labels=labels),
                unhealthy_pod_eviction_policy="AlwaysAllow",
            ),
            opts=child,
        )
        self.deployment_name: pulumi.Output[str] = self.deployment.metadata.apply(
            lambda m: m.name or full_name
        )
        self.service_account_name = pulumi.Output.from_input(full_name)
        self.register_outputs(
            {
                "deployment_name": self.deployment_name,
                "service_account_name": self.service_account_name,
            }
        )

    @staticmethod
    def env(args: WorkerPoolArgs) -> list[k8s.core.v1.EnvVarArgs]:
        """The container's environment (DESIGN 2.1); secrets come from Secret references.

        The pool's shape (queues, concurrency, processes, timeouts, prefetch, DB pool) is
        not here: the worker reads it from the mounted pools file.
        """
        pool = args.pool
        plain: dict[str, str] = {
            "WORKER_POOL": pool.name,
            "WORKER_POOLS_FILE": POOLS_FILE,
            "HEALTH_STALLED_AFTER_S": str(pool.stalled_after_s),
            "METRICS_PORT": str(args.metrics_port),
            "OTEL_SERVICE_NAME": args.project,
        }
        plain.update(args.env)
        env = [k8s.core.v1.EnvVarArgs(name=k, value=v) for k, v in plain.items()]
        secrets = [("REDIS_URL", args.broker_secret, BROKER_URL_KEY)]
        if args.database_secret is not None:
            secrets.append(("DATABASE_URL", args.database_secret, DATABASE_URL_KEY))
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

    @staticmethod
    def _pod_spec(
        args: WorkerPoolArgs, name: str, grace_s: int, selector: dict[str, str]
    ) -> k8s.core.v1.PodSpecArgs:
        pool = args.pool
        command = [args.project]
        spread = [
            k8s.core.v1.TopologySpreadConstraintArgs(
                max_skew=1,
                topology_key=key,
                when_unsatisfiable="ScheduleAnyway",
                label_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=selector),
                match_label_keys=["pod-template-hash"],
            )
            for key in ("topology.kubernetes.io/zone", "kubernetes.io/hostname")
        ]
        return k8s.core.v1.PodSpecArgs(
            service_account_name=name,
            automount_service_account_token=False,
            enable_service_links=False,
            termination_grace_period_seconds=grace_s,
            runtime_class_name=args.runtime_class,
            priority_class_name=args.priority_class,
            topology_spread_constraints=spread,
            security_context=restricted_pod_security(args.run_as_user),
            containers=[
                k8s.core.v1.ContainerArgs(
                    name="worker",
                    image=args.image,
                    image_pull_policy="IfNotPresent",
                    command=[*command, "worker"],
                    env=WorkerPool.env(args),
                    ports=[
                        k8s.core.v1.ContainerPortArgs(
                            name="metrics", container_port=args.metrics_port, protocol="TCP"
                        )
                    ],
                    resources=k8s.core.v1.ResourceRequirementsArgs(
                        requests={"cpu": pool.cpu, "memory": pool.memory},
                        limits={"memory": pool.memory},
                    ),
                    liveness_probe=k8s.core.v1.ProbeArgs(
                        exec_=k8s.core.v1.ExecActionArgs(
                            command=[
                                *command,
                                "healthcheck",
                                "live",
                                "--stalled-after",
                                str(pool.stalled_after_s),
                            ]
                        ),
                        initial_delay_seconds=10,
                        period_seconds=15,
                        timeout_seconds=5,
                        failure_threshold=3,
                    ),
                    readiness_probe=k8s.core.v1.ProbeArgs(
                        exec_=k8s.core.v1.ExecActionArgs(
                            command=[*command, "healthcheck", "ready"]
                        ),
                        period_seconds=10,
                        timeout_seconds=5,
                        failure_threshold=3,
                    ),
                    security_context=restricted_container_security(),
                    volume_mounts=[
                        k8s.core.v1.VolumeMountArgs(name="tmp", mount_path="/tmp"),
                        k8s.core.v1.VolumeMountArgs(
                            name="pools", mount_path=POOLS_MOUNT, read_only=True
                        ),
                    ],
                )
            ],
            volumes=[
                k8s.core.v1.VolumeArgs(
                    name="tmp", empty_dir=k8s.core.v1.EmptyDirVolumeSourceArgs(size_limit=TMP_SIZE)
                ),
                k8s.core.v1.VolumeArgs(
                    name="pools",
                    config_map=k8s.core.v1.ConfigMapVolumeSourceArgs(
                        name=args.pools_config_map,
                        items=[k8s.core.v1.KeyToPathArgs(key=POOLS_KEY, path=POOLS_KEY)],
                    ),
                ),
            ],
        )
