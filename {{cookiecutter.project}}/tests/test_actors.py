"""The example actors, run by a real Dramatiq worker against a real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import dramatiq
import pytest


@pytest.fixture
def app(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The service's actors on a broker bound to the test Redis (built on first import)."""
    monkeypatch.setenv("WORKER_POOL", "external")  # a pool without the database
    monkeypatch.setenv("REDIS_URL", redis_url)
    from {{ cookiecutter.package }} import actors
    from {{ cookiecutter.package }}.broker import broker

    assert broker.client.ping()
    yield actors


def test_every_actor_queue_belongs_to_one_pool(app: ModuleType) -> None:
    from {{ cookiecutter.package }}.broker import broker
    from {{ cookiecutter.package }}.pools import load_pools

    pools = load_pools()
    assert {actor.queue_name for actor in broker.actors.values()} <= {
        queue for pool in pools.pools.values() for queue in pool.queues
    }


def test_notification_is_sent_once_per_id(app: ModuleType) -> None:
    from {{ cookiecutter.package }}.actors.notifications import send_notification
    from {{ cookiecutter.package }}.broker import broker

    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
    worker.start()
    try:
        for _ in range(3):
            send_notification.send(7, "welcome", "n-1")
        broker.join("notifications", timeout=10_000)
        worker.join()
    finally:
        worker.stop()
    assert broker.client.get("idempotency:notification:n-1") == b"done"


def test_payment_is_captured_once_and_rejects_bad_amounts(app: ModuleType) -> None:
    from {{ cookiecutter.package }}.actors.payments import capture_payment
    from {{ cookiecutter.package }}.idempotency import is_done

    capture_payment("p-1", 500)
    capture_payment(payment_id="p-1", amount_cents=500)
    assert is_done("payment:p-1")
    with pytest.raises(ValueError, match="capture_payment: invalid arguments: amount_cents: "):
        capture_payment("p-2", 0)
    with pytest.raises(ValueError, match="capture_payment: invalid arguments: payment_id: "):
        capture_payment.send(None, 500)


def test_a_declined_payment_is_listed_in_throws(app: ModuleType) -> None:
    from {{ cookiecutter.package }}.actors.payments import (
        CARD_LIMIT_CENTS,
        PaymentDeclinedError,
        capture_payment,
    )

    assert capture_payment.options["throws"] == (PaymentDeclinedError,)
    with pytest.raises(PaymentDeclinedError):
        capture_payment("p-3", CARD_LIMIT_CENTS + 1)


def test_report_checkpoints_and_stops_on_shutdown(
    app: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from {{ cookiecutter.package }} import lifecycle
    from {{ cookiecutter.package }}.actors.reports import build_report

    process = lifecycle.Lifecycle()
    monkeypatch.setattr(lifecycle, "LIFECYCLE", process)
    assert len(build_report("r-1", rows=50, chunk=10)) == 64
    process.request_shutdown()
    with pytest.raises(lifecycle.Requeue):
        build_report("r-2", rows=50, chunk=10)


def test_partner_calls_are_rate_limited(app: ModuleType) -> None:
    from {{ cookiecutter.package }}.actors.partner import limiter, sync_customer

    sync_customer(1)
    assert limiter().limit == 20
