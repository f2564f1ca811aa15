"""Shared specs for the component tests (rendered through Pulumi's mocks)."""

from __future__ import annotations

import pytest
from templatepools import POOL_ENV, SERVICE_POOLS, TIMING, pool_files, pools_file

from worker_infra import BrokerSpec, SandboxSpec, ServiceSpec


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
        pool_files=pool_files(SERVICE_POOLS),
        pool_env=POOL_ENV,
        timing=TIMING,
        database_url="postgresql://app:pw@db/app",
        sandbox=SandboxSpec(runtime_class="gvisor", runtime_handler="runsc"),
        version="1.0.0",
    )
