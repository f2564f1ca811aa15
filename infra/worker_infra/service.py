"""WorkerService: every pool of a service, after every guard has passed."""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from .alerts import alert_groups
from .args import ServiceSpec
from .guards import ServicePlan, plan
from .pool import DATABASE_URL_KEY, WorkerPool, WorkerPoolArgs
from .sandbox import RESTRICTED_LABELS, SandboxPool, SandboxPoolArgs, broker_secret
from .scaler import BacklogScaler, BacklogScalerArgs
from .scheduler import SchedulerArgs, SchedulerDeployment


class WorkerService(pulumi.ComponentResource):
    """A service's pools: per pool a :class:`WorkerPool` and a :class:`BacklogScaler`
    (the sandbox pool as a :class:`SandboxPool`), plus the namespace and the Secrets.

    Every guard (isolation, replicas, timing, memory, capacity; see :mod:`.guards`) runs
    first: a refused stack raises ``GuardError`` before any resource is registered.

    Attributes: ``plan`` (the derived numbers), ``pools`` (name -> component).
    """

    def __init__(
        self, name: str, spec: ServiceSpec, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        self.plan: ServicePlan = plan(
            spec.pools, spec.downstream, spec.grace_margin_s, spec.memory_base
        )
        scheduler = spec.scheduler if spec.scheduler and spec.scheduler.schedules else None
        if scheduler is not None:
            scheduler.check()
        super().__init__("worker-infra:index:WorkerService", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        labels = {"app.kubernetes.io/name": spec.project}
        ns_opts = child
        if spec.create_namespace:
            namespace = k8s.core.v1.Namespace(
                f"{name}-namespace",
                metadata=k8s.meta.v1.ObjectMetaArgs(
                    name=spec.namespace, labels={**labels, **RESTRICTED_LABELS}
                ),
                opts=child,
            )
            ns_opts = pulumi.ResourceOptions(parent=self, depends_on=[namespace])
        ordinary = [p for p in self.plan.pools if not p.pool.sandbox]
        broker_name = f"{spec.project}-broker"
        broker: pulumi.Resource | None = None
        if ordinary or scheduler is not None:
            broker = broker_secret(
                f"{name}-broker", broker_name, spec.namespace, spec.broker, labels, ns_opts
            )
        database_name: str | None = None
        depends: list[pulumi.Resource] = [broker] if broker else []
        if spec.database_url is not None and any(self._uses_db(spec, p.pool) for p in ordinary):
            database_name = f"{spec.project}-database"
            depends.append(
                k8s.core.v1.Secret(
                    f"{name}-database",
                    metadata=k8s.meta.v1.ObjectMetaArgs(
                        name=database_name, namespace=spec.namespace, labels=labels
                    ),
                    type="Opaque",
                    string_data={DATABASE_URL_KEY: pulumi.Output.secret(spec.database_url)},
                    opts=ns_opts,
                )
            )
        self.pools: dict[str, pulumi.ComponentResource] = {}
        for pool_plan in self.plan.pools:
            pool = pool_plan.pool
            if pool.sandbox:
                self.pools[pool.name] = SandboxPool(
                    f"{name}-{pool.slug}",
                    SandboxPoolArgs(
                        pool=pool,
                        project=spec.project,
                        image=spec.image,
                        namespace=spec.sandbox.namespace or f"{spec.namespace}-sandbox",
                        broker=spec.broker,
                        max_replicas=pool_plan.max_replicas,
                        sandbox=spec.sandbox,
                        scaling=spec.scaling,
                        grace_margin_s=spec.grace_margin_s,
                        memory_base=spec.memory_base,
                        metrics_port=spec.metrics_port,
                        env=spec.env,
                    ),
                    opts=child,
                )
                continue
            worker = WorkerPool(
                f"{name}-{pool.slug}",
                WorkerPoolArgs(
                    pool=pool,
                    project=spec.project,
                    image=spec.image,
                    namespace=spec.namespace,
                    broker_secret=broker_name,
                    database_secret=database_name if self._uses_db(spec, pool) else None,
                    grace_margin_s=spec.grace_margin_s,
                    memory_base=spec.memory_base,
                    metrics_port=spec.metrics_port,
                    env=spec.env,
                ),
                opts=pulumi.ResourceOptions(parent=self, depends_on=depends),
            )
            BacklogScaler(
                f"{name}-{pool.slug}-scaler",
                BacklogScalerArgs(
                    pool=pool.slug,
                    project=spec.project,
                    namespace=spec.namespace,
                    target=worker.deployment_name,
                    queues=pool.queues,
                    min_replicas=pool.min_replicas,
                    max_replicas=pool_plan.max_replicas,
                    backlog_age_target_s=pool.backlog_age_target_s,
                    list_length=pool.processes * pool.concurrency,
                    broker=spec.broker,
                    broker_secret=broker_name,
                    scaling=spec.scaling,
                ),
                opts=pulumi.ResourceOptions(parent=self, depends_on=depends),
            )
            self.pools[pool.name] = worker
        self.scheduler: SchedulerDeployment | None = None
        if scheduler is not None:
            self.scheduler = SchedulerDeployment(
                f"{name}-scheduler",
                SchedulerArgs(
                    spec=scheduler,
                    project=spec.project,
                    image=spec.image,
                    namespace=spec.namespace,
                    broker_secret=broker_name,
                    metrics_port=spec.metrics_port,
                    env=spec.env,
                ),
                opts=pulumi.ResourceOptions(parent=self, depends_on=depends),
            )
        if spec.prometheus_rule:
            self._prometheus_rule(name, spec, labels, ns_opts)
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
        namespaces = [spec.namespace]
        if any(pool.sandbox for pool in spec.pools):
            namespaces.append(spec.sandbox.namespace or f"{spec.namespace}-sandbox")
        groups = alert_groups(
            spec.project,
            spec.pools,
            database=any(r.per_process == "db_pool_size" for r in spec.downstream),
            namespaces=namespaces,
        )
        k8s.apiextensions.CustomResource(
            f"{name}-alerts",
            api_version="monitoring.coreos.com/v1",
            kind="PrometheusRule",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=f"{spec.project}-alerts", namespace=spec.namespace, labels=labels
            ),
            spec={"groups": groups},
            opts=opts,
        )

    @staticmethod
    def _uses_db(spec: ServiceSpec, pool: object) -> bool:
        """Whether the pool holds DB connections (uses a ``db_pool_size`` resource)."""
        uses = getattr(pool, "uses", ())
        return any(r.per_process == "db_pool_size" and r.name in uses for r in spec.downstream)
