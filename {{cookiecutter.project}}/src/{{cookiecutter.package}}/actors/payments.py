"""Critical pool: a payment captured once, guarded by an idempotency key."""

from __future__ import annotations

import logging

import dramatiq

from ..idempotency import once_with_lease

logger = logging.getLogger(__name__)


@dramatiq.actor(queue_name="payments", max_retries=2)
def capture_payment(payment_id: str, amount_cents: int) -> None:
    """Capture ``amount_cents`` for ``payment_id`` unless this payment was already captured.

    The provider receives the key too: if the worker dies after the capture and before the
    key is marked done, the next delivery captures again and the provider de-duplicates it.
    """
    if amount_cents <= 0:
        raise ValueError(f"amount_cents must be positive, got {amount_cents}")
    key = f"payment:{payment_id}"
    once_with_lease(key, lambda tx: _capture(payment_id, amount_cents, key))


def _capture(payment_id: str, amount_cents: int, key: str) -> None:
    """Stands in for ``provider.capture(payment_id, amount_cents, idempotency_key=key)``."""
    logger.info(
        "payment captured", extra={"payment_id": payment_id, "amount": amount_cents, "key": key}
    )
