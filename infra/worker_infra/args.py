"""Typed arguments of the worker_infra components.

worker_infra never imports the baked service, and it does not model a pool either: the
runtime's pool model (``worker_runtime.pools``) is the one definition of a pool's fields,
bounds and defaults. The service's infra program merges the stack's overrides into pools.toml,
validates the result with that model and hands worker_infra the validated objects
(:meth:`PoolSpec.of` reads a ``Pool`` by its field names, :meth:`DownstreamSpec.of` a
``Downstream``)
together with the merged file's text, which the pods mount. The dataclasses below hold
only what the infrastructure reads, with no defaults of their own.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import pulumi
from worker_runtime import contract, pools

from .errors import GuardError

PerProcess = contract.PerProcess
MiB = contract.MiB
#: Defaults shared by the components' arguments, stated once here.
#: Seconds between a pod's drain window and its SIGKILL.
DEFAULT_GRACE_MARGIN_S = 15
#: Bytes per worker process besides its handlers (the memory guard).
DEFAULT_MEMORY_BASE = contract.MEMORY_BASE_PER_PROCESS
#: Port of /metrics, /livez and /readyz (the service's ``METRICS_PORT`` default).
DEFAULT_METRICS_PORT = contract.METRICS_PORT
#: UID and GID of every container (non-root; the image's user).
DEFAULT_RUN_AS_USER = contract.RUN_AS_USER
#: The sandbox container's CPU limit, in multiples of its request (untrusted code gets a
#: ceiling; twice the request leaves the probes and the supervisor room beside a busy job).
SANDBOX_CPU_LIMIT_FACTOR = 2


class TimingRule(Protocol):
    """The service's timing rule (its ``pools.timing_problems``): one line per broken leg of
    ``job timeout < drain window < drain window + kill-after < grace``, empty when it holds."""

    def __call__(
        self, job_timeout_ms: int, shutdown_timeout_ms: int, grace_s: float, kill_after_s: float
    ) -> list[str]: ...


@dataclass(frozen=True)
class Timing:
    """The timing rule and the supervisor's kill-after, handed from the service (its
    ``pools.timing_problems`` and ``pools.KILL_AFTER_DRAIN_S``) as its pool env is: the
    service owns both, worker_infra applies them to the grace period it derives.

    Parameters:
      rule: the service's timing rule.
      kill_after_drain_s: seconds past the drain window after which the supervisor kills a
        worker process that has not exited and recovers its messages.
    """

    rule: TimingRule
    kill_after_drain_s: float

    def problems(self, pool: PoolSpec, grace_s: int) -> list[str]:
        """The rule's complaints about ``pool`` under a grace period of ``grace_s``."""
        return self.rule(
            pool.job_timeout_ms, pool.shutdown_timeout_ms, grace_s, self.kill_after_drain_s
        )


class DownstreamModel(Protocol):
    """A ``[downstream.*]`` entry as the service's pool model validated it."""

    @property
    def capacity(self) -> int: ...
    @property
    def reserved(self) -> int: ...
    @property
    def per_process(self) -> PerProcess: ...


#: Pool fields whose default is another field's value ("defaults to concurrency"), as the
#: service's pool model declares them (``pools.derived_defaults()``; the template's
#: ``infra/tests/test_derived_defaults.py`` checks the two agree). :meth:`PoolSpec.of` reads
#: their value in effect from the model; :func:`derived_value` resolves them in a rendered
#: pools file (``simulate``), where an unset field is absent.
DERIVED_DEFAULTS = pools.derived_defaults()
#: PoolSpec fields the pool model holds under another name (what the pods get, after
#: the model's defaulting): ``effective_<field>`` of each derived field.
MODEL_ATTRIBUTE = {name: f"effective_{name}" for name in DERIVED_DEFAULTS}


def derived_value(pool: Mapping[str, Any], field: str) -> Any:
    """``pool[field]`` of a pools-file table, or, absent, the value of the field it defaults
    to (:data:`DERIVED_DEFAULTS`)."""
    if field in pool or field not in DERIVED_DEFAULTS:
        return pool[field]
    return pool[DERIVED_DEFAULTS[field]]


#: What :meth:`DownstreamSpec.of` reads of a ``Downstream``, in its fields' order.
DOWNSTREAM_FIELDS = ("capacity", "reserved", "per_process")


#: Where a bake pins the worker-infra it runs (the tag of worker-template it was baked from).
PIN = "infra/requirements.txt"


def dns_label(name: str) -> str:
    """``name`` (a pool's, a queue's) as a DNS label: ``_`` becomes ``-``. The service's
    ``pools.pool_slug`` labels the series of a pool the same way (the template's
    ``infra/tests/test_pool_slug.py`` checks the two agree)."""
    return name.replace("_", "-")


def model_value(model: object, what: str, attribute: str) -> Any:
    """``model.attribute``, read from the service's model; a model without it (a
    worker-infra newer than the service's template, the version skew) is refused in one
    line naming ``what``, the field and the pin, instead of an ``AttributeError``."""
    try:
        return getattr(model, attribute)
    except AttributeError:
        try:
            version = importlib.metadata.version("worker-infra")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        raise GuardError(
            f"{what}: the service's model has no field {attribute!r}, which worker-infra "
            f"{version} reads: the worker-infra pinned in {PIN} is newer than the template "
            "the service was baked from; pin the tag it was baked with, or update the service"
        ) from None


@dataclass(frozen=True)
class DownstreamSpec:
    """A resource the pools share (PostgreSQL connections, a partner's call limit).

    Parameters:
      name: the ``[downstream.<name>]`` key.
      capacity: what the resource can hold in total.
      reserved: held back for the API, admin and migrations.
      per_process: what one worker process holds of it: ``"db_pool_size"``
        (its DB connection pool) or ``"concurrency"`` (calls in flight).
    """

    name: str
    capacity: int
    reserved: int
    per_process: PerProcess

    @classmethod
    def of(cls, name: str, resource: DownstreamModel) -> DownstreamSpec:
        """The spec of a validated ``[downstream.<name>]`` entry."""
        what = f"downstream {name!r}"
        return cls(
            name,
            *(model_value(resource, what, attribute) for attribute in DOWNSTREAM_FIELDS),
        )

    @property
    def budget(self) -> int:
        """What the worker pools may use together: ``capacity - reserved``."""
        return self.capacity - self.reserved


@dataclass(frozen=True)
class PoolSpec:
    """What the infrastructure reads of one validated pool (after the stack's overrides).

    Built with :meth:`PoolSpec.of` from the service's pool model; the pool's other fields
    (max_attempts, ...) reach the pods only through the mounted pools file.

    Parameters:
      name: pool name (``WORKER_POOL``); also the Deployment's and scaler's name suffix.
      queues: Dramatiq queues it alone serves.
      processes, concurrency: processes per container, handler threads per process.
      prefetch: messages one process holds, running or waiting.
      job_timeout_ms, shutdown_timeout_ms: job limit and drain window.
      db_pool_size: DB connections per process.
      memory, memory_bytes: container memory limit (and request).
      cpu, cpu_millis: CPU request (no CPU limit: throttling stalls handlers).
      handler_memory, handler_memory_bytes: peak of one handler; None skips the memory guard.
      min_replicas, max_replicas: KEDA floor and ceiling.
      backlog_age_target_s: the oldest-message age KEDA holds the backlog under.
      uses: downstream resources the handlers hold.
      sandbox: the untrusted-code pool (own namespace, no egress but DNS + broker).
      critical: its pods get the service's PriorityClass (never starved by the others).
      broker_namespace: the prefix of its queues' Redis keys (the service's
        ``layout.namespace_of``: ``dramatiq-sandbox`` for the sandbox pool, else ``dramatiq``).
    """

    name: str
    queues: tuple[str, ...]
    processes: int
    concurrency: int
    prefetch: int
    job_timeout_ms: int
    shutdown_timeout_ms: int
    db_pool_size: int
    memory: str
    memory_bytes: int
    cpu: str
    cpu_millis: int
    handler_memory: str | None
    handler_memory_bytes: int | None
    min_replicas: int
    max_replicas: int
    backlog_age_target_s: int
    uses: tuple[str, ...]
    sandbox: bool
    critical: bool
    broker_namespace: str

    @classmethod
    def of(cls, name: str, pool: object) -> PoolSpec:
        """The spec of a validated ``[pools.<name>]`` entry (the service's ``Pool``): each
        field is the model's attribute of the same name (or :data:`MODEL_ATTRIBUTE`'s),
        sequences as tuples, so a pool field the infrastructure reads is declared here once."""
        values: dict[str, Any] = {}
        for spec_field in fields(cls):
            if spec_field.name != "name":
                attribute = MODEL_ATTRIBUTE.get(spec_field.name, spec_field.name)
                value = model_value(pool, f"pool {name!r}", attribute)
                values[spec_field.name] = tuple(value) if isinstance(value, list) else value
        return cls(name=name, **values)

    @property
    def stalled_after_s(self) -> int:
        """Liveness threshold: the runtime's rule (``contract.liveness_threshold_s``)."""
        return contract.liveness_threshold_s(self.job_timeout_ms)

    @property
    def slug(self) -> str:
        """The pool name as a DNS label (:func:`dns_label`)."""
        return dns_label(self.name)


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
      cidr: where the broker is when it runs outside the cluster (a managed Redis): an
        address or CIDR (``10.0.12.7``, ``10.0.12.0/28``); the sandbox's egress rule then
        admits that block on the broker port instead of ``namespace``/``pod_selector``.
        None (the default): the broker pods in the cluster.
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
    cidr: str | None = None

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
    """How KEDA scales every pool (stack-wide). The simulation (:mod:`.simulate`) reads
    these numbers from the rendered ScaledObjects, not from here.

    Parameters:
      prometheus_server: Prometheus URL the load and age triggers query.
      polling_interval_s: KEDA polling interval (default 15).
      cooldown_period_s: idle time before scaling to ``min_replicas`` when it is 0 (default 300).
      scale_up_window_s: HPA scale-up stabilization window (default 30: two syncs in a row
        must ask for more, so one noisy reading does not add a pod).
      scale_up_percent, scale_up_pods, scale_up_period_s: at most the larger of
        ``percent`` % and ``pods`` pods added per period (defaults 200, 8, 15).
      scale_down_window_s: HPA scale-down stabilization window (default 900: at most about
        two direction changes per hour under a steady, noisy load; see the simulation).
      scale_down_pods: pods removed at most per period (default 1).
      scale_down_period_s: that period (default 60); a pool holding downstream resources
        uses at least its grace period, so one removed pod is gone before the next goes.
      pod_monitor: create a PodMonitor per namespace (Prometheus Operator; default True).
      monitoring_namespace: namespace of Prometheus, the only one the sandbox admits to its
        metrics port (default ``monitoring``).
      scrape_interval_s: PodMonitor scrape interval (default 15).
      monitoring_labels: labels added to the PodMonitors and the PrometheusRule, for a
        Prometheus that selects them by label (kube-prometheus-stack: ``release: <its
        Helm release>``); default none.
    """

    prometheus_server: str = "http://prometheus-operated.monitoring.svc:9090"
    polling_interval_s: int = 15
    cooldown_period_s: int = 300
    scale_up_window_s: int = 30
    scale_up_percent: int = 200
    scale_up_pods: int = 8
    scale_up_period_s: int = 15
    scale_down_window_s: int = 900
    scale_down_pods: int = 1
    scale_down_period_s: int = 60
    pod_monitor: bool = True
    monitoring_namespace: str = "monitoring"
    scrape_interval_s: int = 15
    monitoring_labels: dict[str, str] = field(default_factory=dict)


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
      node_local_dns: the address of NodeLocal DNSCache on each node (usually
        ``169.254.20.10``) where the cluster runs it: the sandbox may also reach that
        address on port 53. None (the default): the DNS pods only.
      broker_user, broker_password: the sandbox pool's own Redis ACL user (see
        :mod:`worker_infra.acl`): its pods and scaler log in as it, and the component
        exports the ACL rule to install on the broker. None: the shared credential.
      broker_acl_installed: the broker's operator created that user (default False: the
        preflight stops ``pulumi preview`` with the command to run, see :mod:`.preflight`).
    """

    namespace: str | None = None
    runtime_class: str | None = None
    runtime_handler: str | None = None
    quota_pods: int | None = None
    quota_cpu: str | None = None
    quota_memory: str | None = None
    dns_namespace: str = "kube-system"
    dns_selector: dict[str, str] = field(default_factory=lambda: {"k8s-app": "kube-dns"})
    node_local_dns: str | None = None
    broker_user: str | None = None
    broker_password: pulumi.Input[str] | None = None
    broker_acl_installed: bool = False


@dataclass(frozen=True)
class ClusterSpec:
    """Which cluster a stack deploys to: an explicit Kubernetes provider, never by accident
    the kube context that happens to be current.

    Parameters:
      context: kubeconfig context of the stack's cluster.
      kubeconfig: path or contents of a kubeconfig; None means the default file.
      allow_ambient: accept the current context when ``context`` is None (default False;
        only for a developer's own cluster).
    """

    context: str | None = None
    kubeconfig: str | None = None
    allow_ambient: bool = False


@dataclass(frozen=True)
class SchedulerSpec:
    """The scheduler of a service (stack-wide; :class:`.scheduler.SchedulerDeployment`,
    checked by :func:`.guards.check_scheduler`).

    Parameters:
      schedules: names of the ``[schedules.*]`` tables (none: the scheduler only exports
        the pools' backlog).
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
    leader_ttl_ms: int = contract.SCHEDULER_LEADER_TTL_MS
    cpu: str = "50m"
    memory: str = "192Mi"
    stalled_after_s: int = 30
    grace_period_s: int = 30


@dataclass(frozen=True)
class ServiceSpec:
    """Everything a baked service's stack deploys.

    Parameters:
      project: the service (console script, label ``app.kubernetes.io/name``).
      image: full image reference including the tag.
      namespace: namespace of the ordinary pools.
      pools, downstream: the validated, stack-merged pools file's entries.
      broker: the Redis broker.
      pools_file: the pools file the scheduler's pods read at ``WORKER_POOLS_FILE`` (TOML:
        every pool's queues and the schedules; the baked program passes the service's
        ``PoolsFile.for_scheduler``); also a pool's file when ``pool_files`` lacks the pool
        (then it must hold that pool in full, e.g. the whole merged file).
      pool_files: pool name -> the file that pool's pods read (the service's
        ``PoolsFile.for_pool``: its entry in full, the other pools' queues), each in a
        ConfigMap of its own, so a change to one pool rolls that pool alone (default: none,
        every pool reads ``pools_file``).
      pool_env: the environment variables a pool shapes, as the service's pool model names
        them (``pools.pool_env_fields()``): the stack's ``env`` may not set them.
      timing: the service's timing rule and kill-after (:class:`Timing`).
      database_url: ``DATABASE_URL`` (a Pulumi secret), None without a database.
      scaling, sandbox: stack-wide scaling and sandbox options.
      grace_margin_s: seconds between the drain window and SIGKILL (default
        :data:`DEFAULT_GRACE_MARGIN_S`, 15); it must outlast the kill-after.
      memory_base: bytes per process besides its handlers (default 96 MiB).
      metrics_port: port of /metrics, /livez, /readyz (default 9191).
      create_namespace: create and label the namespaces (default True; False for
        namespaces the platform team pre-creates).
      instance, version: ``app.kubernetes.io/instance`` and ``/version`` labels (default:
        the project and ``"unversioned"``).
      env: extra plain environment variables for every pool (see :func:`.guards.check_env`).
      scheduler: the scheduler Deployment (:mod:`.scheduler`), rendered without schedules
        too (it exports every pool's backlog, seen at zero pods); None: none.
      prometheus_rule: render the alert rules (:mod:`.alerts`) as a PrometheusRule of the
        Prometheus Operator (default True; False where its CRD is not installed).
    """

    project: str
    image: str
    namespace: str
    pools: tuple[PoolSpec, ...]
    broker: BrokerSpec
    pools_file: str
    pool_env: frozenset[str]
    timing: Timing
    downstream: tuple[DownstreamSpec, ...] = ()
    database_url: pulumi.Input[str] | None = None
    scaling: ScalingSpec = field(default_factory=ScalingSpec)
    sandbox: SandboxSpec = field(default_factory=SandboxSpec)
    grace_margin_s: int = DEFAULT_GRACE_MARGIN_S
    memory_base: int = DEFAULT_MEMORY_BASE
    metrics_port: int = DEFAULT_METRICS_PORT
    create_namespace: bool = True
    instance: str | None = None
    version: str = "unversioned"
    env: dict[str, str] = field(default_factory=dict)
    scheduler: SchedulerSpec | None = None
    prometheus_rule: bool = True
    pool_files: Mapping[str, str] = field(default_factory=dict)

    def pool_file(self, pool: str) -> str:
        """The pools file the pods of ``pool`` read (:attr:`pool_files`, else ``pools_file``)."""
        return self.pool_files.get(pool, self.pools_file)
