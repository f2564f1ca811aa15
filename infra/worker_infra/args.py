"""Typed arguments of the worker_infra components.

worker_infra never imports the baked service: the service's infra program reads
pools.toml with its own loader and converts every pool and downstream resource
into the frozen dataclasses below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import pulumi

if TYPE_CHECKING:
    from .scheduler import SchedulerSpec

PerProcess = Literal["db_pool_size", "concurrency"]


@dataclass(frozen=True)
class DownstreamSpec:
    """A resource the pools share (PostgreSQL connections, a partner's call limit).

    Parameters:
      name: the ``[downstream.<name>]`` key.
      capacity: what the resource can hold in total.
      reserved: held back for the API, admin and migrations (default 0).
      per_process: what one worker process holds of it: ``"db_pool_size"``
        (its DB connection pool, the default) or ``"concurrency"`` (calls in flight).
    """

    name: str
    capacity: int
    reserved: int = 0
    per_process: PerProcess = "db_pool_size"

    @property
    def budget(self) -> int:
        """What the worker pools may use together: ``capacity - reserved``."""
        return self.capacity - self.reserved


@dataclass(frozen=True)
class PoolSpec:
    """One pool of pools.toml, after the stack's overrides.

    Parameters (defaults as in pools.toml):
      name: pool name (``WORKER_POOL``); also the Deployment's and scaler's name suffix.
      queues: Dramatiq queues it alone serves.
      processes: processes per container (default 1).
      concurrency: handler threads per process (default 4).
      job_timeout_ms: hard limit per job (default 30000).
      shutdown_timeout_ms: drain window after SIGTERM (default 40000).
      max_attempts: deliveries before dead-lettering (default 5).
      db_pool_size: DB connections per process; None means ``concurrency``.
      memory: container memory limit (and request), e.g. ``"512Mi"``.
      cpu: CPU request, e.g. ``"250m"`` (no CPU limit: throttling stalls handlers).
      handler_memory: peak memory of one handler, None to skip the memory guard.
      min_replicas, max_replicas: KEDA floor and ceiling (defaults 1 and 2).
      backlog_age_target_s: oldest-message age per replica that KEDA aims at (default 30).
      uses: downstream resources the handlers hold.
      sandbox: True for the untrusted-code pool (own namespace, no egress but DNS + broker).
      stalled_after_s: liveness threshold; None means job timeout + 30 s.
    """

    name: str
    queues: tuple[str, ...]
    processes: int = 1
    concurrency: int = 4
    job_timeout_ms: int = 30_000
    shutdown_timeout_ms: int = 40_000
    max_attempts: int = 5
    db_pool_size: int | None = None
    memory: str = "512Mi"
    cpu: str = "250m"
    handler_memory: str | None = None
    min_replicas: int = 1
    max_replicas: int = 2
    backlog_age_target_s: int = 30
    uses: tuple[str, ...] = ()
    sandbox: bool = False
    stalled_after_s: int | None = None

    @property
    def effective_db_pool_size(self) -> int:
        """Connections per process: ``db_pool_size``, by default ``concurrency``."""
        return self.db_pool_size or self.concurrency

    @property
    def effective_stalled_after_s(self) -> int:
        """``stalled_after_s``, by default the job timeout (rounded up) plus 30 s."""
        if self.stalled_after_s is not None:
            return self.stalled_after_s
        return -(-self.job_timeout_ms // 1000) + 30

    @property
    def slug(self) -> str:
        """The pool name as a DNS label (``_`` becomes ``-``)."""
        return self.name.replace("_", "-")


@dataclass(frozen=True)
class BrokerSpec:
    """Where the Redis broker is and how pods reach it.

    Parameters:
      host: DNS name of the Redis service.
      port: Redis port (default 6379); the only port the sandbox may reach.
      db: Redis database index (default 0).
      tls: use ``rediss://`` (default False).
      password: the Redis password (a Pulumi secret); None for no password.
      namespace: namespace of the broker pods (for the sandbox's egress rule).
      pod_selector: labels of the broker pods (for the sandbox's egress rule).
    """

    host: str
    port: int = 6379
    db: int = 0
    tls: bool = False
    password: pulumi.Input[str] | None = None
    namespace: str = "redis"
    pod_selector: dict[str, str] = field(
        default_factory=lambda: {"app.kubernetes.io/name": "redis"}
    )

    @property
    def address(self) -> str:
        """``host:port`` as KEDA's redis scaler wants it."""
        return f"{self.host}:{self.port}"

    def url(self) -> pulumi.Output[str]:
        """``REDIS_URL`` with the password inside; a secret Output when there is a password."""
        scheme = "rediss" if self.tls else "redis"
        if self.password is None:
            return pulumi.Output.from_input(f"{scheme}://{self.address}/{self.db}")
        return pulumi.Output.secret(self.password).apply(
            lambda pw: f"{scheme}://:{pw}@{self.address}/{self.db}"
        )


@dataclass(frozen=True)
class ScalingSpec:
    """How KEDA scales every pool (stack-wide).

    Parameters:
      prometheus_server: Prometheus URL the age trigger queries.
      polling_interval_s: KEDA polling interval (default 15).
      cooldown_period_s: idle time before scaling to ``min_replicas`` when it is 0 (default 300).
      scale_down_window_s: HPA scale-down stabilization window (default 300).
      scale_down_pods: pods removed at most per period (default 1).
      scale_down_period_s: that period (default 60).
      fallback_failures: failed metric reads before the fallback applies (default 3).
    """

    prometheus_server: str = "http://prometheus-operated.monitoring.svc:9090"
    polling_interval_s: int = 15
    cooldown_period_s: int = 300
    scale_down_window_s: int = 300
    scale_down_pods: int = 1
    scale_down_period_s: int = 60
    fallback_failures: int = 3


@dataclass(frozen=True)
class SandboxSpec:
    """Stack options of the sandbox pool.

    Parameters:
      namespace: its namespace; None means ``<service namespace>-sandbox``.
      runtime_class: RuntimeClass name for its pods (e.g. ``"gvisor"``), None for the default.
      runtime_handler: when set, a RuntimeClass ``runtime_class`` with this handler
        (e.g. ``"runsc"``) is created too; leave None when the platform provides it.
      quota_pods, quota_cpu, quota_memory: ResourceQuota of the namespace; None derives
        them from the pool (max replicas, + 1 for a rollout surge).
      dns_namespace, dns_selector: where cluster DNS runs (default kube-system / k8s-app=kube-dns).
      broker_user, broker_password: the sandbox pool's own Redis ACL user (see
        :mod:`worker_infra.acl`): its pods and scaler log in as it, and the component
        exports the ACL rule to install on the broker. None: the shared credential.
    """

    namespace: str | None = None
    runtime_class: str | None = None
    runtime_handler: str | None = None
    quota_pods: int | None = None
    quota_cpu: str | None = None
    quota_memory: str | None = None
    dns_namespace: str = "kube-system"
    dns_selector: dict[str, str] = field(default_factory=lambda: {"k8s-app": "kube-dns"})
    broker_user: str | None = None
    broker_password: pulumi.Input[str] | None = None


@dataclass(frozen=True)
class ServiceSpec:
    """Everything a baked service's stack deploys.

    Parameters:
      project: the service (console script, label ``app.kubernetes.io/name``).
      image: full image reference including the tag.
      namespace: namespace of the ordinary pools.
      pools, downstream: from pools.toml after the stack's overrides.
      broker: the Redis broker.
      database_url: ``DATABASE_URL`` (a Pulumi secret), None without a database.
      scaling, sandbox: stack-wide scaling and sandbox options.
      grace_margin_s: seconds between the drain window and SIGKILL (default 15).
      memory_base: memory allowance per process besides its handlers (default ``"96Mi"``).
      metrics_port: port of /metrics, /livez, /readyz (default 9191).
      create_namespace: create and label the namespace (default True).
      env: extra plain environment variables for every pool.
      scheduler: the scheduler Deployment (:mod:`.scheduler`); None or no schedules: none.
      prometheus_rule: render the alert rules (:mod:`.alerts`) as a PrometheusRule of the
        Prometheus Operator (default True; False where its CRD is not installed).
    """

    project: str
    image: str
    namespace: str
    pools: tuple[PoolSpec, ...]
    broker: BrokerSpec
    downstream: tuple[DownstreamSpec, ...] = ()
    database_url: pulumi.Input[str] | None = None
    scaling: ScalingSpec = field(default_factory=ScalingSpec)
    sandbox: SandboxSpec = field(default_factory=SandboxSpec)
    grace_margin_s: int = 15
    memory_base: str = "96Mi"
    metrics_port: int = 9191
    create_namespace: bool = True
    env: dict[str, str] = field(default_factory=dict)
    scheduler: SchedulerSpec | None = None
    prometheus_rule: bool = True
