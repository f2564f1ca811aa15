"""SchedulerDeployment: the replicas of ``<project> scheduler``, one of which leads.

Rendered when pools.toml has ``[schedules.*]``: a Deployment of ``replicas`` (default 2;
one leads, the others take over within the leader TTL), no scaler (the work is one
enqueue per tick), small resources, the pools' pod security, a token-less ServiceAccount
and a PodDisruptionBudget that keeps one replica through node drains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from .args import DEFAULT_METRICS_PORT, DEFAULT_RUN_AS_USER
from .errors import GuardError
from .pool import BROKER_URL_KEY
from .poolsfile import POOLS_FILE
from .workload import Workload, container_env, readiness_probe, restricted_workload

COMPONENT = "scheduler"


@dataclass(frozen=True)
class SchedulerSpec:
    """The scheduler of a service (stack-wide).

    Parameters:
      schedules: names of the ``[schedules.*]`` tables; none means no scheduler is rendered.
      replicas: replicas of the Deployment (default 2: a leader and a standby).
      leader_ttl_ms: ``SCHEDULER_LEADER_TTL_MS``: a dead leader is replaced within it
        (default 10000).
      cpu: CPU request (default ``"50m"``).
      memory: memory limit and request (default ``"192Mi"``: Python, Dramatiq, the actors).
      stalled_after_s: liveness threshold of its main loop (default 30 s; it ticks at least
        every third of the leader TTL).
      grace_period_s: ``terminationGracePeriodSeconds`` (default 30; it stops in a second).
    """

    schedules: tuple[str, ...] = ()
    replicas: int = 2
    leader_ttl_ms: int = 10_000
    cpu: str = "50m"
    memory: str = "192Mi"
    stalled_after_s: int = 30
    grace_period_s: int = 30

    def check(self) -> None:
        """Refuse numbers that break the leader election or the liveness probe."""
        if self.replicas < 1:
            raise GuardError(f"scheduler: replicas ({self.replicas}) must be at least 1")
        if not 1_000 <= self.leader_ttl_ms <= 600_000:
            raise GuardError(
                f"scheduler: leader_ttl_ms ({self.leader_ttl_ms}) must lie in 1000..600000"
            )
        if self.stalled_after_s * 1000 <= self.leader_ttl_ms:
            raise GuardError(
                f"scheduler: stalled_after_s ({self.stalled_after_s}) must exceed the leader "
                f"TTL ({self.leader_ttl_ms} ms): a follower's loop ticks once per TTL/4"
            )


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
    return container_env(plain, [("REDIS_URL", args.broker_secret, BROKER_URL_KEY)])


class SchedulerDeployment(pulumi.ComponentResource):
    """The scheduler: Deployment, token-less ServiceAccount, PodDisruptionBudget.

    Outputs: ``deployment_name``.
    """

    def __init__(
        self, name: str, args: SchedulerArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        args.spec.check()
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
