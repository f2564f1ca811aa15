"""pools.toml: the shipped file is valid; malformed ones are refused naming file, key, problem."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import templateservice
from worker_runtime.pools import (
    Pool,
    PoolsFileError,
    load_pools,
    memory_bytes,
    pool_env_fields,
    reaches,
)

SHIPPED = templateservice.HOME / "pools.toml"


def test_shipped_pools_are_valid_and_disjoint() -> None:
    pools = load_pools(SHIPPED)
    queues = [queue for pool in pools.pools.values() for queue in pool.queues]
    assert len(queues) == len(set(queues))
    assert {"interactive", "bulk", "external", "critical"} <= set(pools.pools)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("pools = 3", "pools: Input should be a valid dictionary"),
        ("[pools.a]\nqueues = []", "pools.a.queues: List should have at least 1 item"),
        ("[pools.a]\nqueues = ['q']\nconcurency = 2", "pools.a.concurency: Extra inputs"),
        (
            "[pools.a]\nqueues = ['q']\njob_timeout_ms = 5000\nshutdown_timeout_ms = 4000",
            "job_timeout_ms (5000) must be below shutdown_timeout_ms (4000)",
        ),
        (
            "[pools.a]\nqueues = ['q']\n[pools.b]\nqueues = ['q']",
            "queue 'q' is served by pools 'a' and 'b'",
        ),
        ("[pools.a]\nqueues = ['q']\nuses = ['db']", "pool 'a' uses 'db', which is not"),
        ("[pools.a]\nqueues = ['q']\nmemory = 'lots'", "'lots' is not a Kubernetes quantity"),
        (
            "[downstream.db]\ncapacity = 10\nreserved = 10\n[pools.a]\nqueues = ['q']",
            "downstream.db: Value error, reserved (10) must be below capacity (10)",
        ),
        ("[pools.a\nqueues = ['q']", "not valid TOML"),
        (
            "[pools.a]\nqueues = ['q']\nconcurrency = 4\nprefetch = 2",
            "prefetch (2) is below concurrency (4)",
        ),
        (
            "[pools.a]\nqueues = ['q']\nconcurrency = 8\ndb_pool_size = 2",
            "db_pool_size (2) is below concurrency (8)",
        ),
        (
            "[downstream.db]\ncapacity = 10\n[pools.a]\nqueues = ['untrusted']\nsandbox = true\n"
            "uses = ['db']",
            "a sandbox pool uses no downstream resource",
        ),
        (
            "[pools.a]\nqueues = ['untrusted', 'q']\nsandbox = true",
            "a sandbox pool serves the queue 'untrusted' alone",
        ),
        ("[pools.a]\nqueues = ['untrusted']", "queue 'untrusted' runs untrusted code"),
        ("[pools.a]\nqueues = ['q']\nprocesses = 65", "pools.a.processes: Input should be less"),
    ],
)
def test_malformed_pools_are_refused(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "pools.toml"
    path.write_text(text)
    with pytest.raises(PoolsFileError) as caught:
        load_pools(path)
    assert str(path) in str(caught.value)
    assert problem in str(caught.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(PoolsFileError, match="cannot read"):
        load_pools(tmp_path / "absent.toml")


def test_memory_quantities() -> None:
    assert memory_bytes("512Mi") == 512 * 2**20
    assert memory_bytes("1G") == 10**9
    assert memory_bytes("1.5Gi") == int(1.5 * 2**30)


def test_every_pool_field_says_how_it_reaches_a_pod() -> None:
    fields = {name: reaches(name) for name in Pool.model_fields}
    assert set(fields.values()) <= {"worker", "infra"} | {
        f"env:{var}" for var in pool_env_fields().values()
    }
    assert pool_env_fields()["concurrency"] == "WORKER_CONCURRENCY"


def test_stack_overrides_are_validated_by_the_same_model(tmp_path: Path) -> None:
    path = tmp_path / "pools.toml"
    path.write_text(
        "[pools.a]\nqueues = ['q']\n[pools.s]\nqueues = ['untrusted']\nsandbox = true\n"
    )
    base = load_pools(path)
    merged = base.with_overrides({"pools": {"a": {"concurrency": 6}}}, "Pulumi.prod.yaml")
    assert merged.pools["a"].concurrency == 6 and merged.pools["a"].processes == 1
    cases: list[tuple[dict[str, Any], str]] = [
        ({"pools": {"a": {"concurrency": 999}}}, "Pulumi.prod.yaml: pools.a.concurrency"),
        ({"pools": {"b": {"concurrency": 2}}}, "pools.b: no such entry in pools.toml"),
        ({"pools": {"s": {"sandbox": False}}}, "cannot turn off the sandbox"),
        ({"pools": {"a": {"db_pool_size": 1, "concurrency": 4}}}, "db_pool_size (1) is below"),
    ]
    for overrides, problem in cases:
        with pytest.raises(PoolsFileError, match=re.escape(problem)):
            base.with_overrides(overrides, "Pulumi.prod.yaml")
