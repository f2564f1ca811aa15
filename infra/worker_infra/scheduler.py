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

from .errors import GuardError
from .pool import (
    BROKER_URL_KEY,
    TMP_SIZE,
    checkov_annotations,
    restricted_container_security,
    restricted_pod_security,
)
from .poolsfile import CHECKSUM_ANNOTATION, POOLS_FILE, POOLS_KEY, POOLS_MOUNT

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
    metrics_port: int = 9191
    run_as_user: int = 10001
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
    env = [k8s.core.v1.EnvVarArgs(name=k, value=v) for k, v in plain.items()]
    env.append(
        k8s.core.v1.EnvVarArgs(
            name="REDIS_URL",
            value_from=k8s.core.v1.EnvVarSourceArgs(
                secret_key_ref=k8s.core.v1.SecretKeySelectorArgs(
                    name=args.broker_secret, key=BROKER_URL_KEY
                )
            ),
        )
    )
    return env


class SchedulerDeployment(pulumi.ComponentResource):
    """The scheduler: Deployment, token-less ServiceAccount, PodDisruptionBudget.

    Outputs: ``deployment_name``.
    """

    def __init__(
        self, name: str, args: SchedulerArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        args.spec.check()
        super().__init__("worker-infra:index:SchedulerDeployment", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        full_name = f"{args.project}-{COMPONENT}"
        labels = scheduler_labels(args.project)
        all_labels = {**args.labels, **labels}
        meta = k8s.meta.v1.ObjectMetaArgs(
            name=full_name, namespace=args.namespace, labels=all_labels
        )
        mounts = [k8s.core.v1.VolumeMountArgs(name="tmp", mount_path="/tmp")]
        volumes = [
            k8s.core.v1.VolumeArgs(
                name="tmp", empty_dir=k8s.core.v1.EmptyDirVolumeSourceArgs(size_limit=TMP_SIZE)
            )
        ]
        annotations: dict[str, str] = {}
        if args.pools_config_map:
            mounts.append(
                k8s.core.v1.VolumeMountArgs(name="pools", mount_path=POOLS_MOUNT, read_only=True)
            )
            volumes.append(
                k8s.core.v1.VolumeArgs(
                    name="pools",
                    config_map=k8s.core.v1.ConfigMapVolumeSourceArgs(
                        name=args.pools_config_map,
                        items=[k8s.core.v1.KeyToPathArgs(key=POOLS_KEY, path=POOLS_KEY)],
                    ),
                )
            )
            annotations[CHECKSUM_ANNOTATION] = args.pools_checksum or ""
        command = [args.project]
        port = args.metrics_port
        k8s.core.v1.ServiceAccount(
            f"{name}-sa", metadata=meta, automount_service_account_token=False, opts=child
        )
        container = k8s.core.v1.ContainerArgs(
            name=COMPONENT,
            image=args.image,
            image_pull_policy="IfNotPresent",
            command=[*command, COMPONENT],
            env=scheduler_env(args),
            ports=[k8s.core.v1.ContainerPortArgs(name="metrics", container_port=port)],
            resources=k8s.core.v1.ResourceRequirementsArgs(
                requests={"cpu": args.spec.cpu, "memory": args.spec.memory},
                limits={"memory": args.spec.memory},
            ),
            liveness_probe=k8s.core.v1.ProbeArgs(
                exec_=k8s.core.v1.ExecActionArgs(
                    command=[
                        *command,
                        "healthcheck",
                        "live",
                        "--stalled-after",
                        str(args.spec.stalled_after_s),
                    ]
                ),
                initial_delay_seconds=10,
                period_seconds=15,
                timeout_seconds=5,
                failure_threshold=3,
            ),
            # The scheduler's own /readyz (Redis answers); `healthcheck ready` reads the
            # worker's settings, which the scheduler does not have.
            readiness_probe=k8s.core.v1.ProbeArgs(
                http_get=k8s.core.v1.HTTPGetActionArgs(path="/readyz", port="metrics"),
                period_seconds=10,
                timeout_seconds=5,
                failure_threshold=3,
            ),
            security_context=restricted_container_security(),
            volume_mounts=mounts,
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
                replicas=args.spec.replicas,
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
                        labels=all_labels, annotations=annotations or None
                    ),
                    spec=k8s.core.v1.PodSpecArgs(
                        service_account_name=full_name,
                        automount_service_account_token=False,
                        enable_service_links=False,
                        termination_grace_period_seconds=args.spec.grace_period_s,
                        security_context=restricted_pod_security(args.run_as_user),
                        containers=[container],
                        volumes=volumes,
                    ),
                ),
            ),
            opts=child,
        )
        k8s.policy.v1.PodDisruptionBudget(
            f"{name}-pdb",
            metadata=meta,
            spec=k8s.policy.v1.PodDisruptionBudgetSpecArgs(
                max_unavailable=1,
                selector=k8s.meta.v1.LabelSelectorArgs(match_labels=labels),
                unhealthy_pod_eviction_policy="AlwaysAllow",
            ),
            opts=child,
        )
        self.deployment_name = pulumi.Output.from_input(full_name)
        self.register_outputs({"deployment_name": self.deployment_name})
