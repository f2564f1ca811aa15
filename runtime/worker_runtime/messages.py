"""A fetched body, checked and decoded: what the consumer and recovery both read of a message.

A body is a Dramatiq message this worker can run only when it decodes to one with its
own Redis id and a declared actor (:func:`inspect`; the fields are :mod:`.layout`'s
schema, :func:`.layout.malformation`). What the dead letters keep of one that is not
is :func:`dead_letter_body`.
"""

from __future__ import annotations

import json
from collections.abc import Container
from typing import Any

import orjson
from dramatiq import Message

from . import layout


def inspect(
    body: bytes, queue: str, redis_id: str, actors: Container[str] | None
) -> tuple[str | None, Message[Any] | None, Any]:
    """Check a fetched body; return (problem, message, parsed JSON).

    ``problem`` is None when the body is a Dramatiq message this worker can run from
    ``queue`` under ``redis_id`` (see :func:`.layout.malformation`); then ``message`` is
    it. Otherwise ``message`` is set only when the body decodes (an unknown actor, a
    wrong or missing ``options.redis_message_id``).

    Parameters:
      actors: the declared actor names (None: not checked, e.g. in the supervisor).
    """
    problem, fields = layout.malformation(body, queue, parse=loads)
    if problem is not None:
        return problem, None, fields
    message: Message[Any] = Message(**{**fields, "args": tuple(fields["args"])})
    stored_id = message.options.get(layout.REDIS_MESSAGE_ID)
    if stored_id is None:
        return f"no options.{layout.REDIS_MESSAGE_ID}", message, fields
    if stored_id != redis_id:
        return (
            f"options.{layout.REDIS_MESSAGE_ID} {stored_id!r} is not its id {redis_id!r}",
            message,
            fields,
        )
    if actors is not None and message.actor_name not in actors:
        return f"unknown actor {message.actor_name!r} (none declared here)", message, fields
    return None, message, fields


def loads(body: bytes) -> Any:
    """``json.loads(body)``, parsed by orjson (each fetched body is parsed on the hot path);
    what orjson refuses and the standard library reads (``NaN``, integers beyond 64
    bits, as Dramatiq's own decoder accepts them) is read by the standard library."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)


def dead_letter_body(
    body: bytes, queue: str, reason: str, message: Message[Any] | None, fields: Any
) -> bytes:
    """What the dead letters keep of a malformed message: a message that decodes keeps its
    body with the reason in its options (a replay can send it once its actor exists); any
    other body is kept as :func:`.layout.malformed_record` (``dlq replay`` refuses it)."""
    if message is not None:
        return message.copy(options={layout.DEAD_LETTER_REASON: reason}).encode()
    return layout.malformed_record(body, queue, reason, fields)


def indexed_id(fields: Any) -> str:
    """The message id under which the message index (:func:`.layout.message_index_key`) may
    hold a stored message that is dead-lettered undecoded: its ``message_id`` field when
    that is a string, else '' (not known: a body that is not a JSON object keeps its entry,
    its redis id being another uuid). The index drops an entry only while it names that very
    copy, so a forged id removes nothing."""
    if isinstance(fields, dict) and isinstance(fields.get("message_id"), str):
        return str(fields["message_id"])
    return ""
