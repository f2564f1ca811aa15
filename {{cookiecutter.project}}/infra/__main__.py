"""Pulumi program: pools.toml + this stack's config -> the service's worker pools.

pools.toml is read by the service's own loader (``src/<package>/pools.py``), so it has one
parser. The stack file (``Pulumi.<stack>.yaml``) may override numbers per environment:

  pools:        {<pool>: {<pools.toml key>: value}}   e.g. replica ranges
  downstream:   {<resource>: {capacity: n, reserved: n}}
  imageTag, image, namespace, prometheusServer, graceMarginS, memoryBase, env
  redis:        {host, port, db, tls, namespace, podSelector}
  redisPassword, databaseUrl: secrets (``pulumi config set --secret``)
  sandbox:      {namespace, runtimeClass, runtimeHandler, brokerUser}
  sandboxRedisPassword: secret of the sandbox pool's own Redis ACL user (required with a
                sandbox pool); the stack output ``sandboxBrokerAcl`` is the rule to install
                on the broker (``ACL SETUSER`` or an aclfile line)
  scheduler:    {replicas, leaderTtlMs, cpu, memory}   (rendered when pools.toml has schedules)
  prometheusRule: false where the Prometheus Operator's CRD is not installed (default true)

Every guard of worker_infra runs before anything is created; a refused stack fails
``pulumi preview`` (and ``make manifests``) with the pools and numbers named.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pulumi
from worker_infra import (
    BrokerSpec,
    DownstreamSpec,
    GuardError,
    PoolSpec,
    SandboxPool,
    SandboxSpec,
    ScalingSpec,
    SchedulerSpec,
    ServiceSpec,
    WorkerService,
)

PROJECT = "{{ cookiecutter.project }}"
PACKAGE = "{{ cookiecutter.package }}"
IMAGE = "{{ cookiecutter.image }}"
NAMESPACE = "{{ cookiecutter.k8s_namespace }}"
ROOT = Path(__file__).resolve().parent.parent


def pools_module() -> ModuleType:
    """The service's pools.py (and the schedules.py it imports), from src/. The package's
    __init__ imports nothing, so only pydantic and croniter are needed here."""
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return importlib.import_module(f"{PACKAGE}.pools")


def _merge(base: dict[str, Any], overrides: dict[str, Any], table: str) -> None:
    for name, values in overrides.items():
        if name not in base:
            raise GuardError(f"stack config {table}.{name}: no such entry in pools.toml")
        if not isinstance(values, dict):
            raise GuardError(f"stack config {table}.{name}: expected a mapping of pools.toml keys")
        base[name] = {**base[name], **values}


def load_stack_pools(config: pulumi.Config) -> Any:
    """pools.toml with this stack's ``pools`` and ``downstream`` overrides, validated again."""
    module = pools_module()
    stack = pulumi.get_stack()
    try:
        pools_file = module.load_pools(ROOT / "pools.toml")
    except module.PoolsFileError as error:
        raise GuardError(str(error).replace("\n", "; ")) from None
    data = pools_file.model_dump(exclude_unset=True)
    data.setdefault("downstream", {})
    _merge(data["pools"], config.get_object("pools") or {}, "pools")
    _merge(data["downstream"], config.get_object("downstream") or {}, "downstream")
    try:
        return module.PoolsFile.model_validate(data)
    except Exception as error:  # pydantic.ValidationError, without importing pydantic here
        errors = getattr(error, "errors", None)
        if errors is None:
            raise
        lines = [
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
            for e in errors()
        ]
        raise GuardError(f"Pulumi.{stack}.yaml with pools.toml: " + "; ".join(lines)) from None


#: The downstream resource of pools.toml that DATABASE_URL points at (database option).
DATABASE_RESOURCE = "postgres"


def specs(pools_file: Any) -> tuple[tuple[PoolSpec, ...], tuple[DownstreamSpec, ...]]:
    """The typed arguments of worker_infra from the validated pools file."""
    pools = tuple(
        PoolSpec(
            name=name,
            queues=tuple(p.queues),
            processes=p.processes,
            concurrency=p.concurrency,
            job_timeout_ms=p.job_timeout_ms,
            shutdown_timeout_ms=p.shutdown_timeout_ms,
            max_attempts=p.max_attempts,
            db_pool_size=p.db_pool_size,
            memory=p.memory,
            cpu=p.cpu,
            handler_memory=p.handler_memory,
            min_replicas=p.min_replicas,
            max_replicas=p.max_replicas,
            backlog_age_target_s=p.backlog_age_target_s,
            uses=tuple(p.uses),
            sandbox=p.sandbox,
        )
        for name, p in pools_file.pools.items()
    )
    downstream = tuple(
        DownstreamSpec(name=n, capacity=d.capacity, reserved=d.reserved, per_process=d.per_process)
        for n, d in pools_file.downstream.items()
    )
    return pools, downstream


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


def plain_env(config: pulumi.Config) -> dict[str, str]:
    """Extra environment of every container: the stack's ``env``, plus the OTLP endpoint
    of ``otlpEndpoint`` (tracing stays off without one; the sandbox pool never exports)."""
    env = {str(k): str(v) for k, v in (config.get_object("env") or {}).items()}
    endpoint = config.get("otlpEndpoint")
    if endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    return env


def main() -> None:
    """Build the stack: one WorkerService holding every pool of pools.toml."""
    config = pulumi.Config()
    pools_file = load_stack_pools(config)
    pools, downstream = specs(pools_file)
    redis: dict[str, Any] = config.get_object("redis") or {}
    sandbox: dict[str, Any] = config.get_object("sandbox") or {}
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
    )
    image = config.get("image") or f"{IMAGE}:{config.require('imageTag')}"
    prometheus = config.get("prometheusServer") or ScalingSpec().prometheus_server
    margin = config.get_int("graceMarginS")
    service = WorkerService(
        PROJECT,
        ServiceSpec(
            project=PROJECT,
            image=image,
            namespace=config.get("namespace") or NAMESPACE,
            pools=pools,
            downstream=downstream,
            broker=broker,
            database_url=(
                config.require_secret("databaseUrl")
                if any(d.name == DATABASE_RESOURCE for d in downstream)
                else None
            ),
            scaling=ScalingSpec(prometheus_server=prometheus),
            sandbox=SandboxSpec(
                namespace=sandbox.get("namespace"),
                runtime_class=sandbox.get("runtimeClass"),
                runtime_handler=sandbox.get("runtimeHandler"),
                broker_user=str(sandbox.get("brokerUser", f"{PROJECT}-sandbox")),
                broker_password=(
                    config.require_secret("sandboxRedisPassword")
                    if any(p.sandbox for p in pools)
                    else None
                ),
            ),
            grace_margin_s=15 if margin is None else margin,
            memory_base=config.get("memoryBase") or "96Mi",
            env=plain_env(config),
            scheduler=scheduler_spec(pools_file, config),
            prometheus_rule=config.get_bool("prometheusRule") is not False,
        ),
    )
    pulumi.export("pools", sorted(service.pools))
    for pool in service.pools.values():
        if isinstance(pool, SandboxPool) and pool.broker_acl is not None:
            pulumi.export("sandboxBrokerAcl", pool.broker_acl)
    pulumi.export("capacity", [str(usage) for usage in service.plan.capacity])


# Pulumi (and render.py) run this file as __main__; infra/alerts.py imports its helpers.
if __name__ == "__main__":
    main()
