"""compose.yaml runs the pools of pools.toml: one worker service per pool, each stopped with
more grace than its drain window, probed with `healthcheck ready`; Redis (and PostgreSQL)
published on loopback only; pulled images pinned by digest; `docker compose watch`
rebuilds the workers on a source change."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from worker_runtime.pools import load_pools
from worker_runtime.timing import COMPOSE_GRACE_MARGIN_S, compose_grace_s

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "{{ cookiecutter.project }}"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return loaded


def workers(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = compose["services"]
    return {name: spec for name, spec in services.items() if name.startswith("worker-")}


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert match, f"unsupported duration {duration!r}"
    return int(match.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match.group(2)]


def test_one_worker_service_per_pool(compose: dict[str, Any]) -> None:
    pools = load_pools(ROOT / "pools.toml").pools
    assert set(workers(compose)) == {f"worker-{name}" for name in pools}, (
        "compose.yaml and pools.toml disagree: add or remove the pool's worker-<pool> service"
    )
    for name, service in workers(compose).items():
        assert service["environment"]["WORKER_POOL"] == name.removeprefix("worker-")


def test_each_worker_outlasts_its_drain_window(compose: dict[str, Any]) -> None:
    pools = load_pools(ROOT / "pools.toml").pools
    for name, service in workers(compose).items():
        pool = pools[name.removeprefix("worker-")]
        grace = seconds(service["stop_grace_period"])
        assert grace == compose_grace_s(pool.shutdown_timeout_ms), (
            f"{name}: stop_grace_period {service['stop_grace_period']} is not the pool's "
            f"shutdown_timeout_ms {pool.shutdown_timeout_ms} + {COMPOSE_GRACE_MARGIN_S} s "
            "(worker_runtime.timing.compose_grace_s): docker would SIGKILL mid-drain"
        )


def test_workers_are_probed_for_readiness_and_locked_down(compose: dict[str, Any]) -> None:
    for name, service in workers(compose).items():
        assert service["healthcheck"]["test"] == ["CMD", PROJECT, "healthcheck", "ready"], name
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"], name
        assert service["depends_on"]["redis"] == {"condition": "service_healthy"}, name
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond localhost"


def test_redis_and_the_database_are_published_on_loopback_only(compose: dict[str, Any]) -> None:
    """`make run` and `make dev` on the host reach compose's Redis (and PostgreSQL) on their
    usual ports; nothing is published beyond 127.0.0.1."""
    published = {
        name: spec["ports"] for name, spec in compose["services"].items() if spec.get("ports")
    }
    assert published["redis"] == ["127.0.0.1:6379:6379"], published
    if "postgres" in compose["services"]:
        assert published["postgres"] == ["127.0.0.1:5432:5432"], published
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond localhost"
    assert set(published) <= {"redis", "postgres", *workers(compose)}, published


def test_sandbox_workers_reach_only_the_broker(compose: dict[str, Any]) -> None:
    pools = load_pools(ROOT / "pools.toml").pools
    sandboxed = [f"worker-{name}" for name, pool in pools.items() if pool.sandbox]
    for name in sandboxed:
        service = workers(compose)[name]
        assert service["networks"] == ["broker"], name
        assert "DATABASE_URL" not in service["environment"], name
        assert "ports" not in service, name
    if sandboxed:
        assert compose["networks"]["broker"]["internal"] is True
        assert "broker" in compose["services"]["redis"]["networks"]


def test_pulled_images_are_pinned_by_digest(compose: dict[str, Any]) -> None:
    """Every image pulled (Redis{% if cookiecutter.database == "postgres" %}, PostgreSQL{% endif %}) names its tag and is pinned by digest: two
    `docker compose up` a week apart run the same bytes, until Dependabot proposes the tag's
    newer digest (.github/dependabot.yml, docker-compose)."""
    pulled = {
        name: spec["image"] for name, spec in compose["services"].items() if "build" not in spec
    }
    assert "redis" in pulled
    for name, image in pulled.items():
        assert re.fullmatch(r"[a-z0-9./-]+:[\w.-]+@sha256:[0-9a-f]{64}", image), (name, image)
    dependabot = yaml.safe_load((ROOT / ".github" / "dependabot.yml").read_text())
    assert any(
        update["package-ecosystem"] == "docker-compose" and update["directory"] == "/"
        for update in dependabot["updates"]
    ), dependabot


def test_compose_watch_rebuilds_every_worker_on_a_source_change(
    compose: dict[str, Any],
) -> None:
    """`docker compose watch`: a change under src/, of pools.toml or of pyproject.toml
    rebuilds the image of every worker and the scheduler (each then drains, like a deploy);
    each watched path exists, and the Dockerfile copies src/ after the locked dependencies'
    layer, so such a rebuild reinstalls the service only."""
    built = {name: spec for name, spec in compose["services"].items() if "build" in spec}
    assert set(workers(compose)) <= set(built) and "scheduler" in built
    for name, spec in built.items():
        rules = spec["develop"]["watch"]
        assert {(rule["path"], rule["action"]) for rule in rules} == {
            ("./src", "rebuild"),
            ("./pools.toml", "rebuild"),
            ("./pyproject.toml", "rebuild"),
        }, name
        assert all((ROOT / rule["path"]).exists() for rule in rules), name
    steps = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    lock = next(i for i, step in enumerate(steps) if "-r requirements.lock" in step)
    source = steps.index("COPY src ./src")
    assert steps[lock].startswith("RUN") and lock < source, steps
