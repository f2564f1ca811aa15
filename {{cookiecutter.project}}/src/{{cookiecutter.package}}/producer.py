"""Enqueue jobs from any process (an API, a script): only ``REDIS_URL`` is needed.

Importing an actor works the same way; neither needs worker settings such as
``WORKER_POOL`` (:mod:`.broker` builds a producer's broker when it is unset)::

    from {{ cookiecutter.package }}.actors.notifications import send_notification

    send_notification.send(7, "welcome", "n-1")

or, by actor name, without importing the actor's module yourself::

    from {{ cookiecutter.package }}.producer import enqueue

    enqueue("send_notification", 7, "welcome", "n-1")
    enqueue("capture_payment", "pay-1", 1000, delay_ms=60_000)   # in a minute

A bad ``REDIS_URL`` refuses with one line (exit 78); an unreachable Redis raises
``redis.ConnectionError`` from ``enqueue``/``send``, a full one (``maxmemory`` reached)
:class:`.brokerstate.BrokerFull` (a ``redis.ResponseError``, one line naming the actor),
for the caller to handle.
"""

from __future__ import annotations

from typing import Any

from dramatiq import Message

from . import actors
from .broker import broker

__all__ = ["actors", "broker", "enqueue"]


def enqueue(
    actor_name: str, *args: Any, delay_ms: int | None = None, **kwargs: Any
) -> Message[Any]:
    """Send a message to the actor ``actor_name`` (on its queue); return the message sent.

    Parameters:
      actor_name: an actor of this service, e.g. ``"send_notification"``.
      args, kwargs: the actor's arguments (JSON-serialisable).
      delay_ms: run it no earlier than this many milliseconds from now (default: at once).

    Raises:
      dramatiq.errors.ActorNotFound: no actor has that name.
    """
    actor = broker.get_actor(actor_name)
    message: Message[Any] = actor.send_with_options(args=args, kwargs=kwargs, delay=delay_ms)
    return message
