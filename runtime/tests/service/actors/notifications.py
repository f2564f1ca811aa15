"""Interactive pool: seconds-long, high-volume jobs, safe to deliver twice."""

from __future__ import annotations

import logging

from pydantic import Field

from worker_runtime.idempotency import once_with_lease
from worker_runtime.typed import JobArguments, actor

logger = logging.getLogger(__name__)


class Notification(JobArguments):
    """The arguments of :func:`send_notification` (schema version 1)."""

    user_id: int = Field(gt=0)
    template: str = Field(min_length=1)
    #: The idempotency key: a send without one, or with ``None``, is refused.
    notification_id: str = Field(min_length=1, max_length=200)


@actor(queue_name="notifications", max_retries=4)
def send_notification(job: Notification) -> None:
    """Send ``job.template`` to ``job.user_id`` once per ``job.notification_id``, however
    often delivered.

    The key is marked done only after the send: a worker killed before that sends again on
    the next delivery (pass ``key`` to the e-mail provider as its idempotency key), but a
    notification is never lost.
    """
    key = f"notification:{job.notification_id}"
    once_with_lease(key, lambda tx: _send(job.user_id, job.template, key))


def _send(user_id: int, template: str, key: str) -> None:
    """Stands in for the provider call (``provider.send(..., idempotency_key=key)``)."""
    logger.info("notification sent", extra={"user_id": user_id, "template": template, "key": key})
