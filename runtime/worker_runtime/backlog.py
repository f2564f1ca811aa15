"""The backlog of queues: depth, age of the next message in line, delayed, dead letters.

Read from Redis by one Lua call (:data:`.layout.BACKLOG`: constant work per queue however
many messages wait) and judged by Redis's clock. The exporter publishes it as gauges
(:class:`.exporter.BacklogCollector`); ``status`` and the console show it. This module
imports neither prometheus-client nor the settings: the commands that read it stay fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import layout

if TYPE_CHECKING:
    import redis

#: How many ids at the head of a list are tried when a head id has no body (a race with an ack).
HEAD_PROBE = 3


@dataclass(frozen=True)
class Backlog:
    """One queue's backlog at one instant."""

    queue: str
    depth: int
    oldest_s: float
    delayed: int
    delayed_overdue_s: float
    dead_letters: int


def _number(value: Any) -> float | None:
    """``value`` as a number of the message's fields, None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _age_s(now_ms: float, since_ms: Any) -> float:
    """Seconds from ``since_ms`` (epoch ms) to ``now_ms``; 0 when unknown or in the future."""
    since = _number(since_ms)
    if since is None:
        return 0.0
    return max(0.0, (now_ms - since) / 1000)


def due_ms(fields: dict[str, Any]) -> float | None:
    """When a message became due (epoch ms): its ``eta`` (a delay, a retry's backoff) when
    it has one and it is later than its sending, else ``message_timestamp``. A delayed
    message keeps its first ``message_timestamp`` through retries: counting from it, a
    message sent with a 25 s delay would read 25 s old the instant it is due."""
    sent = _number(fields.get("message_timestamp"))
    options = fields.get("options")
    eta = _number(options.get("eta")) if isinstance(options, dict) else None
    if eta is not None and (sent is None or eta > sent):
        return eta
    return sent


def read_backlog(
    client: redis.Redis,
    queues: Sequence[str],
    now: float | None = None,
) -> list[Backlog]:
    """The backlog of ``queues`` with a single Lua call (constant work per queue), its ages
    judged at ``now`` (epoch s; default: Redis's clock, ``TIME``, the clock every ``eta`` and
    ``message_timestamp`` the worker writes is on: a host whose clock is off reports the
    right ages)."""
    now_ms = (layout.redis_now(client) if now is None else now) * 1000
    found = []
    records = layout.read_backlog_records(client, queues, HEAD_PROBE)
    for queue, record in zip(queues, records, strict=True):
        heads = [record[field] for field in layout.LANE_HEADS]
        found.append(
            Backlog(
                queue=queue,
                depth=int(record["depth"]),
                oldest_s=max(_age_s(now_ms, due_ms(_fields(head))) for head in heads),
                delayed=int(record["delayed"]),
                delayed_overdue_s=_overdue_s(now_ms, record),
                dead_letters=int(record["dead_letters"]),
            )
        )
    return found


def _fields(body: Any) -> dict[str, Any]:
    return layout.message_fields(body) or {}


def _overdue_s(now_ms: float, record: dict[str, Any]) -> float:
    """How long the next due delayed message has been due: the earliest of the due set
    (:func:`.layout.due_key`, ordered by due time), or the head of the delay list when no
    worker has moved it into the due set yet (0: none due)."""
    options = (layout.message_fields(record["delayed_head"]) or {}).get("options")
    listed = _age_s(now_ms, options.get("eta")) if isinstance(options, dict) else 0.0
    next_due = record["next_due"]
    ordered = _age_s(now_ms, float(next_due)) if next_due is not None else 0.0
    return max(listed, ordered)
