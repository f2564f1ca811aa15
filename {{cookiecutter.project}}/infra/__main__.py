"""Pulumi program: pools.toml + this stack's config -> the service's worker pools.

pools.toml is read and validated by the service's own pool model (``worker_runtime.pools``),
the one definition of a pool's fields, bounds and defaults. The stack file
(``Pulumi.<stack>.yaml``) may override numbers per environment; the overrides are merged
into pools.toml and validated by that same model, and the merged file is what the pods
mount (a ConfigMap at ``WORKER_POOLS_FILE``): what the guards checked is what runs. Each
pool's pods mount their own view of it (``PoolsFile.for_pool``: their entry in full, the
other pools' queues), so a change to one pool rolls that pool alone; the scheduler's
(``PoolsFile.for_scheduler``) holds every pool's queues and the schedules.

  pools:        {<pool>: {<pools.toml key>: value}}   e.g. replica ranges
  downstream:   {<resource>: {capacity: n, reserved: n}}
  cluster:      {context, kubeconfig, allowAmbient}   the cluster (explicit provider)
  imageTag, image, namespace, createNamespace, prometheusServer, podMonitor,
  monitoringNamespace, graceMarginS, memoryBase, env
  monitoringLabels: {<label>: <value>}  added to the PodMonitors and the PrometheusRule, for a
                Prometheus selecting them by label (kube-prometheus-stack: ``release: <its Helm
                release>``); a bad label fails the render in one line
  redis:        {host, port, db, tls, namespace, podSelector, cidr}   cidr: a broker outside
                the cluster (managed Redis), its address or CIDR: the sandbox's egress admits it
  redisPassword, databaseUrl: secrets (``pulumi config set --secret``)
  sandbox:      {namespace, runtimeClass, runtimeHandler, brokerUser, brokerAclInstalled,
                nodeLocalDns}   nodeLocalDns: NodeLocal DNSCache's address (169.254.20.10)
  sandboxRedisPassword: secret of the sandbox pool's own Redis ACL user (required with a
                sandbox pool). The broker's operator creates that user once (the preflight
                prints the ``ACL SETUSER`` command; the stack output ``sandboxBrokerAcl`` is
                the aclfile line), then sets ``sandbox.brokerAclInstalled: true``
  otlpEndpoint: OTLP/HTTP collector (sets OTEL_EXPORTER_OTLP_ENDPOINT; the sandbox never exports)
  scheduler:    {replicas, leaderTtlMs, cpu, memory}   (rendered when pools.toml has schedules)
  podMonitor, prometheusRule: false where the Prometheus Operator's CRDs are not installed
                (default true)

Before anything is created the preflight (``worker_infra.preflight``) reads the cluster of
the stack's context: a missing KEDA or Prometheus Operator CRD, a missing RuntimeClass, the
sandbox's ACL user not yet installed, or a Deployment selector that would change stops
``pulumi preview`` with one line per step to take. ``make manifests`` checks nothing live.

``env`` adds plain variables to every pool; it may not set a pool-shaping variable
(``WORKER_CONCURRENCY``, ``DB_POOL_SIZE``, ...), one worker_infra sets, or a secret.
Every guard of worker_infra runs before anything is created; a refused stack fails
``pulumi preview`` (and ``make manifests``) with the pools and numbers named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pulumi
import tomli_w
from worker_infra import (
    BrokerSpec,
    ClusterSpec,
    DownstreamSpec,
    GuardError,
    PoolSpec,
    SandboxPool,
    SandboxSpec,
    ScalingSpec,
    SchedulerSpec,
    ServiceSpec,
    Timing,
    WorkerService,
    cluster_provider,
    preflight,
)
from worker_runtime import contract, pools

PROJECT = "{{ cookiecutter.project }}"
IMAGE = "{{ cookiecutter.image }}"
NAMESPACE = "{{ cookiecutter.k8s_namespace }}"
ROOT = Path(__file__).resolve().parent.parent
#: The downstream resource of pools.toml that DATABASE_URL points at (database option).
DATABASE_RESOURCE = "postgres"


def load_stack_pools(config: pulumi.Config) -> Any:
    """pools.toml with this stack's ``pools`` and ``downstream`` overrides, validated by the
    service's pool model."""
    try:
        base = pools.load_pools(ROOT / "pools.toml")
        overrides = {table: config.get_object(table) or {} for table in ("pools", "downstream")}
        return base.with_overrides(overrides, f"Pulumi.{pulumi.get_stack()}.yaml")
    except pools.PoolsFileError as error:
        raise GuardError(str(error).replace("\n", "; ")) from None


def specs(pools_file: Any) -> tuple[tuple[PoolSpec, ...], tuple[DownstreamSpec, ...]]:
    """worker_infra's typed views of the validated pools file (no defaults of their own)."""
    pool_specs = tuple(PoolSpec.of(name, pool) for name, pool in pools_file.pools.items())
    downstream = tuple(DownstreamSpec.of(n, d) for n, d in pools_file.downstream.items())
    return pool_specs, downstream


def pools_text(view: Any, readers: str) -> str:
    """A view of the merged file (``PoolsFile.for_pool``, ``for_scheduler``) as ``readers``
    read it: what the view sets, every value of it explicit."""
    header = (
        f"# pools.toml of {PROJECT} as {readers} read it (infra/__main__.py; do not edit):\n"
        f"# merged with stack {pulumi.get_stack()!r}, validated by the service's pool model;\n"
        "# other pools by their queues only.\n"
    )
    data = view.model_dump(mode="json", exclude_none=True, exclude_unset=True)
    return header + tomli_w.dumps(data)


def pool_texts(pools_file: Any) -> dict[str, str]:
    """Pool -> the file its pods read: its own entry in full, the other pools' queues. A
    change to one pool's numbers changes only its file, so only its pods roll."""
    return {
        name: pools_text(pools_file.for_pool(name), f"the pods of pool {name!r}")
        for name in pools_file.pools
    }


def scheduler_spec(pools_file: Any, config: pulumi.Config) -> SchedulerSpec:
    """The scheduler Deployment: pools.toml's schedule names, the stack's numbers."""
    overrides: dict[str, Any] = config.get_object("scheduler") or {}
    defaults = SchedulerSpec()
    return SchedulerSpec(
        schedules=tuple(pools_file.schedules),
        replicas=int(overrides.get("replicas", defaults.replicas)),
        leader_ttl_ms=int(overrides.get("leaderTtlMs", defaults.leader_ttl_ms)),
        cpu=str(overrides.get("cpu", defaults.cpu)),
        memory=str(overrides.get("memory", defaults.memory)),
    )


def memory_base(config: pulumi.Config) -> int:
    """Bytes per worker process besides its handlers (the memory guard): the stack's
    ``memoryBase``, else the runtime's (``contract.MEMORY_BASE_PER_PROCESS``)."""
    quantity = config.get("memoryBase")
    return contract.MEMORY_BASE_PER_PROCESS if quantity is None else pools.memory_bytes(quantity)


def plain_env(config: pulumi.Config) -> dict[str, str]:
    """Extra environment of every container: the stack's ``env``, plus the OTLP endpoint
    of ``otlpEndpoint`` (tracing stays off without one; the sandbox pool never exports)."""
    env = {str(k): str(v) for k, v in (config.get_object("env") or {}).items()}
    endpoint = config.get("otlpEndpoint")
    if endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    return env


def main() -> None:
    """Build the stack: one WorkerService holding every pool of the merged pools file."""
    config = pulumi.Config()
    stack = pulumi.get_stack()
    pools_file = load_stack_pools(config)
    pool_specs, downstream = specs(pools_file)
    redis: dict[str, Any] = config.get_object("redis") or {}
    sandbox: dict[str, Any] = config.get_object("sandbox") or {}
    cluster: dict[str, Any] = config.get_object("cluster") or {}
    cluster_spec = ClusterSpec(
        context=cluster.get("context"),
        kubeconfig=cluster.get("kubeconfig"),
        allow_ambient=bool(cluster.get("allowAmbient", False)),
    )
    provider = cluster_provider(stack, cluster_spec)
    broker = BrokerSpec(
        host=str(redis.get("host", "redis-master.redis.svc.cluster.local")),
        port=int(redis.get("port", 6379)),
        db=int(redis.get("db", 0)),
        tls=bool(redis.get("tls", False)),
        password=config.require_secret("redisPassword"),
        namespace=str(redis.get("namespace", "redis")),
        pod_selector={
            str(k): str(v)
            for k, v in (redis.get("podSelector") or {"app.kubernetes.io/name": "redis"}).items()
        },
        cidr=None if redis.get("cidr") is None else str(redis["cidr"]),
    )
    tag = config.get("imageTag")
    image = config.get("image") or f"{IMAGE}:{config.require('imageTag')}"
    defaults = ScalingSpec()
    pod_monitor = config.get_bool("podMonitor")
    margin = config.get_int("graceMarginS")
    options: dict[str, Any] = {} if margin is None else {"grace_margin_s": margin}
    spec = ServiceSpec(
        project=PROJECT,
        image=image,
        namespace=config.get("namespace") or NAMESPACE,
        pools=pool_specs,
        downstream=downstream,
        broker=broker,
        pools_file=pools_text(pools_file.for_scheduler(), "the scheduler's pods"),
        pool_files=pool_texts(pools_file),
        pool_env=frozenset(pools.pool_env_fields().values()),
        timing=Timing(pools.timing_problems, pools.KILL_AFTER_DRAIN_S),
        database_url=(
            config.require_secret("databaseUrl")
            if any(d.name == DATABASE_RESOURCE for d in downstream)
            else None
        ),
        scaling=ScalingSpec(
            prometheus_server=config.get("prometheusServer") or defaults.prometheus_server,
            pod_monitor=defaults.pod_monitor if pod_monitor is None else pod_monitor,
            monitoring_namespace=(
                config.get("monitoringNamespace") or defaults.monitoring_namespace
            ),
            monitoring_labels=config.get_object("monitoringLabels") or {},
        ),
        sandbox=SandboxSpec(
            namespace=sandbox.get("namespace"),
            runtime_class=sandbox.get("runtimeClass"),
            runtime_handler=sandbox.get("runtimeHandler"),
            broker_user=str(sandbox.get("brokerUser", f"{PROJECT}-sandbox")),
            broker_password=(
                config.require_secret("sandboxRedisPassword")
                if any(p.sandbox for p in pool_specs)
                else None
            ),
            broker_acl_installed=bool(sandbox.get("brokerAclInstalled", False)),
            node_local_dns=sandbox.get("nodeLocalDns"),
        ),
        memory_base=memory_base(config),
        create_namespace=config.get_bool("createNamespace") is not False,
        instance=f"{PROJECT}-{stack}",
        version=tag or image.rpartition(":")[2],
        env=plain_env(config),
        scheduler=scheduler_spec(pools_file, config),
        prometheus_rule=config.get_bool("prometheusRule") is not False,
        **options,
    )
    preflight.check(spec, preflight.cluster_view(cluster_spec))
    service = WorkerService(PROJECT, spec, opts=pulumi.ResourceOptions(providers=[provider]))
    pulumi.export("pools", sorted(service.pools))
    for pool in service.pools.values():
        if isinstance(pool, SandboxPool) and pool.broker_acl is not None:
            pulumi.export("sandboxBrokerAcl", pool.broker_acl)
    pulumi.export("capacity", [str(usage) for usage in service.plan.capacity])
    pulumi.export(
        "rolloutTimeoutS",
        {
            name: (pool.pool if isinstance(pool, SandboxPool) else pool).rollout_timeout_s
            for name, pool in service.pools.items()
        },
    )


# Pulumi (and render.py) run this file as __main__; infra/alerts.py imports its helpers.
if __name__ == "__main__":
    main()
