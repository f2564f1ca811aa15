"""Fixtures for the template's tests: baked projects and a real Redis per test session."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from bakery import RedisServer, bake_project


@pytest.fixture(scope="session")
def bake(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``bake(**context)`` bakes once per distinct context in this session and returns the dir."""
    cache: dict[str, Path] = {}

    def _bake(**context: str) -> Path:
        key = json.dumps(context, sort_keys=True)
        if key not in cache:
            cache[key] = bake_project(tmp_path_factory.mktemp("bake"), **context)
        return cache[key]

    return _bake


@pytest.fixture(scope="session")
def default_project(bake: Callable[..., Path]) -> Path:
    """The template baked with its defaults (orders-worker, postgres, sandbox pool)."""
    return bake()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's redis-server (restarted if a test stopped it), emptied for this test."""
    import redis

    if redis_server.process is None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
