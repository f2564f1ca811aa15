"""worker_infra: Pulumi components that deploy a worker-template service as isolated pools.

- :class:`WorkerService`: every pool of a service, after every guard passed.
- :class:`WorkerPool`: Deployment, token-less ServiceAccount, PodDisruptionBudget.
- :class:`BacklogScaler`: KEDA ScaledObject on backlog depth and age (+ TriggerAuthentication).
- :class:`SandboxPool`: a WorkerPool in its own locked-down namespace.
- :class:`SchedulerDeployment`: the leader-elected replicas of ``<project> scheduler``.
- :mod:`.capacity`, :mod:`.guards`: the pure arithmetic of the guards.
- :mod:`.render`: offline rendering through Pulumi's mocks.
"""

from .args import BrokerSpec, DownstreamSpec, PoolSpec, SandboxSpec, ScalingSpec, ServiceSpec
from .capacity import Share, Usage, capacity_report, capped_max_replicas, check_capacity
from .errors import GuardError
from .guards import (
    check_isolation,
    check_memory,
    check_timing,
    grace_period_s,
    memory_bytes,
    memory_needed,
    plan,
)
from .pool import WorkerPool, WorkerPoolArgs
from .sandbox import SandboxPool, SandboxPoolArgs
from .scaler import BacklogScaler, BacklogScalerArgs
from .scheduler import SchedulerArgs, SchedulerDeployment, SchedulerSpec
from .service import WorkerService

__all__ = [
    "BacklogScaler",
    "BacklogScalerArgs",
    "BrokerSpec",
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
    "Usage",
    "WorkerPool",
    "WorkerPoolArgs",
    "WorkerService",
    "capacity_report",
    "capped_max_replicas",
    "check_capacity",
    "check_isolation",
    "check_memory",
    "check_timing",
    "grace_period_s",
    "memory_bytes",
    "memory_needed",
    "plan",
]
