"""The message schema: a stored body's fields and types, the option names the middleware
share, and what the dead letters keep of a body that is not a message.

Also the decoding of Redis replies (:func:`text`, :func:`raw_bytes`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

from .keys import canonical


def text(value: Any) -> str:
    """A Redis reply (bytes or str) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def raw_bytes(value: Any) -> bytes | None:
    """A Redis reply (bytes, str or None) as bytes, None kept."""
    return value.encode() if isinstance(value, str) else value


def message_fields(body: Any) -> dict[str, Any] | None:
    """A stored message body as a dict; None when it is missing, not JSON or not an object."""
    if not body:
        return None
    try:
        fields = json.loads(body)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None


#: The fields of a Dramatiq message and the JSON types each must have.
MESSAGE_FIELDS: Final[dict[str, tuple[tuple[type, ...], str]]] = {
    "queue_name": ((str,), "a string"),
    "actor_name": ((str,), "a string"),
    "args": ((list,), "a list"),
    "kwargs": ((dict,), "an object"),
    "options": ((dict,), "an object"),
    "message_id": ((str,), "a string"),
    "message_timestamp": ((int, float), "a number"),
}
#: Message options (the stored body's ``options``) that the middleware pass to each other;
#: the one place their names are spelled.
#: Dramatiq's RedisBroker: the id of the message in Redis (lists, hashes, acks sets).
REDIS_MESSAGE_ID: Final = "redis_message_id"
#: Dramatiq's Retries: failed attempts so far.
RETRIES: Final = "retries"
#: Recovery: deliveries lost to a dead worker process (counted against WORKER_MAX_ATTEMPTS).
CRASHES: Final = "crashes"
#: Ours: why a dead letter died (``dlq list`` shows it).
DEAD_LETTER_REASON: Final = "dead_letter_reason"
#: Ours: how often ``dlq replay`` sent this message again.
REPLAYS: Final = "replays"
#: Ours: the schema version of a typed actor's arguments (:mod:`..typed`).
SCHEMA_VERSION: Final = "schema_version"
#: Counters in a message's options that must be integers when present.
COUNTED_OPTIONS: Final = (RETRIES, CRASHES)


def crashes(options: dict[str, Any]) -> int:
    """Deliveries of a message lost to a dead worker process."""
    return int(options.get(CRASHES, 0))


def deliveries(options: dict[str, Any]) -> int:
    """Deliveries of a message that ended in a failure or a crash."""
    return int(options.get(RETRIES, 0)) + crashes(options)


def malformation(
    body: bytes, queue: str, parse: Callable[[bytes], Any] = json.loads
) -> tuple[str | None, Any]:
    """Why ``body``, fetched from ``queue``, is not a Dramatiq message it can run, or None.

    Returns (problem, parsed JSON or None). Checks the JSON object, each field and
    its type, the counters of its options, and that its ``queue_name`` is ``queue``
    (a message naming another queue would be acked on the wrong one). The Redis id
    and the actor are the caller's to check. ``parse`` reads the JSON (default
    ``json.loads``; it raises ``ValueError`` on a body that is not JSON).
    """
    try:
        fields = parse(body)
    except ValueError as error:
        return f"body is not JSON ({error})", None
    if not isinstance(fields, dict):
        return f"body is a JSON {_json_type(fields)}, must be an object", fields
    for name, (kinds, expected) in MESSAGE_FIELDS.items():
        if name not in fields:
            return f"no {name}", fields
        value = fields[name]
        if not isinstance(value, kinds) or isinstance(value, bool):
            return f"{name} is {_shown(value)}, must be {expected}", fields
    extra = sorted(set(fields) - set(MESSAGE_FIELDS))
    if extra:
        return f"unexpected fields {', '.join(extra)}", fields
    for counter in COUNTED_OPTIONS:
        value = fields["options"].get(counter, 0)
        if not isinstance(value, int) or isinstance(value, bool):
            return f"options.{counter} is {_shown(value)}, must be an integer", fields
    if fields["queue_name"] != queue:
        return f"queue_name {fields['queue_name']!r} is not its queue {queue!r}", fields
    return None, fields


def malformed_record(body: bytes, queue: str, reason: str, fields: Any) -> bytes:
    """What the dead letters keep of a body that is not a Dramatiq message: a record with
    the reason, whatever ``actor_name`` and ``message_id`` could be read, and the body as
    text in ``options.malformed_body``. ``dlq replay`` refuses it (not a message)."""
    known = fields if isinstance(fields, dict) else {}
    record = {
        "queue_name": canonical(queue),
        "actor_name": str(known.get("actor_name") or "-"),
        "message_id": str(known.get("message_id") or "-"),
        "options": {
            DEAD_LETTER_REASON: reason,
            "malformed_body": body.decode("utf-8", "backslashreplace"),
        },
    }
    return json.dumps(record).encode()


def _json_type(value: Any) -> str:
    names = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    return json.dumps(value)[:40]
