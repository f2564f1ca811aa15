"""Shared specs for the component tests (rendered through Pulumi's mocks)."""

from __future__ import annotations

import pytest
from poolmodel import POOL_ENV, TIMING, pools_file

from worker_infra import BrokerSpec, SandboxSpec, ServiceSpec

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


@pytest.fixture
def service() -> ServiceSpec:
    """A service shaped like the template's default pools.toml."""
    pools, resources, text = pools_file(SERVICE_POOLS)
    return ServiceSpec(
        project="orders-worker",
        image="registry.example.com/orders-worker:1.0.0",
        namespace="orders-worker",
        pools=pools,
        downstream=resources,
        broker=BrokerSpec(host="redis-master.redis", password="s3cret"),
        pools_file=text,
        pool_env=POOL_ENV,
        timing=TIMING,
        database_url="postgresql://app:pw@db/app",
        sandbox=SandboxSpec(runtime_class="gvisor", runtime_handler="runsc"),
        version="1.0.0",
    )
