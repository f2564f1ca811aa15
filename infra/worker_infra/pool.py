"""WorkerPool: one pool's Deployment, ServiceAccount and PodDisruptionBudget."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from .args import PoolSpec
from .guards import check_memory, check_replicas, check_timing, grace_period_s

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
      database_secret: Secret holding ``database-url`` (``DATABASE_URL``); None: no database.
      grace_margin_s: ``terminationGracePeriodSeconds`` = drain window + this (default 15).
      memory_base: per-process allowance of the memory guard (default ``"96Mi"``).
      metrics_port: port of /metrics, /livez, /readyz (default 9191).
      runtime_class: RuntimeClass of the pods (e.g. ``"gvisor"``), None for the default.
      run_as_user: UID and GID of the container (default 10001, non-root).
      env: extra plain environment variables.
    """

    pool: PoolSpec
    project: str
    image: str
    namespace: pulumi.Input[str]
    broker_secret: str
    database_secret: str | None = None
    grace_margin_s: int = 15
    memory_base: str = "96Mi"
    metrics_port: int = 9191
    runtime_class: str | None = None
    run_as_user: int = 10001
    env: dict[str, str] = field(default_factory=dict)


class WorkerPool(pulumi.ComponentResource):
    """One pool: Deployment, token-less ServiceAccount and PodDisruptionBudget.

    Refuses (``GuardError``) before creating anything when the pool's timing or memory
    guard fails. The Deployment's replica count belongs to the pool's scaler: Pulumi sets
    the floor once and then ignores ``spec.replicas``. Rollouts never surge
    (``maxSurge: 0``) so a rollout at ``max_replicas`` stays inside the capacity budget.

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
        all_labels = {**labels, "app.kubernetes.io/component": "worker"}
        meta = k8s.meta.v1.ObjectMetaArgs(
            name=full_name, namespace=args.namespace, labels=all_labels
        )

        self.service_account = k8s.core.v1.ServiceAccount(
            f"{name}-sa", metadata=meta, automount_service_account_token=False, opts=child
        )
        self.deployment = k8s.apps.v1.Deployment(
            f"{name}-deployment",
            metadata=meta,
            spec=k8s.apps.v1.DeploymentSpecArgs(
                replicas=pool.min_replicas,
                revision_history_limit=5,
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
                        annotations={
                            "prometheus.io/scrape": "true",
                            "prometheus.io/port": str(args.metrics_port),
                            "prometheus.io/path": "/metrics",
                        },
                    ),
                    spec=self._pod_spec(args, full_name, grace_s),
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
        """The container's environment (DESIGN 2.1); secrets come from Secret references."""
        pool = args.pool
        plain: dict[str, str] = {
            "WORKER_POOL": pool.name,
            "WORKER_QUEUES": ",".join(pool.queues),
            "WORKER_CONCURRENCY": str(pool.concurrency),
            "WORKER_PROCESSES": str(pool.processes),
            "WORKER_JOB_TIMEOUT_MS": str(pool.job_timeout_ms),
            "WORKER_SHUTDOWN_TIMEOUT_MS": str(pool.shutdown_timeout_ms),
            "WORKER_MAX_ATTEMPTS": str(pool.max_attempts),
            "HEALTH_STALLED_AFTER_S": str(pool.effective_stalled_after_s),
            "METRICS_PORT": str(args.metrics_port),
            "OTEL_SERVICE_NAME": args.project,
        }
        if args.database_secret is not None:
            plain["DB_POOL_SIZE"] = str(pool.effective_db_pool_size)
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
    def _pod_spec(args: WorkerPoolArgs, name: str, grace_s: int) -> k8s.core.v1.PodSpecArgs:
        pool = args.pool
        command = [args.project]
        return k8s.core.v1.PodSpecArgs(
            service_account_name=name,
            automount_service_account_token=False,
            enable_service_links=False,
            termination_grace_period_seconds=grace_s,
            runtime_class_name=args.runtime_class,
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
                                str(pool.effective_stalled_after_s),
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
                    volume_mounts=[k8s.core.v1.VolumeMountArgs(name="tmp", mount_path="/tmp")],
                )
            ],
            volumes=[
                k8s.core.v1.VolumeArgs(
                    name="tmp", empty_dir=k8s.core.v1.EmptyDirVolumeSourceArgs(size_limit=TMP_SIZE)
                )
            ],
        )
