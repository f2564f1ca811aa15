"""Critical pool: a payment captured at most once, guarded by an idempotency key."""

from __future__ import annotations

import logging

import dramatiq

from ..idempotency import already_done, mark_done

logger = logging.getLogger(__name__)


@dramatiq.actor(queue_name="payments", max_retries=2)
def capture_payment(payment_id: str, amount_cents: int) -> None:
    """Capture ``amount_cents`` for ``payment_id`` unless this payment was already captured."""
    if amount_cents <= 0:
        raise ValueError(f"amount_cents must be positive, got {amount_cents}")
    key = f"payment:{payment_id}"
    if already_done(key):
        return
    # A real capture passes `key` to the payment provider, which de-duplicates it too.
    logger.info("payment captured", extra={"payment_id": payment_id, "amount": amount_cents})
    mark_done(key)
