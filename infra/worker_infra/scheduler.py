"""SchedulerDeployment: the replicas of ``<project> scheduler``, one of which leads.

Rendered for every service, with or without ``[schedules.*]`` (it also exports the backlog
of every pool, which a pool at zero pods cannot): a Deployment of ``replicas`` (default 2;
one leads, the others take over within the leader TTL), no scaler (the work is one
enqueue per tick), small resources, the pools' pod security, a token-less ServiceAccount
and a PodDisruptionBudget that keeps one replica through node drains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from .args import DEFAULT_METRICS_PORT, DEFAULT_RUN_AS_USER, SchedulerSpec
from .guards import check_scheduler
from .poolsfile import POOLS_FILE
from .secrets import broker_env
from .workload import Workload, container_env, readiness_probe, restricted_workload

COMPONENT = "scheduler"


@dataclass(frozen=True)
class SchedulerArgs:
    """Arguments of :class:`SchedulerDeployment`.

    Parameters:
      spec: the scheduler's numbers.
      project: the service; its console script is the container command.
      image: image reference with tag.
      namespace: namespace of every object.
      broker_secret: Secret holding ``redis-url`` (mounted as ``REDIS_URL``).
      metrics_port: port of /metrics, /livez, /readyz (default 9191).
      run_as_user: UID and GID of the container (default 10001, non-root).
      env: extra plain environment variables.
      labels: extra labels on every object (``app.kubernetes.io/instance``, ...).
      pools_config_map, pools_checksum: the stack-merged pools file's ConfigMap and its
        SHA-256 (:mod:`.poolsfile`); None: the image's pools.toml.
    """

    spec: SchedulerSpec
    project: str
    image: str
    namespace: pulumi.Input[str]
    broker_secret: str
    metrics_port: int = DEFAULT_METRICS_PORT
    run_as_user: int = DEFAULT_RUN_AS_USER
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    pools_config_map: str | None = None
    pools_checksum: str | None = None


def scheduler_labels(project: str) -> dict[str, str]:
    """Selector labels of the scheduler's pods (no pool label: no pool selects them)."""
    return {"app.kubernetes.io/name": project, "app.kubernetes.io/component": COMPONENT}


def scheduler_env(args: SchedulerArgs) -> list[k8s.core.v1.EnvVarArgs]:
    """The container's environment: the scheduler's variables and ``REDIS_URL`` by reference."""
    plain = {
        "SCHEDULER_LEADER_TTL_MS": str(args.spec.leader_ttl_ms),
        "HEALTH_STALLED_AFTER_S": str(args.spec.stalled_after_s),
        "METRICS_PORT": str(args.metrics_port),
        "OTEL_SERVICE_NAME": args.project,
        **({"WORKER_POOLS_FILE": POOLS_FILE} if args.pools_config_map else {}),
        **args.env,
    }
    return container_env(plain, [broker_env(args.broker_secret)])


class SchedulerDeployment(pulumi.ComponentResource):
    """The scheduler: Deployment, token-less ServiceAccount, PodDisruptionBudget.

    Outputs: ``deployment_name``.
    """

    def __init__(
        self, name: str, args: SchedulerArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        check_scheduler(args.spec)
        super().__init__("worker-infra:index:SchedulerDeployment", name, None, opts)
        full_name = f"{args.project}-{COMPONENT}"
        labels = scheduler_labels(args.project)
        workload = Workload(
            name=full_name,
            namespace=args.namespace,
            selector=labels,
            labels={**args.labels, **labels},
            project=args.project,
            component=COMPONENT,
            image=args.image,
            env=scheduler_env(args),
            replicas=args.spec.replicas,
            cpu=args.spec.cpu,
            memory=args.spec.memory,
            stalled_after_s=args.spec.stalled_after_s,
            # The scheduler's own /readyz (Redis answers); `healthcheck ready` reads the
            # worker's settings, which the scheduler does not have.
            readiness=readiness_probe(http_path="/readyz"),
            grace_period_s=args.spec.grace_period_s,
            metrics_port=args.metrics_port,
            run_as_user=args.run_as_user,
            pools_config_map=args.pools_config_map,
            pools_checksum=args.pools_checksum,
        )
        self.deployment = restricted_workload(name, workload, self).deployment
        self.deployment_name = pulumi.Output.from_input(full_name)
        self.register_outputs({"deployment_name": self.deployment_name})
