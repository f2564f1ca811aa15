"""Interactive pool: seconds-long, high-volume jobs, safe to deliver twice."""

from __future__ import annotations

import logging

import dramatiq

from ..idempotency import claim

logger = logging.getLogger(__name__)


@dramatiq.actor(queue_name="notifications", max_retries=4)
def send_notification(user_id: int, template: str, notification_id: str) -> None:
    """Send ``template`` to ``user_id`` once per ``notification_id``, however often delivered."""
    if not claim(f"notification:{notification_id}"):
        return
    logger.info("notification sent", extra={"user_id": user_id, "template": template})
