"""Interactive pool: seconds-long, high-volume jobs, safe to deliver twice."""

from __future__ import annotations

import logging

import dramatiq

from ..idempotency import once_with_lease

logger = logging.getLogger(__name__)


@dramatiq.actor(queue_name="notifications", max_retries=4)
def send_notification(user_id: int, template: str, notification_id: str) -> None:
    """Send ``template`` to ``user_id`` once per ``notification_id``, however often delivered.

    The key is marked done only after the send: a worker killed before that sends again on
    the next delivery (pass ``key`` to the e-mail provider as its idempotency key), but a
    notification is never lost.
    """
    key = f"notification:{notification_id}"
    once_with_lease(key, lambda tx: _send(user_id, template, key))


def _send(user_id: int, template: str, key: str) -> None:
    """Stands in for the provider call (``provider.send(..., idempotency_key=key)``)."""
    logger.info("notification sent", extra={"user_id": user_id, "template": template, "key": key})
