"""WorkerService: every pool of a service, after every guard has passed."""

from __future__ import annotations

import re

import pulumi
import pulumi_kubernetes as k8s
from worker_runtime import contract

from .alerts import alert_groups
from .args import PoolSpec, ServiceSpec
from .guards import PoolPlan, ServicePlan, check_env, check_scheduler, plan
from .monitoring import check_selector_labels, pod_monitor
from .pool import WorkerPool, WorkerPoolArgs
from .poolsfile import checksum, config_map_name, pools_config_map
from .sandbox import RESTRICTED_LABELS, SandboxPool, SandboxPoolArgs
from .scaler import BacklogScaler, BacklogScalerArgs
from .scheduler import SchedulerArgs, SchedulerDeployment
from .secrets import broker_secret, broker_secret_name, database_secret, database_secret_name

#: PriorityClass value of critical pools (above the default 0, below system classes).
CRITICAL_PRIORITY = 100_000
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]")


def label_value(text: str) -> str:
    """``text`` as a valid label value (at most 63 characters, alphanumeric at both ends)."""
    return _LABEL_VALUE.sub("-", text)[:63].strip("-._") or "none"


class WorkerService(pulumi.ComponentResource):
    """A service's pools: per pool a :class:`WorkerPool`, the ConfigMap of the pools file
    its pods read (:meth:`.ServiceSpec.pool_file`) and a :class:`BacklogScaler` (the sandbox
    pool as a :class:`SandboxPool`), plus the namespace, the Secrets, the whole pools file's
    ConfigMap for the scheduler, a PodMonitor and the PriorityClass of critical pools.

    Every guard (environment, isolation, replicas, timing, memory, capacity; see
    :mod:`.guards`) runs first: a refused stack raises ``GuardError`` before any resource
    is registered.

    Attributes for components added next to the pools (they reuse the same objects):
    ``plan`` (the derived numbers), ``pools`` (name -> component), ``labels`` (common
    labels), ``broker_secret_name``, ``database_secret_name``, ``pools_config_map_name``,
    ``pools_checksum`` (the whole file's, the scheduler's), ``namespace_opts`` (options of
    objects in the namespace).
    """

    def __init__(
        self, name: str, spec: ServiceSpec, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        check_env(spec.env, spec.pool_env)
        self.plan: ServicePlan = plan(
            spec.pools, spec.downstream, spec.timing, spec.grace_margin_s, spec.memory_base
        )
        # Rendered without schedules too: the scheduler exports every pool's backlog.
        scheduler = spec.scheduler
        if scheduler is not None:
            check_scheduler(scheduler)
        check_selector_labels(spec.scaling.monitoring_labels, "monitoringLabels")
        super().__init__("worker-infra:index:WorkerService", name, None, opts)
        self.spec = spec
        self._name = name
        self.labels = {
            "app.kubernetes.io/name": spec.project,
            "app.kubernetes.io/instance": label_value(spec.instance or spec.project),
            "app.kubernetes.io/version": label_value(spec.version),
            "app.kubernetes.io/managed-by": "pulumi",
        }
        self.namespace_opts = self._namespace()
        self.pools_checksum = checksum(spec.pools_file)
        self.pools_config_map_name = config_map_name(spec.project, spec.pools_file)
        self.broker_secret_name = broker_secret_name(spec.project)
        self.database_secret_name: str | None = None
        self.priority_class_name: str | None = None
        ordinary = [p for p in self.plan.pools if not p.pool.sandbox]
        depends: list[pulumi.Resource] = []
        if ordinary or scheduler is not None:
            depends = self._shared_objects(ordinary)
        scheduler_depends = list(depends)
        if scheduler is not None:
            scheduler_depends.append(
                pools_config_map(
                    f"{name}-pools",
                    self.pools_config_map_name,
                    spec.namespace,
                    spec.pools_file,
                    self.labels,
                    self.namespace_opts,
                )
            )
        self.pools: dict[str, pulumi.ComponentResource] = {}
        for pool_plan in self.plan.pools:
            if pool_plan.pool.sandbox:
                self.pools[pool_plan.pool.name] = self._sandbox(pool_plan)
            else:
                self.pools[pool_plan.pool.name] = self._pool(pool_plan, depends)
        self.scheduler: SchedulerDeployment | None = None
        if scheduler is not None:
            self.scheduler = SchedulerDeployment(
                f"{name}-scheduler",
                SchedulerArgs(
                    spec=scheduler,
                    project=spec.project,
                    image=spec.image,
                    namespace=spec.namespace,
                    broker_secret=self.broker_secret_name,
                    metrics_port=spec.metrics_port,
                    env=spec.env,
                    labels=self.labels,
                    pools_config_map=self.pools_config_map_name,
                    pools_checksum=self.pools_checksum,
                ),
                opts=pulumi.ResourceOptions(parent=self, depends_on=scheduler_depends),
            )
        if spec.prometheus_rule:
            self._prometheus_rule(name, spec, self.labels, self.namespace_opts)
        self.register_outputs(
            {
                "pools": sorted(self.pools),
                "capacity": [str(usage) for usage in self.plan.capacity],
            }
        )

    def _prometheus_rule(
        self, name: str, spec: ServiceSpec, labels: dict[str, str], opts: pulumi.ResourceOptions
    ) -> None:
        """The alert rules of :mod:`.alerts` for these (stack-merged) pools."""
        groups = alert_groups(
            spec.project,
            spec.pools,
            database=any(r.per_process == contract.PER_PROCESS_DB_POOL for r in spec.downstream),
            namespace=spec.namespace,
            sandbox_namespace=spec.sandbox.namespace,
        )
        k8s.apiextensions.CustomResource(
            f"{name}-alerts",
            api_version="monitoring.coreos.com/v1",
            kind="PrometheusRule",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=f"{spec.project}-alerts",
                namespace=spec.namespace,
                labels={**labels, **spec.scaling.monitoring_labels},
            ),
            spec={"groups": groups},
            opts=opts,
        )

    def _namespace(self) -> pulumi.ResourceOptions:
        spec = self.spec
        if not spec.create_namespace:
            return pulumi.ResourceOptions(parent=self)
        namespace = k8s.core.v1.Namespace(
            f"{self._name}-namespace",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=spec.namespace, labels={**self.labels, **RESTRICTED_LABELS}
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
        return pulumi.ResourceOptions(parent=self, depends_on=[namespace])

    def _shared_objects(self, ordinary: list[PoolPlan]) -> list[pulumi.Resource]:
        """Secrets, the PodMonitor and the PriorityClass of the namespace."""
        spec, name, opts = self.spec, self._name, self.namespace_opts
        depends: list[pulumi.Resource] = [
            broker_secret(
                f"{name}-broker",
                self.broker_secret_name,
                spec.namespace,
                spec.broker,
                self.labels,
                opts,
            ),
        ]
        if spec.database_url is not None and any(self._uses_db(p.pool) for p in ordinary):
            self.database_secret_name = database_secret_name(spec.project)
            depends.append(
                database_secret(
                    f"{name}-database",
                    self.database_secret_name,
                    spec.namespace,
                    spec.database_url,
                    self.labels,
                    opts,
                )
            )
        if spec.scaling.pod_monitor:
            pod_monitor(
                f"{name}-pod-monitor",
                spec.namespace,
                spec.project,
                spec.scaling.scrape_interval_s,
                {**self.labels, **spec.scaling.monitoring_labels},
                opts,
            )
        if any(p.pool.critical for p in ordinary):
            # Cluster-scoped: named by the stack (two stacks in one cluster never share it)
            # and by its immutable value (a new value is a new PriorityClass, created before
            # the old one is deleted, so no pod is ever admitted without one).
            instance = label_value(spec.instance or spec.project)
            self.priority_class_name = f"{instance}-critical-{CRITICAL_PRIORITY}"
            depends.append(
                k8s.scheduling.v1.PriorityClass(
                    f"{name}-critical",
                    metadata=k8s.meta.v1.ObjectMetaArgs(
                        name=self.priority_class_name, labels=self.labels
                    ),
                    value=CRITICAL_PRIORITY,
                    global_default=False,
                    preemption_policy="PreemptLowerPriority",
                    description=f"{spec.project}: pools that must not starve (pools.toml)",
                    opts=pulumi.ResourceOptions(parent=self),
                )
            )
        return depends

    def _pool(self, pool_plan: PoolPlan, depends: list[pulumi.Resource]) -> WorkerPool:
        spec, pool = self.spec, pool_plan.pool
        text = spec.pool_file(pool.name)
        config_map = config_map_name(spec.project, text, pool.slug)
        pools_file = pools_config_map(
            f"{self._name}-{pool.slug}-pools",
            config_map,
            spec.namespace,
            text,
            self.labels,
            self.namespace_opts,
        )
        opts = pulumi.ResourceOptions(parent=self, depends_on=[*depends, pools_file])
        worker = WorkerPool(
            f"{self._name}-{pool.slug}",
            WorkerPoolArgs(
                pool=pool,
                project=spec.project,
                image=spec.image,
                namespace=spec.namespace,
                broker_secret=self.broker_secret_name,
                pools_config_map=config_map,
                pools_checksum=checksum(text),
                timing=spec.timing,
                database_secret=self.database_secret_name if self._uses_db(pool) else None,
                grace_margin_s=spec.grace_margin_s,
                memory_base=spec.memory_base,
                metrics_port=spec.metrics_port,
                priority_class=self.priority_class_name if pool.critical else None,
                labels=self.labels,
                env=spec.env,
                max_replicas=pool_plan.max_replicas,
            ),
            opts=opts,
        )
        BacklogScaler(
            f"{self._name}-{pool.slug}-scaler",
            BacklogScalerArgs.for_pool(
                pool,
                project=spec.project,
                namespace=spec.namespace,
                target=worker.deployment_name,
                max_replicas=pool_plan.max_replicas,
                broker=spec.broker,
                broker_secret=self.broker_secret_name,
                scaling=spec.scaling,
                scale_down_period_s=self.scale_down_period_s(pool_plan),
                labels=self.labels,
            ),
            opts=opts,
        )
        return worker

    def _sandbox(self, pool_plan: PoolPlan) -> SandboxPool:
        spec, pool = self.spec, pool_plan.pool
        return SandboxPool(
            f"{self._name}-{pool.slug}",
            SandboxPoolArgs(
                pool=pool,
                project=spec.project,
                image=spec.image,
                namespace=spec.sandbox.namespace or f"{spec.namespace}-sandbox",
                broker=spec.broker,
                pools_file=spec.pool_file(pool.name),
                timing=spec.timing,
                max_replicas=pool_plan.max_replicas,
                sandbox=spec.sandbox,
                scaling=spec.scaling,
                grace_margin_s=spec.grace_margin_s,
                memory_base=spec.memory_base,
                metrics_port=spec.metrics_port,
                labels=self.labels,
                env=spec.env,
                create_namespace=spec.create_namespace,
                backlog_namespace=spec.namespace,
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )

    def scale_down_period_s(self, pool_plan: PoolPlan) -> int:
        """A pool holding downstream resources removes one pod per grace period at most, so
        a removed pod has released its connections before the next one goes."""
        period = self.spec.scaling.scale_down_period_s
        return max(period, pool_plan.grace_s) if pool_plan.pool.uses else period

    def _uses_db(self, pool: PoolSpec) -> bool:
        """Whether the pool holds DB connections (uses a ``db_pool_size`` resource)."""
        return any(
            r.per_process == contract.PER_PROCESS_DB_POOL and r.name in pool.uses
            for r in self.spec.downstream
        )
