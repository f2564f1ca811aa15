"""The example actors, run by a real Dramatiq worker against a real Redis: the fixtures of
the runtime's pytest plugin (``worker_runtime.testing``: a private redis-server, ``jobs``)."""

from __future__ import annotations

import pytest
from worker_runtime.testing import Jobs


def test_notification_is_sent_once_per_id(jobs: Jobs) -> None:
    from {{ cookiecutter.package }}.actors.notifications import send_notification

    for _ in range(3):
        jobs.send(send_notification, 7, "welcome", "n-1")
    jobs.wait()
    assert jobs.client.get("idempotency:notification:n-1") == b"done"


def test_payment_is_captured_once_and_rejects_bad_amounts(jobs: Jobs) -> None:
    from worker_runtime.idempotency import is_done

    from {{ cookiecutter.package }}.actors.payments import capture_payment

    capture_payment("p-1", 500)
    capture_payment(payment_id="p-1", amount_cents=500)
    assert is_done("payment:p-1")
    with pytest.raises(ValueError, match="capture_payment: invalid arguments: amount_cents: "):
        capture_payment("p-2", 0)
    with pytest.raises(ValueError, match="capture_payment: invalid arguments: payment_id: "):
        capture_payment.send(None, 500)


def test_a_declined_payment_is_listed_in_throws(jobs: Jobs) -> None:
    from {{ cookiecutter.package }}.actors.payments import (
        CARD_LIMIT_CENTS,
        PaymentDeclinedError,
        capture_payment,
    )

    assert capture_payment.options["throws"] == (PaymentDeclinedError,)
    with pytest.raises(PaymentDeclinedError):
        capture_payment("p-3", CARD_LIMIT_CENTS + 1)


def test_report_checkpoints_and_stops_on_shutdown(
    jobs: Jobs, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker_runtime import lifecycle

    from {{ cookiecutter.package }}.actors.reports import build_report

    process = lifecycle.Lifecycle()
    monkeypatch.setattr(lifecycle, "LIFECYCLE", process)
    assert len(build_report("r-1", rows=50, chunk=10)) == 64
    process.request_shutdown()
    with pytest.raises(lifecycle.Requeue):
        build_report("r-2", rows=50, chunk=10)


def test_partner_limits_come_from_pools_toml_alone(jobs: Jobs) -> None:
    """The partner's budget and rate live in pools.toml, enforced at the fetch: the actor
    module holds no limit of its own (issue #42)."""
    from worker_runtime.pools import load_pools

    from {{ cookiecutter.package }}.actors import partner

    partner.sync_customer(1)
    resource = load_pools().downstream["partner_api"]
    assert resource.budget == 56 and resource.calls_per_s == 50
    assert not [name for name in vars(partner) if "LIMIT" in name or "CALLS" in name]
