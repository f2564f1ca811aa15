"""Enqueue jobs from any process (an API, a script): only ``REDIS_URL`` is needed::

    from service.producer import cancel, enqueue

    message = enqueue("send_notification", 7, "welcome", "n-1")
    cancel(message.message_id)

Importing an actor works the same way (:mod:`worker_runtime.producer` says more).
"""

from __future__ import annotations

from worker_runtime.producer import cancel, enqueue

from . import actors
from .broker import broker

__all__ = ["actors", "broker", "cancel", "enqueue"]
