"""WorkerSettings: pool defaults, overrides and every cross-field rule, refused with exit 78."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

import templateservice
from worker_runtime import contract
from worker_runtime.exitcodes import EX_CONFIG
from worker_runtime.pools import SPARE_REDIS_CONNECTIONS, load_pools, redis_connections
from worker_runtime.redisclient import SentinelAddress, parse_sentinel_url
from worker_runtime.settings import WorkerSettings, config_errors, mask_url


@pytest.fixture(autouse=True)
def _database_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """A well-formed DATABASE_URL (never connected to): settings tests need no PostgreSQL."""
    monkeypatch.setenv("DATABASE_URL", "postgresql://app:secret@db.invalid:5432/app")


def settings_with(monkeypatch: pytest.MonkeyPatch, **env: str) -> WorkerSettings:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return WorkerSettings()  # type: ignore[call-arg]


def errors_of(monkeypatch: pytest.MonkeyPatch, **env: str) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        settings_with(monkeypatch, **env)
    return config_errors(caught.value)


def test_pool_supplies_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The values of pools.toml, whatever a team changed them to (queues added, shapes)."""
    pool = load_pools().pools["bulk"]
    settings = settings_with(monkeypatch, WORKER_POOL="bulk")
    assert settings.worker_queues == pool.queues
    assert (settings.worker_processes, settings.worker_concurrency) == (
        pool.processes,
        pool.concurrency,
    )
    assert settings.worker_job_timeout_ms < settings.worker_shutdown_timeout_ms


def test_prefetch_defaults_to_concurrency(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = load_pools().pools["bulk"]
    assert pool.prefetch is None, "this test needs a pool without an explicit prefetch"
    assert settings_with(monkeypatch, WORKER_POOL="bulk").prefetch == pool.concurrency
    prefetch = str(pool.concurrency + 4)
    raised = settings_with(monkeypatch, WORKER_POOL="bulk", WORKER_PREFETCH=prefetch)
    assert raised.prefetch == pool.concurrency + 4


def test_config_shows_the_values_in_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    """`config` prints what runs: an unset WORKER_PREFETCH shows the concurrency it defaults to."""
    concurrency = load_pools().pools["bulk"].concurrency
    shown = settings_with(monkeypatch, WORKER_POOL="bulk").masked()
    assert shown["WORKER_PREFETCH"] == concurrency
    prefetch = str(concurrency + 4)
    shown = settings_with(monkeypatch, WORKER_POOL="bulk", WORKER_PREFETCH=prefetch).masked()
    assert shown["WORKER_PREFETCH"] == concurrency + 4
    assert all(shown[key] is not None for key in shown if key.startswith("WORKER_"))


def test_derived_variables_follow_the_concurrency_in_effect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WORKER_PREFETCH and DB_POOL_SIZE default to the concurrency in effect, the
    environment's when it overrides the pool's (one rule, pools.derived_defaults)."""
    pool = load_pools().pools["interactive"]
    assert pool.prefetch is None and pool.db_pool_size is None, "needs a pool leaving both unset"
    raised = str(pool.concurrency * 2)
    settings = settings_with(monkeypatch, WORKER_POOL="interactive", WORKER_CONCURRENCY=raised)
    assert settings.prefetch == settings.worker_concurrency == pool.concurrency * 2
    if "db_pool_size" in WorkerSettings.model_fields:  # the database option
        shown = settings.masked()
        assert shown["DB_POOL_SIZE"] == shown["WORKER_PREFETCH"] == pool.concurrency * 2


def test_environment_overrides_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_with(monkeypatch, WORKER_POOL="interactive", WORKER_CONCURRENCY="3")
    assert settings.worker_concurrency == 3


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WORKER_POOL": "nope"}, "WORKER_POOL='nope': not a pool of pools.toml"),
        ({"WORKER_PROCESSES": "0"}, "WORKER_PROCESSES='0': Input should be greater than or"),
        ({"WORKER_QUEUES": "payments"}, "queue 'payments' belongs to pool 'critical'"),
        ({"WORKER_QUEUES": " , "}, "WORKER_QUEUES=' , ': must name at least one queue"),
        (
            {"WORKER_JOB_TIMEOUT_MS": "40000"},
            "WORKER_SHUTDOWN_TIMEOUT_MS=40000: must exceed WORKER_JOB_TIMEOUT_MS (40000)",
        ),
        ({"REDIS_URL": "redis://:pw@host:notaport/0"}, "REDIS_URL='redis://:***@host"),
        ({"REDIS_URL": "unix://"}, "REDIS_URL='unix://': unix:// URL needs a socket path"),
        (
            {"REDIS_URL": "redis+sentinel://s1:26379,s2:26379"},
            "REDIS_URL='redis+sentinel://s1:26379,s2:26379': needs the service name",
        ),
        (
            {"REDIS_URL": "redis+sentinel://:pw@s1:x/primary"},
            "REDIS_URL='redis+sentinel://:***@s1:x/primary': has a malformed port in 's1:x'",
        ),
        (
            {"REDIS_URL": "redis+sentinel://s1,,s2/primary"},
            "REDIS_URL='redis+sentinel://s1,,s2/primary': needs host:port of each Sentinel",
        ),
        (
            {"REDIS_URL": "redis+sentinel://s1/primary/zero"},
            "database must be a number, got 'zero'",
        ),
        (
            {"REDIS_URL": "redis+sentinel://s1/primary?password=pw"},
            "REDIS_URL='redis+sentinel://s1/primary?password=***': has an unknown option "
            "'password' (known: sentinel_password, sentinel_username)",
        ),
        ({"MAX_MESSAGE_BYTES": "10"}, "MAX_MESSAGE_BYTES='10': Input should be greater than"),
        ({"HEALTH_STALLED_AFTER_S": "-1"}, "HEALTH_STALLED_AFTER_S='-1'"),
        ({"WORKER_PREFETCH": "4"}, "WORKER_PREFETCH='4': must be at least WORKER_CONCURRENCY (8)"),
        ({"DB_POOL_SIZE": "2"}, "DB_POOL_SIZE='2': must be at least WORKER_CONCURRENCY (8)"),
        ({"DATABASE_URL": "mysql://db/app"}, "DATABASE_URL='mysql://db/app': must start with"),
        ({"DATABASE_URL": ""}, "DATABASE_URL='': must start with postgresql://"),
    ],
)
def test_rules(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str) -> None:
    lines = errors_of(monkeypatch, **{"WORKER_POOL": "interactive", **env})
    assert any(expected in line for line in lines), lines


def test_database_url_is_required_only_by_pools_that_use_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    lines = errors_of(monkeypatch, WORKER_POOL="critical")
    assert lines == ["DATABASE_URL=unset: required: pool 'critical' uses 'postgres'"]
    # The quick start's pools run with Redis alone (pools.toml: interactive uses nothing).
    for pool in ("interactive", "external"):
        assert not settings_with(monkeypatch, WORKER_POOL=pool).uses_database


def test_missing_pool_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKER_POOL", raising=False)
    assert errors_of(monkeypatch) == ["WORKER_POOL=unset: Field required"]


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_database(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = "redis+sentinel://app:s%40cret@10.0.0.1:26379,[::1]:26380,sentinel-c/orders/2"
    settings = settings_with(monkeypatch, WORKER_POOL="interactive", REDIS_URL=url)
    assert settings.masked()["REDIS_URL"] == (
        "redis+sentinel://app:***@10.0.0.1:26379,[::1]:26380,sentinel-c/orders/2"
    )
    assert parse_sentinel_url(url) == SentinelAddress(
        sentinels=(("10.0.0.1", 26379), ("::1", 26380), ("sentinel-c", 26379)),
        service="orders",
        db=2,
        username="app",
        password="s@cret",  # noqa: S106  (a test value)
    )
    assert parse_sentinel_url("redis+sentinel://s:1/orders").db == 0


def test_a_sentinel_url_carries_the_sentinels_own_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = "redis+sentinel://:node-pw@s1:26379,s2/orders?sentinel_password=s%26pw&sentinel_username=mon"
    settings = settings_with(monkeypatch, WORKER_POOL="interactive", REDIS_URL=url)
    masked = settings.masked()["REDIS_URL"]
    assert masked == (
        "redis+sentinel://:***@s1:26379,s2/orders?sentinel_password=***&sentinel_username=mon"
    )
    address = parse_sentinel_url(url)
    assert (address.password, address.sentinel_password, address.sentinel_username) == (
        "node-pw",
        "s&pw",
        "mon",
    )
    assert address.sentinel_kwargs(socket_timeout=1.0) == {
        "socket_timeout": 1.0,
        "password": "s&pw",
        "username": "mon",
    }
    assert parse_sentinel_url("redis+sentinel://s1/orders").sentinel_kwargs() == {}


def test_the_client_pool_is_sized_for_queues_and_threads() -> None:
    """redis-py caps a pool at 100 by default: 100 queues or 256 threads need more."""
    assert redis_connections(1, 8) == 2 + 16 + SPARE_REDIS_CONNECTIONS
    assert redis_connections(100, 4) > 200
    assert redis_connections(1, 256) > 2 * 256


def test_secrets_are_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_with(
        monkeypatch, WORKER_POOL="interactive", REDIS_URL="rediss://user:hunter2@redis:6380/0"
    )
    assert settings.masked()["REDIS_URL"] == "rediss://user:***@redis:6380/0"
    assert "hunter2" not in repr(settings)
    assert mask_url("redis://redis:6379/0") == "redis://redis:6379/0"


def test_refusal_is_exit_78_without_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service", "config"],
        env={
            "PYTHONPATH": templateservice.pythonpath(),
            "PATH": os.environ.get("PATH", ""),
            "WORKER_POOL": "interactive",
            "WORKER_CONCURRENCY": "x",
        },
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == EX_CONFIG
    assert "WORKER_CONCURRENCY='x'" in done.stderr
    assert "Traceback" not in done.stderr


def test_config_says_where_each_value_comes_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """`config` names each value's source: the environment, the pool, or the default; the
    environment wins over the pool, and a pool value left unset is the default's."""
    for key in list(os.environ):
        if key.startswith(("WORKER_", "METRICS_", "LOG_", "HEALTH_", "DB_")):
            monkeypatch.delenv(key)
    settings = settings_with(monkeypatch, WORKER_POOL="bulk", WORKER_CONCURRENCY="1")
    sources = settings.sources()
    assert set(sources) == set(settings.masked())
    assert sources["WORKER_POOL"] == sources["WORKER_CONCURRENCY"] == "environment"
    assert sources["WORKER_PROCESSES"] == sources["WORKER_JOB_TIMEOUT_MS"] == "pool bulk"
    assert sources["METRICS_PORT"] == sources["LOG_FORMAT"] == "default"
    done = subprocess.run(
        [sys.executable, "-m", "service", "config"],
        env={
            "PYTHONPATH": templateservice.pythonpath(),
            "PATH": os.environ.get("PATH", ""),
            "WORKER_POOL": "bulk",
            "WORKER_CONCURRENCY": "1",
            "DATABASE_URL": "postgresql://app:secret@db.invalid:5432/app",
        },
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}
    assert rows["WORKER_CONCURRENCY"] == ["1", "environment"]
    assert rows["WORKER_PROCESSES"][-2:] == ["pool", "bulk"]
    assert rows["METRICS_PORT"] == ["9191", "default"]
    assert "secret" not in done.stdout


def test_liveness_follows_the_pools_job_timeout_as_worker_infras_probes_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One rule for HEALTH_STALLED_AFTER_S left unset, here and in the pods worker_infra
    renders: the job timeout (rounded up) plus 30 s (contract.liveness_threshold_s). A bulk
    job of minutes that checkpoints nothing is live until its time limit, not after 60 s."""
    monkeypatch.delenv("HEALTH_STALLED_AFTER_S", raising=False)
    pool = load_pools().pools["bulk"]
    assert pool.job_timeout_ms > 60_000, "needs a pool whose jobs outlast 60 s"
    settings = settings_with(monkeypatch, WORKER_POOL="bulk")
    assert settings.health_stalled_after_s == pool.job_timeout_ms // 1000 + 30
    assert settings.health_stalled_after_s == contract.liveness_threshold_s(pool.job_timeout_ms)
    assert settings.sources()["HEALTH_STALLED_AFTER_S"] == "pool bulk"
    shorter = settings_with(monkeypatch, WORKER_POOL="bulk", WORKER_JOB_TIMEOUT_MS="90500")
    assert shorter.health_stalled_after_s == 91 + 30
    chosen = settings_with(monkeypatch, WORKER_POOL="bulk", HEALTH_STALLED_AFTER_S="45")
    assert chosen.health_stalled_after_s == 45
    assert chosen.sources()["HEALTH_STALLED_AFTER_S"] == "environment"
