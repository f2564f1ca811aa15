"""WorkerPool: one pool's Deployment, ServiceAccount and PodDisruptionBudget."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from .args import (
    DEFAULT_GRACE_MARGIN_S,
    DEFAULT_MEMORY_BASE,
    DEFAULT_METRICS_PORT,
    DEFAULT_RUN_AS_USER,
    PoolSpec,
    Timing,
)
from .guards import (
    check_memory,
    check_replicas,
    check_timing,
    grace_period_s,
)
from .poolsfile import POOLS_FILE
from .secrets import broker_env, database_env
from .workload import Workload, container_env, readiness_probe, restricted_workload

POOL_LABEL = "worker-template/pool"


def pool_labels(project: str, slug: str) -> dict[str, str]:
    """Selector labels of the pods of the pool ``slug`` (unique per pool within a
    namespace), also on every object of the pool."""
    return {"app.kubernetes.io/name": project, POOL_LABEL: slug}


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
      timing: the service's timing rule and kill-after (:class:`.args.Timing`).
      database_secret: Secret holding ``database-url`` (``DATABASE_URL``); None: no database.
      grace_margin_s: ``terminationGracePeriodSeconds`` = drain window + this (default
        :data:`.args.DEFAULT_GRACE_MARGIN_S`).
      memory_base: per-process bytes of the memory guard (default 96 MiB).
      metrics_port: port of /metrics, /livez, /readyz (default 9191).
      runtime_class: RuntimeClass of the pods (e.g. ``"gvisor"``), None for the default.
      priority_class: PriorityClass of the pods, None for the cluster default.
      run_as_user: UID and GID of the container (default 10001, non-root).
      labels: extra labels on every object (``app.kubernetes.io/instance``, ...).
      env: extra plain environment variables (already checked by the environment guard).
      cpu_limit: the container's CPU limit (default None: none; the sandbox has one).
      max_replicas: the scaler's capped maximum (default None: the pool's), the most pods
        a rollout replaces (sizes Pulumi's wait, :mod:`.rollout`).
    """

    pool: PoolSpec
    project: str
    image: str
    namespace: pulumi.Input[str]
    broker_secret: str
    pools_config_map: str
    pools_checksum: str
    timing: Timing
    database_secret: str | None = None
    grace_margin_s: int = DEFAULT_GRACE_MARGIN_S
    memory_base: int = DEFAULT_MEMORY_BASE
    metrics_port: int = DEFAULT_METRICS_PORT
    runtime_class: str | None = None
    priority_class: str | None = None
    run_as_user: int = DEFAULT_RUN_AS_USER
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    max_replicas: int | None = None
    cpu_limit: str | None = None


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
        check_timing(pool, grace_s, args.timing)
        check_memory(pool, args.memory_base)
        super().__init__("worker-infra:index:WorkerPool", name, None, opts)
        full_name = f"{args.project}-{pool.slug}"
        labels = pool_labels(args.project, pool.slug)
        workload = Workload(
            name=full_name,
            namespace=args.namespace,
            selector=labels,
            labels={**args.labels, **labels, "app.kubernetes.io/component": "worker"},
            project=args.project,
            component="worker",
            image=args.image,
            env=WorkerPool.env(args),
            replicas=pool.min_replicas,
            cpu=pool.cpu,
            cpu_limit=args.cpu_limit,
            memory=pool.memory,
            stalled_after_s=pool.stalled_after_s,
            readiness=readiness_probe(command=[args.project, "healthcheck", "ready"]),
            grace_period_s=grace_s,
            metrics_port=args.metrics_port,
            run_as_user=args.run_as_user,
            pools_config_map=args.pools_config_map,
            pools_checksum=args.pools_checksum,
            min_ready_seconds=grace_s if pool.uses else None,
            runtime_class=args.runtime_class,
            priority_class=args.priority_class,
            spread=True,
            owns_replicas=False,
            rollout_replicas=args.max_replicas or pool.max_replicas,
        )
        self.service_account, self.deployment, self.pdb = restricted_workload(name, workload, self)
        #: Seconds Pulumi waits at most for this pool's rollout (:mod:`.rollout`).
        self.rollout_timeout_s = workload.rollout_timeout_s
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
        secrets = [broker_env(args.broker_secret)]
        if args.database_secret is not None:
            secrets.append(database_env(args.database_secret))
        return container_env(plain, secrets)
