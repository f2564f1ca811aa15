"""Shared specs for the component tests (rendered through Pulumi's mocks)."""

from __future__ import annotations

import pytest

from worker_infra import BrokerSpec, DownstreamSpec, PoolSpec, SandboxSpec, ServiceSpec


@pytest.fixture
def service() -> ServiceSpec:
    """A service shaped like the template's default pools.toml."""
    return ServiceSpec(
        project="orders-worker",
        image="registry.example.com/orders-worker:1.0.0",
        namespace="orders-worker",
        pools=(
            PoolSpec(
                "interactive",
                ("notifications",),
                1,
                8,
                30_000,
                40_000,
                memory="512Mi",
                handler_memory="32Mi",
                min_replicas=2,
                max_replicas=4,
                uses=("postgres",),
            ),
            PoolSpec(
                "bulk",
                ("reports",),
                2,
                2,
                300_000,
                330_000,
                memory="1Gi",
                cpu="1",
                handler_memory="192Mi",
                max_replicas=3,
                uses=("postgres",),
            ),
            PoolSpec(
                "external",
                ("partner",),
                1,
                4,
                60_000,
                70_000,
                memory="256Mi",
                max_replicas=5,
                uses=("partner_api",),
            ),
            PoolSpec(
                "sandbox",
                ("untrusted",),
                1,
                2,
                memory="1Gi",
                handler_memory="256Mi",
                max_replicas=4,
                sandbox=True,
            ),
        ),
        downstream=(
            DownstreamSpec("postgres", 100, 40),
            DownstreamSpec("partner_api", 40, 4, "concurrency"),
        ),
        broker=BrokerSpec(host="redis-master.redis", password="s3cret"),
        database_url="postgresql://app:pw@db/app",
        sandbox=SandboxSpec(runtime_class="gvisor", runtime_handler="runsc"),
    )
