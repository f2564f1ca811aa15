"""Critical pool: a payment captured once, guarded by an idempotency key."""

from __future__ import annotations

import logging

from pydantic import Field
from worker_runtime.idempotency import once_with_lease
from worker_runtime.typed import JobArguments, actor

logger = logging.getLogger(__name__)

#: The stand-in provider declines a capture above this amount (a card's limit).
CARD_LIMIT_CENTS = 1_000_000


class PaymentDeclinedError(Exception):
    """The provider refused the capture for good (a declined card): retrying cannot help."""


class PaymentCapture(JobArguments):
    """The arguments of :func:`capture_payment` (schema version 1)."""

    #: The idempotency key: a send without one is refused.
    payment_id: str = Field(min_length=1, max_length=200)
    amount_cents: int = Field(gt=0)


@actor(queue_name="payments", max_retries=2, throws=(PaymentDeclinedError,))
def capture_payment(job: PaymentCapture) -> None:
    """Capture ``job.amount_cents`` for ``job.payment_id`` unless this payment was already
    captured.

    The provider receives the key too: if the worker dies after the capture and before the
    key is marked done, the next delivery captures again and the provider de-duplicates it.
    A :class:`PaymentDeclinedError` is listed in ``throws``: the message is dead-lettered at once
    (outcome ``failure``), never retried; any other error is retried with backoff.
    """
    key = f"payment:{job.payment_id}"
    once_with_lease(key, lambda tx: _capture(job.payment_id, job.amount_cents, key))


def _capture(payment_id: str, amount_cents: int, key: str) -> None:
    """Stands in for ``provider.capture(payment_id, amount_cents, idempotency_key=key)``."""
    if amount_cents > CARD_LIMIT_CENTS:
        raise PaymentDeclinedError(f"{payment_id}: {amount_cents} cents is over the card's limit")
    logger.info(
        "payment captured", extra={"payment_id": payment_id, "amount": amount_cents, "key": key}
    )
