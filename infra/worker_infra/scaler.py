"""BacklogScaler: a KEDA ScaledObject on backlog (load and age), never on CPU.

Triggers of a pool (the HPA follows the largest desired count of them):

- ``load`` (prometheus, ``AverageValue``): messages waiting in the pool's queues plus the
  handlers running in its pods, against what one replica serves (``processes x
  concurrency``): desired = ceil((waiting + in flight) / per replica). A busy pool with a
  short list keeps its replicas; a backlog adds them.
- ``age`` (prometheus, ``Value``): the oldest waiting message's age against
  ``backlog_age_target_s``: desired = ceil(replicas x age / target).
- ``age`` (prometheus, ``Value``): how long the oldest due message has waited against
  ``backlog_age_target_s``: desired = ceil(replicas x age / target). Waiting counts from
  when a message became due (a delayed or retried message from its ``eta``), so a delay
  does not read as a backlog; a delayed message past its ``eta`` that no worker fetched
  counts too (its queue's ``q.DQ`` series): this is what wakes a pool at zero for a due
  retry.
- ``ready-<q>`` (redis list length): the ready list ``<ns>:<q>`` (``<ns>``: the pool's
  ``broker_namespace``, ``dramatiq``, or ``dramatiq-sandbox`` for the sandbox pool). It
  needs no scrape, so it wakes a pool at zero for new messages and keeps scaling up when
  Prometheus is down. ``ready-<q>-high`` and ``ready-<q>-low`` watch the lists of its
  other priority lanes the same way (a message sent with a priority waits there). A keyed
  message (``fair_key``) waits on the fair lane, a sorted set no list trigger reads: it
  wakes a pool at zero through the ``age`` and ``load`` queries, which count every lane.
  The delay list is not a trigger: a message not yet due would wake a
  pool at zero, whose worker would hold it in memory, be scaled back to zero after the
  cooldown, hand it back on its drain and wake the pool again (one pod start per
  cooldown until the message is due).

Queries read the series of :class:`~.monitoring.PoolSeries`: the pool's namespace, scrape
job and pool label; the backlog from the service's namespace, where the scheduler exports
it at zero pods. No backlog data is an error, never 0 (``ignoreNullValues: false``): the
HPA then never scales down on a missing metric, and the redis triggers still scale up.
No worker pod reads 0 in flight. (KEDA's ``fallback`` cannot be used with a ``Value``
trigger.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
from worker_runtime import contract

from .args import BrokerSpec, PoolSpec, ScalingSpec, dns_label
from .keys import DELAY_SUFFIX, priority_lists, ready_list
from .monitoring import PoolSeries, queues_regex
from .pool import pool_labels
from .secrets import BROKER_PASSWORD_KEY


def load_query(series: PoolSeries, queues: tuple[str, ...]) -> str:
    """Waiting plus in-flight messages of a pool (PromQL); 0 in flight without a pod."""
    ready = series.backlog(f'queue=~"{queues_regex(queues)}"')
    waiting = f"sum(max by (queue) ({contract.QUEUE_DEPTH}{{{ready}}}))"
    running = f"(sum({contract.INFLIGHT_JOBS}{{{series.workers()}}}) or vector(0))"
    return f"{waiting} + {running}"


def age_query(series: PoolSeries, queues: tuple[str, ...]) -> str:
    """How long the pool's oldest due message has waited (PromQL): the heads of its ready
    lists and how overdue the heads of its delay lists are."""
    due = series.backlog(f'queue=~"{queues_regex(queues)}|{queues_regex(queues, DELAY_SUFFIX)}"')
    return f"max({contract.QUEUE_OLDEST_MESSAGE}{{{due}}})"


def redis_trigger(
    name: str, list_name: str, broker: BrokerSpec, target: int, auth: str | None
) -> dict[str, Any]:
    """A ``redis`` list-length trigger, active as soon as the list holds one message."""
    trigger: dict[str, Any] = {
        "type": "redis",
        "name": dns_label(name),
        "metricType": "AverageValue",
        "metadata": {
            "address": broker.address,
            "listName": list_name,
            "listLength": str(target),
            "activationListLength": "0",
            "databaseIndex": str(broker.db),
            "enableTLS": "true" if broker.tls else "false",
        },
    }
    if auth is not None:
        trigger["authenticationRef"] = {"name": auth}
    return trigger


def prometheus_trigger(
    name: str, server: str, query: str, threshold: int, metric_type: str
) -> dict[str, Any]:
    """A ``prometheus`` trigger; no data is an error (never read as 0)."""
    return {
        "type": "prometheus",
        "name": name,
        "metricType": metric_type,
        "metadata": {
            "serverAddress": server,
            "query": query,
            "threshold": str(threshold),
            "ignoreNullValues": "false",
        },
    }


@dataclass(frozen=True)
class BacklogScalerArgs:
    """Arguments of :class:`BacklogScaler`.

    Parameters:
      pool: pool slug (for names, labels and the series' pool label).
      project: the service (name prefix).
      namespace: namespace of the ScaledObject, the TriggerAuthentication and the target.
      target: name of the Deployment to scale.
      queues: the pool's queues.
      broker_namespace: the prefix of their Redis keys (the pool's ``broker_namespace``).
      min_replicas: ``minReplicaCount``, the pool's floor.
      max_replicas: ``maxReplicaCount``, the capacity-capped maximum.
      backlog_age_target_s: the age trigger's target (oldest message, seconds).
      per_replica: messages one replica runs at once (``processes x concurrency``): the
        load trigger's and the ready lists' target.
      processes: processes per replica.
      backlog_namespace: namespace where the scheduler exports the pool's backlog (the
        service's; default ``namespace``).
      broker: the broker (address, db, TLS, whether there is a password).
      broker_secret: Secret holding ``redis-password`` for the TriggerAuthentication.
      broker_username_key: key of that Secret holding a Redis ACL user name, if any.
      scaling: polling, cooldown and HPA behaviour.
      scale_down_period_s: the pool's scale-down period (default: ``scaling``'s).
      labels: extra labels on every object.
    """

    pool: str
    project: str
    namespace: str
    target: pulumi.Input[str]
    queues: tuple[str, ...]
    broker_namespace: str
    min_replicas: int
    max_replicas: int
    backlog_age_target_s: int
    per_replica: int
    processes: int
    broker: BrokerSpec
    broker_secret: str
    scaling: ScalingSpec = field(default_factory=ScalingSpec)
    scale_down_period_s: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    broker_username_key: str | None = None
    backlog_namespace: str | None = None

    @property
    def series(self) -> PoolSeries:
        """The pool's series in Prometheus (:mod:`.monitoring`)."""
        return PoolSeries(self.project, self.pool, self.namespace, self.backlog_namespace)

    @classmethod
    def for_pool(
        cls,
        pool: PoolSpec,
        *,
        project: str,
        namespace: str,
        target: pulumi.Input[str],
        max_replicas: int,
        broker: BrokerSpec,
        broker_secret: str,
        scaling: ScalingSpec,
        labels: dict[str, str],
        scale_down_period_s: int | None = None,
        broker_username_key: str | None = None,
        backlog_namespace: str | None = None,
    ) -> BacklogScalerArgs:
        """The arguments of ``pool``'s scaler: its slug, queues, broker namespace, floor, age
        target, processes and per-replica load (``processes x concurrency``) come from the
        pool; the rest as the fields of the same names (``scale_down_period_s``,
        ``broker_username_key`` and ``backlog_namespace`` default to None)."""
        return cls(
            pool=pool.slug,
            project=project,
            namespace=namespace,
            target=target,
            queues=pool.queues,
            broker_namespace=pool.broker_namespace,
            min_replicas=pool.min_replicas,
            max_replicas=max_replicas,
            backlog_age_target_s=pool.backlog_age_target_s,
            per_replica=pool.processes * pool.concurrency,
            processes=pool.processes,
            broker=broker,
            broker_secret=broker_secret,
            scaling=scaling,
            scale_down_period_s=scale_down_period_s,
            labels=labels,
            broker_username_key=broker_username_key,
            backlog_namespace=backlog_namespace,
        )


def triggers(args: BacklogScalerArgs, auth: str | None) -> list[dict[str, Any]]:
    """The ScaledObject's triggers (see the module docstring)."""
    s = args.scaling
    out = [
        prometheus_trigger(
            "load",
            s.prometheus_server,
            load_query(args.series, args.queues),
            args.per_replica,
            "AverageValue",
        ),
        prometheus_trigger(
            "age",
            s.prometheus_server,
            age_query(args.series, args.queues),
            args.backlog_age_target_s,
            "Value",
        ),
    ]
    for queue in args.queues:
        lists = {f"ready-{queue}": ready_list(queue)}
        lists.update({f"ready-{queue}-{p}": name for p, name in priority_lists(queue).items()})
        out.extend(
            redis_trigger(name, list_name, args.broker, args.per_replica, auth)
            for name, list_name in lists.items()
        )
    return out


def behavior(args: BacklogScalerArgs) -> dict[str, Any]:
    """The HPA behaviour: prompt scale-up, slow scale-down."""
    s = args.scaling
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": s.scale_up_window_s,
            "selectPolicy": "Max",
            "policies": [
                {
                    "type": "Percent",
                    "value": s.scale_up_percent,
                    "periodSeconds": s.scale_up_period_s,
                },
                {"type": "Pods", "value": s.scale_up_pods, "periodSeconds": s.scale_up_period_s},
            ],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": s.scale_down_window_s,
            "selectPolicy": "Min",
            "policies": [
                {
                    "type": "Pods",
                    "value": s.scale_down_pods,
                    "periodSeconds": args.scale_down_period_s or s.scale_down_period_s,
                }
            ],
        },
    }


KEDA_API_VERSION = "keda.sh/v1alpha1"


def keda_object(
    resource: str,
    kind: str,
    metadata: dict[str, Any],
    spec: dict[str, Any],
    opts: pulumi.ResourceOptions,
) -> k8s.apiextensions.CustomResource:
    """A KEDA custom resource ``kind`` (Pulumi resource name ``resource``)."""
    return k8s.apiextensions.CustomResource(
        resource, api_version=KEDA_API_VERSION, kind=kind, metadata=metadata, spec=spec, opts=opts
    )


def secret_refs(args: BacklogScalerArgs) -> list[dict[str, Any]]:
    """The TriggerAuthentication's references into ``args.broker_secret``: the password
    and, with an ACL user (``args.broker_username_key``), its name."""
    keys = [("password", BROKER_PASSWORD_KEY)]
    if args.broker_username_key:
        keys.append(("username", args.broker_username_key))
    return [{"parameter": p, "name": args.broker_secret, "key": key} for p, key in keys]


class BacklogScaler(pulumi.ComponentResource):
    """KEDA ScaledObject (plus a TriggerAuthentication for the Redis password).

    Triggers and their semantics: see the module docstring.
    """

    def __init__(
        self, name: str, args: BacklogScalerArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("worker-infra:index:BacklogScaler", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        full_name = dns_label(f"{args.project}-{args.pool}")
        labels = {**args.labels, **pool_labels(args.project, args.pool)}
        auth_name: str | None = None
        self.trigger_auth: k8s.apiextensions.CustomResource | None = None
        if args.broker.password is not None:
            auth_name = f"{full_name}-redis"
            self.trigger_auth = keda_object(
                f"{name}-trigger-auth",
                "TriggerAuthentication",
                {"name": auth_name, "namespace": args.namespace, "labels": labels},
                {"secretTargetRef": secret_refs(args)},
                child,
            )
        s = args.scaling
        self.scaled_object = keda_object(
            f"{name}-scaled-object",
            "ScaledObject",
            {"name": full_name, "namespace": args.namespace, "labels": labels},
            {
                "scaleTargetRef": {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": args.target,
                },
                "pollingInterval": s.polling_interval_s,
                "cooldownPeriod": s.cooldown_period_s,
                "minReplicaCount": args.min_replicas,
                "maxReplicaCount": args.max_replicas,
                "advanced": {
                    "restoreToOriginalReplicaCount": False,
                    "horizontalPodAutoscalerConfig": {"behavior": behavior(args)},
                },
                "triggers": triggers(args, auth_name),
            },
            pulumi.ResourceOptions(
                parent=self, depends_on=[self.trigger_auth] if self.trigger_auth else None
            ),
        )
        self.name = pulumi.Output.from_input(full_name)
        self.register_outputs({"name": self.name})
