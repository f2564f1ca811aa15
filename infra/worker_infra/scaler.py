"""BacklogScaler: a KEDA ScaledObject on backlog (depth and age), never on CPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from .args import BrokerSpec, ScalingSpec
from .pool import BROKER_PASSWORD_KEY


def redis_trigger(
    queue: str, broker: BrokerSpec, list_length: int, auth: str | None
) -> dict[str, Any]:
    """A ``redis`` listLength trigger on Dramatiq's ready list ``dramatiq:<queue>``."""
    trigger: dict[str, Any] = {
        "type": "redis",
        "name": f"depth-{queue}".replace("_", "-"),
        "metadata": {
            "address": broker.address,
            "listName": f"dramatiq:{queue}",
            "listLength": str(list_length),
            "databaseIndex": str(broker.db),
            "enableTLS": "true" if broker.tls else "false",
        },
    }
    if auth is not None:
        trigger["authenticationRef"] = {"name": auth}
    return trigger


def age_trigger(queue: str, server: str, target_s: int) -> dict[str, Any]:
    """A ``prometheus`` trigger on ``queue_oldest_message_seconds{queue=...}``."""
    return {
        "type": "prometheus",
        "name": f"age-{queue}".replace("_", "-"),
        "metadata": {
            "serverAddress": server,
            "query": f'max(queue_oldest_message_seconds{{queue="{queue}"}})',
            "threshold": str(target_s),
            "ignoreNullValues": "true",
        },
    }


@dataclass(frozen=True)
class BacklogScalerArgs:
    """Arguments of :class:`BacklogScaler`.

    Parameters:
      pool: pool name (for names and labels).
      project: the service (name prefix).
      namespace: namespace of the ScaledObject, the TriggerAuthentication and the target.
      target: name of the Deployment to scale.
      queues: the pool's queues; one redis and one prometheus trigger each.
      min_replicas: ``minReplicaCount``, the pool's floor.
      max_replicas: ``maxReplicaCount``, the capacity-capped maximum.
      backlog_age_target_s: the age trigger's threshold (oldest message, seconds).
      list_length: ready messages per replica (the redis trigger's target); usually
        ``processes x concurrency``.
      broker: the broker (address, db, TLS, whether there is a password).
      broker_secret: Secret holding ``redis-password`` for the TriggerAuthentication.
      broker_username_key: key of that Secret holding a Redis ACL user name, if any.
      scaling: polling, cooldown, slow scale-down and fallback settings.
      fallback_replicas: replicas while metrics fail; None means ``max(min_replicas, 1)``.
    """

    pool: str
    project: str
    namespace: pulumi.Input[str]
    target: pulumi.Input[str]
    queues: tuple[str, ...]
    min_replicas: int
    max_replicas: int
    backlog_age_target_s: int
    list_length: int
    broker: BrokerSpec
    broker_secret: str
    scaling: ScalingSpec = field(default_factory=ScalingSpec)
    fallback_replicas: int | None = None
    broker_username_key: str | None = None


class BacklogScaler(pulumi.ComponentResource):
    """KEDA ScaledObject (plus a TriggerAuthentication for the Redis password).

    Triggers: per queue, a ``redis`` listLength trigger on ``dramatiq:<queue>`` and a
    ``prometheus`` trigger on the queue's oldest-message age. Scale-down is slow: an HPA
    stabilization window and at most ``scale_down_pods`` per ``scale_down_period_s``.
    """

    def __init__(
        self, name: str, args: BacklogScalerArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("worker-infra:index:BacklogScaler", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        full_name = f"{args.project}-{args.pool}".replace("_", "-")
        labels = {"app.kubernetes.io/name": args.project, "worker-template/pool": args.pool}
        auth_name: str | None = None
        self.trigger_auth: k8s.apiextensions.CustomResource | None = None
        if args.broker.password is not None:
            auth_name = f"{full_name}-redis"
            self.trigger_auth = k8s.apiextensions.CustomResource(
                f"{name}-trigger-auth",
                api_version="keda.sh/v1alpha1",
                kind="TriggerAuthentication",
                metadata={"name": auth_name, "namespace": args.namespace, "labels": labels},
                spec={
                    "secretTargetRef": [
                        {
                            "parameter": "password",
                            "name": args.broker_secret,
                            "key": BROKER_PASSWORD_KEY,
                        },
                        *(
                            [
                                {
                                    "parameter": "username",
                                    "name": args.broker_secret,
                                    "key": args.broker_username_key,
                                }
                            ]
                            if args.broker_username_key
                            else []
                        ),
                    ]
                },
                opts=child,
            )
        s = args.scaling
        triggers: list[dict[str, Any]] = []
        for queue in args.queues:
            triggers.append(redis_trigger(queue, args.broker, args.list_length, auth_name))
            triggers.append(age_trigger(queue, s.prometheus_server, args.backlog_age_target_s))
        fallback = args.fallback_replicas
        if fallback is None:
            fallback = max(args.min_replicas, 1)
        self.scaled_object = k8s.apiextensions.CustomResource(
            f"{name}-scaled-object",
            api_version="keda.sh/v1alpha1",
            kind="ScaledObject",
            metadata={"name": full_name, "namespace": args.namespace, "labels": labels},
            spec={
                "scaleTargetRef": {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": args.target,
                },
                "pollingInterval": s.polling_interval_s,
                "cooldownPeriod": s.cooldown_period_s,
                "minReplicaCount": args.min_replicas,
                "maxReplicaCount": args.max_replicas,
                "fallback": {
                    "failureThreshold": s.fallback_failures,
                    "replicas": min(fallback, args.max_replicas),
                },
                "advanced": {
                    "restoreToOriginalReplicaCount": False,
                    "horizontalPodAutoscalerConfig": {
                        "behavior": {
                            "scaleDown": {
                                "stabilizationWindowSeconds": s.scale_down_window_s,
                                "selectPolicy": "Min",
                                "policies": [
                                    {
                                        "type": "Pods",
                                        "value": s.scale_down_pods,
                                        "periodSeconds": s.scale_down_period_s,
                                    }
                                ],
                            }
                        }
                    },
                },
                "triggers": triggers,
            },
            opts=pulumi.ResourceOptions(
                parent=self, depends_on=[self.trigger_auth] if self.trigger_auth else None
            ),
        )
        self.name = pulumi.Output.from_input(full_name)
        self.register_outputs({"name": self.name})
