"""worker_infra: Pulumi components that deploy a worker-template service as isolated pools.

- :class:`WorkerService`: every pool of a service, after every guard passed.
- :class:`WorkerPool`: Deployment, token-less ServiceAccount, PodDisruptionBudget.
- :class:`BacklogScaler`: KEDA ScaledObject on backlog load and age (+ TriggerAuthentication).
- :class:`SandboxPool`: a WorkerPool in its own locked-down namespace.
- :class:`SchedulerDeployment`: the leader-elected replicas of ``<project> scheduler``.
- :mod:`.workload`: the restricted Deployment, ServiceAccount and PodDisruptionBudget
  both of them run (pod security, probes, mounts, checkov skips).
- :mod:`.capacity`, :mod:`.guards`: the pure arithmetic of the guards.
- :mod:`.poolsfile`: the stack-merged pools file the pods mount.
- :mod:`.cluster`: the stack's explicit Kubernetes provider.
- :mod:`.rollout`: how long Pulumi waits for each Deployment's rollout (pure).
- :mod:`.preflight`: the cluster's prerequisites, one line per missing step.
- :mod:`.render`: offline rendering through Pulumi's mocks.
- :mod:`.simulate`: the rendered scalers against a queue model.
- :mod:`.secrets`: every Secret: its name, its keys, the variables that read them, its builder.
- :mod:`.keys`: the Redis names the infrastructure reads (ready lists, the delay suffix,
  the broker namespaces), from the runtime's ``worker_runtime.layout.keys``.

worker-infra depends on worker-runtime (the same version) and imports the contract across
the boundary from it, through three modules only (import-linter, infra/pyproject.toml):
``worker_runtime.contract`` (metric names, the pool series label, outcomes, the metrics
port, the uid, the memory base, the leader TTL's default and bounds, the liveness rule, the
``per_process`` values), ``worker_runtime.pools`` (the pool model: fields, bounds, defaults,
the timing rule; worker_infra takes its validated objects, :meth:`PoolSpec.of`) and
``worker_runtime.layout.keys``. It restates none of them (``infra/tests/test_one_owner.py``).
"""

from . import preflight
from .args import (
    BrokerSpec,
    ClusterSpec,
    DownstreamSpec,
    PoolSpec,
    SandboxSpec,
    ScalingSpec,
    SchedulerSpec,
    ServiceSpec,
    Timing,
    TimingRule,
)
from .capacity import Share, Usage, capacity_report, capped_max_replicas, check_capacity
from .cluster import cluster_provider
from .errors import GuardError
from .guards import (
    check_env,
    check_isolation,
    check_memory,
    check_scheduler,
    check_timing,
    grace_period_s,
    memory_needed,
    plan,
)
from .pool import WorkerPool, WorkerPoolArgs
from .sandbox import SandboxPool, SandboxPoolArgs
from .scaler import BacklogScaler, BacklogScalerArgs
from .scheduler import SchedulerArgs, SchedulerDeployment
from .service import WorkerService

__all__ = [
    "BacklogScaler",
    "BacklogScalerArgs",
    "BrokerSpec",
    "ClusterSpec",
    "DownstreamSpec",
    "GuardError",
    "PoolSpec",
    "SandboxPool",
    "SandboxPoolArgs",
    "SandboxSpec",
    "ScalingSpec",
    "SchedulerArgs",
    "SchedulerDeployment",
    "SchedulerSpec",
    "ServiceSpec",
    "Share",
    "Timing",
    "TimingRule",
    "Usage",
    "WorkerPool",
    "WorkerPoolArgs",
    "WorkerService",
    "capacity_report",
    "capped_max_replicas",
    "check_capacity",
    "check_env",
    "check_isolation",
    "check_memory",
    "check_scheduler",
    "check_timing",
    "cluster_provider",
    "grace_period_s",
    "memory_needed",
    "plan",
    "preflight",
]
