"""The service's pool model (``worker_runtime.pools``) for worker_infra's tests.

worker_infra takes its pools from that model (:meth:`PoolSpec.of`), so the tests build
them the same way: every pool here passed the model's bounds and defaults.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from worker_infra import DownstreamSpec, PoolSpec, Timing

@functools.cache
def pools_module() -> ModuleType:
    """The pool model: worker_runtime's ``pools`` (the one the service and infra use)."""
    return importlib.import_module("worker_runtime.pools")


#: The variables a pool shapes, as the model names them.
POOL_ENV: frozenset[str] = frozenset(pools_module().pool_env_fields().values())
#: The service's timing rule and the supervisor's kill-after, as the infra program hands them.
TIMING = Timing(pools_module().timing_problems, pools_module().KILL_AFTER_DRAIN_S)


def pool(name: str, queues: Sequence[str] = ("q",), **fields: Any) -> PoolSpec:
    """A pool validated by the service's model, as worker_infra receives it."""
    model = pools_module().Pool(queues=list(queues), **fields)
    return PoolSpec.of(name, model)


def downstream(
    name: str, capacity: int, reserved: int = 0, per_process: str = "db_pool_size"
) -> DownstreamSpec:
    """A downstream resource validated by the service's model."""
    model = pools_module().Downstream(capacity=capacity, reserved=reserved, per_process=per_process)
    return DownstreamSpec.of(name, model)


def pools_file_text() -> str:
    """A small pools file, as the pods would mount it."""
    return '[pools.interactive]\nqueues = ["notifications", "emails"]\n'


def pools_file(
    data: dict[str, Any],
) -> tuple[tuple[PoolSpec, ...], tuple[DownstreamSpec, ...], str]:
    """Specs and TOML text of a whole pools file validated by the model (as the infra
    program hands them to worker_infra)."""
    import tomli_w

    model = pools_module().PoolsFile.model_validate(data)
    return (
        tuple(PoolSpec.of(n, p) for n, p in model.pools.items()),
        tuple(DownstreamSpec.of(n, d) for n, d in model.downstream.items()),
        tomli_w.dumps(model.model_dump(mode="json", exclude_none=True)),
    )


def pool_files(data: dict[str, Any]) -> dict[str, str]:
    """Pool -> the TOML text its pods read (the model's ``PoolsFile.for_pool``), as the
    infra program hands them to worker_infra (``ServiceSpec.pool_files``)."""
    import tomli_w

    model = pools_module().PoolsFile.model_validate(data)
    return {
        name: tomli_w.dumps(
            model.for_pool(name).model_dump(mode="json", exclude_none=True, exclude_unset=True)
        )
        for name in model.pools
    }


#: A pools file shaped like the template's default pools.toml (the ``service`` fixture's).
SERVICE_POOLS = {
    "downstream": {
        "postgres": {"capacity": 150, "reserved": 40},
        "partner_api": {"capacity": 60, "reserved": 4, "per_process": "concurrency"},
    },
    "pools": {
        "interactive": {
            "queues": ["notifications"],
            "concurrency": 8,
            "memory": "640Mi",
            "handler_memory": "32Mi",
            "min_replicas": 2,
            "max_replicas": 4,
            "uses": ["postgres"],
        },
        "bulk": {
            "queues": ["reports"],
            "processes": 2,
            "concurrency": 2,
            "job_timeout_ms": 300_000,
            "shutdown_timeout_ms": 330_000,
            "memory": "1280Mi",
            "cpu": "1",
            "handler_memory": "192Mi",
            "max_replicas": 3,
            "uses": ["postgres"],
        },
        "external": {
            "queues": ["partner"],
            "concurrency": 4,
            "job_timeout_ms": 60_000,
            "shutdown_timeout_ms": 70_000,
            "memory": "384Mi",
            "max_replicas": 5,
            "uses": ["partner_api"],
        },
        "sandbox": {
            "queues": ["untrusted"],
            "concurrency": 2,
            "memory": "1Gi",
            "handler_memory": "256Mi",
            "max_replicas": 4,
            "sandbox": True,
        },
    },
}
