"""MessageSize: a message bigger than ``MAX_MESSAGE_BYTES`` is refused when it is sent.

A message is a job's arguments, stored whole in Redis's memory (and copied to its
replicas) until the job ends, and read whole by the worker. A 200 MB argument was
accepted, and the producer peaked at 1.0 GB encoding it. This middleware measures the
message as Dramatiq's JSON encoder would write it, piece by piece, without writing it
(a string is measured in slices of :data:`SLICE_CHARS`), before the broker encodes it,
and raises :class:`MessageTooLargeError` (one line naming the actor and the size) instead.
The worker dead-letters a bigger body that was sent past it (bare Dramatiq, raw Redis)
without running it (:mod:`..consumer`).
"""

from __future__ import annotations

import json
from typing import Any

import dramatiq
from dramatiq import Broker, Message, Middleware
from dramatiq.encoder import JSONEncoder
from dramatiq.middleware import MiddlewareError

#: Characters of a string encoded at a time to measure it (a bounded copy, 4 MB at most).
SLICE_CHARS = 1 << 20


class MessageTooLargeError(MiddlewareError, ValueError):
    """A message bigger than ``MAX_MESSAGE_BYTES``; raised by ``send`` and ``enqueue``.

    Parameters:
      actor: the actor's name.
      size: the message's encoded size, in bytes.
      limit: ``MAX_MESSAGE_BYTES``.
    """

    def __init__(self, actor: str, size: int, limit: int) -> None:
        super().__init__(
            f"message for actor {actor!r} is {size:,} bytes, over MAX_MESSAGE_BYTES "
            f"({limit:,}): pass a reference to the data (a key, a URL), not the data"
        )
        self.actor, self.size, self.limit = actor, size, limit


def json_size(value: Any) -> int:
    """``len(json.dumps(value, separators=(",", ":")))``, Dramatiq's encoding (ASCII, so
    also its length in bytes), computed without building the whole text. Raises what
    ``json.dumps`` raises for a value it cannot encode."""
    if isinstance(value, str):
        if len(value) <= SLICE_CHARS:
            return len(json.dumps(value))
        return 2 + sum(
            len(json.dumps(value[start : start + SLICE_CHARS])) - 2
            for start in range(0, len(value), SLICE_CHARS)
        )
    if isinstance(value, dict):
        items = sum(
            json_size(key if isinstance(key, str) else json.dumps(key)) + 1 + json_size(item)
            for key, item in value.items()
        )
        return 2 + max(len(value) - 1, 0) + items
    if isinstance(value, list | tuple):
        return 2 + max(len(value) - 1, 0) + sum(json_size(item) for item in value)
    return len(json.dumps(value))


def encoded_size(message: Message[Any]) -> int:
    """The size in bytes of ``message.encode()``, measured without encoding it when the
    encoder is Dramatiq's JSON one (else encoded once)."""
    encoder = dramatiq.get_encoder()
    if type(encoder) is JSONEncoder:
        return json_size(message.asdict())
    return len(encoder.encode(message.asdict()))


class MessageSize(Middleware):
    """Refuse to enqueue a message bigger than ``max_bytes``.

    Parameters:
      max_bytes: ``MAX_MESSAGE_BYTES`` (default 10 MiB, see :mod:`..settings`).

    Last in the stack: it measures the message as the other middleware left it.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        size = encoded_size(message)
        if size > self.max_bytes:
            raise MessageTooLargeError(message.actor_name, size, self.max_bytes)
