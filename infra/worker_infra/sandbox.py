"""SandboxPool: the untrusted-code pool in its own locked-down namespace."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from .acl import acl_rule
from .args import (
    DEFAULT_GRACE_MARGIN_S,
    DEFAULT_MEMORY_BASE,
    DEFAULT_METRICS_PORT,
    SANDBOX_CPU_LIMIT_FACTOR,
    BrokerSpec,
    PoolSpec,
    SandboxSpec,
    ScalingSpec,
    Timing,
)
from .capacity import TRANSITION_PODS
from .errors import GuardError
from .guards import mib
from .monitoring import pod_monitor
from .pool import WorkerPool, WorkerPoolArgs, pool_labels
from .poolsfile import checksum, config_map_name, pools_config_map
from .scaler import BacklogScaler, BacklogScalerArgs
from .secrets import (
    BROKER_USERNAME_KEY,
    acl_broker_secret,
    broker_secret,
    broker_secret_name,
)

RESTRICTED_LABELS = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
    "pod-security.kubernetes.io/audit": "restricted",
    "pod-security.kubernetes.io/warn": "restricted",
}
#: DNS on both protocols, the sandbox's only egress besides the broker.
DNS_PORTS = (("UDP", 53), ("TCP", 53))


def without_trace_export(env: Mapping[str, str]) -> dict[str, str]:
    """The sandbox pool's extra environment: ``env`` with tracing switched off.

    Its namespace lets pods reach DNS and the broker only, so an OTLP exporter there
    could only time out; the untrusted child gets no environment at all.
    """
    kept = {
        k: v
        for k, v in env.items()
        if not k.startswith("OTEL_EXPORTER_OTLP") and k != "OTEL_TRACES_EXPORTER"
    }
    kept["OTEL_SDK_DISABLED"] = "true"
    return kept


def cpu_limit_millis(pool: PoolSpec) -> int:
    """The sandbox container's CPU limit in millicores: it runs untrusted code, so it gets
    a ceiling, :data:`.args.SANDBOX_CPU_LIMIT_FACTOR` x its request."""
    return pool.cpu_millis * SANDBOX_CPU_LIMIT_FACTOR


def quota(pool: PoolSpec, sandbox: SandboxSpec, max_replicas: int) -> dict[str, str]:
    """The sandbox namespace's ResourceQuota: ``max_replicas`` pods plus the transition
    budget (:data:`.capacity.TRANSITION_PODS`) at the pool's CPU (request and limit) and
    memory each, unless ``sandbox`` states the pods, CPU or memory; one Secret, no
    Service, no volume claim."""
    pods = sandbox.quota_pods or max_replicas + TRANSITION_PODS
    memory = sandbox.quota_memory or mib(pool.memory_bytes * pods)
    return {
        "pods": str(pods),
        "requests.cpu": sandbox.quota_cpu or f"{pool.cpu_millis * pods}m",
        "limits.cpu": f"{cpu_limit_millis(pool) * pods}m",
        "requests.memory": memory,
        "limits.memory": memory,
        "secrets": "1",
        "services": "0",
        "persistentvolumeclaims": "0",
    }


def ip_block(text: str, what: str) -> str:
    """``text`` (an address or a CIDR) as a CIDR; ``GuardError`` naming ``what`` otherwise."""
    try:
        return str(ipaddress.ip_network(text, strict=True))
    except ValueError as error:
        raise GuardError(
            f"sandbox egress: {what} {text!r} is not an address or CIDR ({error})"
        ) from None


def ip_peer(cidr: str) -> k8s.networking.v1.NetworkPolicyPeerArgs:
    """The addresses of ``cidr`` (outside the cluster's pods: a node-local cache, a managed
    Redis)."""
    return k8s.networking.v1.NetworkPolicyPeerArgs(
        ip_block=k8s.networking.v1.IPBlockArgs(cidr=cidr)
    )


Ports = Sequence[tuple[str, int]]
Meta = Callable[[str], k8s.meta.v1.ObjectMetaArgs]


def namespace_peer(
    namespace: str, pods: Mapping[str, str] | None = None
) -> k8s.networking.v1.NetworkPolicyPeerArgs:
    """The pods labelled ``pods`` in ``namespace`` (default None: the whole namespace),
    the namespace selected by the ``kubernetes.io/metadata.name`` label the API server sets."""
    return k8s.networking.v1.NetworkPolicyPeerArgs(
        namespace_selector=k8s.meta.v1.LabelSelectorArgs(
            match_labels={"kubernetes.io/metadata.name": namespace}
        ),
        pod_selector=None if pods is None else k8s.meta.v1.LabelSelectorArgs(match_labels=pods),
    )


def policy_ports(ports: Ports) -> list[k8s.networking.v1.NetworkPolicyPortArgs]:
    """``ports`` as (protocol, port) pairs, in order."""
    return [k8s.networking.v1.NetworkPolicyPortArgs(protocol=p, port=port) for p, port in ports]


def network_policy(
    resource: str,
    metadata: k8s.meta.v1.ObjectMetaArgs,
    opts: pulumi.ResourceOptions,
    *,
    ingress: k8s.networking.v1.NetworkPolicyIngressRuleArgs | None = None,
    egress: k8s.networking.v1.NetworkPolicyEgressRuleArgs | None = None,
) -> k8s.networking.v1.NetworkPolicy:
    """A NetworkPolicy over every pod of the namespace.

    With neither rule (the defaults) it denies all ingress and egress; with ``ingress``
    or ``egress`` it is of that one type and admits that one rule.
    """
    types = [t for t, rule in (("Ingress", ingress), ("Egress", egress)) if rule is not None]
    return k8s.networking.v1.NetworkPolicy(
        resource,
        metadata=metadata,
        spec=k8s.networking.v1.NetworkPolicySpecArgs(
            pod_selector=k8s.meta.v1.LabelSelectorArgs(),
            policy_types=types or ["Ingress", "Egress"],
            ingress=None if ingress is None else [ingress],
            egress=None if egress is None else [egress],
        ),
        opts=opts,
    )


def network_policies(
    name: str,
    meta: Meta,
    sandbox: SandboxSpec,
    broker: BrokerSpec,
    monitoring_namespace: str,
    metrics_port: int,
    opts: pulumi.ResourceOptions,
) -> None:
    """The sandbox namespace's policies: default-deny, egress to DNS (``sandbox``'s
    ``dns_namespace``/``dns_selector``, and its ``node_local_dns`` address when set, port
    53) and to the broker on the broker port (its pods, or ``broker.cidr`` when the broker
    is outside the cluster), ingress from ``monitoring_namespace`` to ``metrics_port`` only.

    ``name`` prefixes the resource names, ``meta(policy)`` gives each policy's metadata.
    """

    def allow_egress(
        policy: str, peers: Sequence[k8s.networking.v1.NetworkPolicyPeerArgs], ports: Ports
    ) -> None:
        network_policy(
            f"{name}-{policy}",
            meta(policy),
            opts,
            egress=k8s.networking.v1.NetworkPolicyEgressRuleArgs(
                to=list(peers), ports=policy_ports(ports)
            ),
        )

    dns = [namespace_peer(sandbox.dns_namespace, sandbox.dns_selector)]
    if sandbox.node_local_dns is not None:
        dns.append(ip_peer(ip_block(sandbox.node_local_dns, "sandbox.nodeLocalDns")))
    broker_peer = (
        ip_peer(ip_block(broker.cidr, "redis.cidr"))
        if broker.cidr is not None
        else namespace_peer(broker.namespace, broker.pod_selector)
    )
    network_policy(f"{name}-default-deny", meta("default-deny"), opts)
    allow_egress("allow-dns", dns, DNS_PORTS)
    allow_egress("allow-broker", [broker_peer], [("TCP", broker.port)])
    network_policy(
        f"{name}-allow-scrape",
        meta("allow-scrape"),
        opts,
        ingress=k8s.networking.v1.NetworkPolicyIngressRuleArgs(
            from_=[namespace_peer(monitoring_namespace)],
            ports=policy_ports([("TCP", metrics_port)]),
        ),
    )


@dataclass(frozen=True)
class SandboxPoolArgs:
    """Arguments of :class:`SandboxPool`.

    Parameters:
      pool: the sandbox pool (``sandbox = true``; uses no downstream resource).
      project: the service.
      image: image reference with tag.
      namespace: the sandbox namespace (created here, labelled "restricted").
      broker: the broker; its pods and port are the only egress besides DNS.
      pools_file: the pools file this pool's pods read (mounted from a ConfigMap in this
        namespace; :meth:`.ServiceSpec.pool_file`).
      timing: the service's timing rule and kill-after (:class:`.args.Timing`).
      max_replicas: the scaler's capped maximum (default: the pool's).
      sandbox: RuntimeClass, quota and DNS options.
      scaling: KEDA and scrape settings; only ``scaling.monitoring_namespace`` may reach
        the pods, on the metrics port.
      grace_margin_s, memory_base, metrics_port, labels, env: as for :class:`WorkerPoolArgs`.
      create_namespace: create the namespace (default True); a pre-created one must carry
        the Pod Security "restricted" labels (:data:`RESTRICTED_LABELS`).
      backlog_namespace: where the service's scheduler exports the pool's backlog (its
        scaler reads it there; default: ``namespace``).
    """

    pool: PoolSpec
    project: str
    image: str
    namespace: str
    broker: BrokerSpec
    pools_file: str
    timing: Timing
    max_replicas: int | None = None
    sandbox: SandboxSpec = field(default_factory=SandboxSpec)
    scaling: ScalingSpec = field(default_factory=ScalingSpec)
    grace_margin_s: int = DEFAULT_GRACE_MARGIN_S
    memory_base: int = DEFAULT_MEMORY_BASE
    metrics_port: int = DEFAULT_METRICS_PORT
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] | None = None
    create_namespace: bool = True
    backlog_namespace: str | None = None


class SandboxPool(pulumi.ComponentResource):
    """A :class:`WorkerPool` (and its scaler) in a namespace of its own.

    Creates: the Namespace (Pod Security "restricted" enforced), a Secret with the broker
    credentials only, the pools file's ConfigMap, a default-deny NetworkPolicy (ingress
    and egress), egress rules to DNS and to the broker pods on the broker port, an ingress
    rule admitting only the monitoring namespace to the metrics port, a ResourceQuota and
    a LimitRange, an optional RuntimeClass, a PodMonitor (``scaling.pod_monitor``), then the
    pool and its BacklogScaler.
    """

    def __init__(
        self, name: str, args: SandboxPoolArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("worker-infra:index:SandboxPool", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        pool, sb, ns = args.pool, args.sandbox, args.namespace
        labels = {**args.labels, **pool_labels(args.project, pool.slug)}

        def meta(obj: str) -> k8s.meta.v1.ObjectMetaArgs:
            return k8s.meta.v1.ObjectMetaArgs(name=obj, namespace=ns, labels=labels)

        self.namespace: k8s.core.v1.Namespace | None = None
        after_ns = child
        if args.create_namespace:
            self.namespace = k8s.core.v1.Namespace(
                f"{name}-namespace",
                metadata=k8s.meta.v1.ObjectMetaArgs(
                    name=ns, labels={**labels, **RESTRICTED_LABELS}
                ),
                opts=child,
            )
            after_ns = pulumi.ResourceOptions(parent=self, depends_on=[self.namespace])
        if sb.runtime_class and sb.runtime_handler:
            k8s.node.v1.RuntimeClass(
                f"{name}-runtime-class",
                metadata=k8s.meta.v1.ObjectMetaArgs(name=sb.runtime_class, labels=labels),
                handler=sb.runtime_handler,
                opts=child,
            )
        secret_name = broker_secret_name(args.project)
        #: The ACL rule to install on the broker (a secret Output), None without an ACL user.
        self.broker_acl: pulumi.Output[str] | None = None
        username_key: str | None = None
        if sb.broker_user and sb.broker_password is not None:
            secret = acl_broker_secret(
                f"{name}-broker", secret_name, ns, args.broker, sb, labels, after_ns
            )
            user, keys = sb.broker_user, pool.broker_namespace
            self.broker_acl = pulumi.Output.secret(sb.broker_password).apply(
                lambda password: acl_rule(user, password, keys)
            )
            username_key = BROKER_USERNAME_KEY
        else:
            secret = broker_secret(f"{name}-broker", secret_name, ns, args.broker, labels, after_ns)
        pools_name = config_map_name(args.project, args.pools_file, pool.slug)
        config_map = pools_config_map(
            f"{name}-pools", pools_name, ns, args.pools_file, labels, after_ns
        )
        network_policies(
            name,
            meta,
            sb,
            args.broker,
            args.scaling.monitoring_namespace,
            args.metrics_port,
            after_ns,
        )
        if args.scaling.pod_monitor:
            pod_monitor(
                f"{name}-pod-monitor",
                ns,
                args.project,
                args.scaling.scrape_interval_s,
                {**labels, **args.scaling.monitoring_labels},
                after_ns,
            )
        max_replicas = args.max_replicas or pool.max_replicas
        k8s.core.v1.ResourceQuota(
            f"{name}-quota",
            metadata=meta("sandbox-quota"),
            spec=k8s.core.v1.ResourceQuotaSpecArgs(hard=quota(pool, sb, max_replicas)),
            opts=after_ns,
        )
        k8s.core.v1.LimitRange(
            f"{name}-limits",
            metadata=meta("sandbox-limits"),
            spec=k8s.core.v1.LimitRangeSpecArgs(
                limits=[
                    k8s.core.v1.LimitRangeItemArgs(
                        type="Container",
                        max={"memory": pool.memory, "cpu": f"{cpu_limit_millis(pool)}m"},
                        default={"memory": pool.memory, "cpu": f"{cpu_limit_millis(pool)}m"},
                        default_request={"cpu": pool.cpu, "memory": pool.memory},
                    )
                ]
            ),
            opts=after_ns,
        )
        self.pool = WorkerPool(
            f"{name}-pool",
            WorkerPoolArgs(
                pool=pool,
                project=args.project,
                image=args.image,
                namespace=ns,
                broker_secret=secret_name,
                pools_config_map=pools_name,
                pools_checksum=checksum(args.pools_file),
                timing=args.timing,
                database_secret=None,
                grace_margin_s=args.grace_margin_s,
                memory_base=args.memory_base,
                metrics_port=args.metrics_port,
                runtime_class=sb.runtime_class,
                labels=args.labels,
                env=without_trace_export(args.env or {}),
                max_replicas=max_replicas,
                cpu_limit=f"{cpu_limit_millis(pool)}m",
            ),
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=[r for r in (self.namespace, secret, config_map) if r is not None],
            ),
        )
        self.scaler = BacklogScaler(
            f"{name}-scaler",
            BacklogScalerArgs.for_pool(
                pool,
                project=args.project,
                namespace=ns,
                target=self.pool.deployment_name,
                max_replicas=max_replicas,
                broker=args.broker,
                broker_secret=secret_name,
                scaling=args.scaling,
                labels=args.labels,
                broker_username_key=username_key,
                backlog_namespace=args.backlog_namespace,
            ),
            opts=after_ns,
        )
        self.register_outputs({"namespace": ns, "broker_acl": self.broker_acl})
