"""Dead letters: the store (the messages the worker gave up on, read in pages, found by id,
replayed, purged) that the ``dlq`` commands (:mod:`.cli`) and the console use.

Dead letters are kept where Dramatiq keeps them (see :mod:`..layout`): the zset
``dramatiq:<queue>.XQ`` maps each redis message id to the time it died (ms), the hash
``dramatiq:<queue>.XQ.msgs`` holds its body, a Dramatiq message with
``options.dead_letter_reason`` (ours) and ``options.traceback`` (Dramatiq's Retries) when
known. A replay is one Lua call per message (:mod:`.cli` says what it keeps). A dead letter
is found by its redis id or by the job id the logs print (:func:`find`); the summary counts
them by actor, exception type and normalised reason (:class:`Summary`, :func:`normalised`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import json
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import orjson

from .. import layout
from ..layout import dead_letter_keys

if TYPE_CHECKING:
    import redis
    from dramatiq import Message

#: Dead letters read per round trip (ids, times and bodies) by the commands that stream.
PAGE = 500
#: Distinct (queue, actor, reason) the summary counts one by one; beyond, "(other reasons)".
SUMMARY_KINDS = 10_000
#: Options a replay drops: they belong to the deliveries that failed.
STALE_OPTIONS = (layout.DEAD_LETTER_REASON, "traceback", "requeue_timestamp", "eta")


class DeadLetterError(Exception):
    """A request that cannot be served, e.g. an unknown id; the message says why."""


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """One dead letter.

    Parameters:
      queue: the queue it died on (a delay queue ``q.DQ`` counts as ``q``).
      redis_id: its id in the dead-letter zset, the id the commands take.
      died_ms: when it was dead-lettered, ms since the epoch.
      body: the stored bytes; None when the zset entry has no body.
      max_bytes: ``MAX_MESSAGE_BYTES``: a bigger body was dead-lettered unread by the worker,
        as it was sent, so its reason is its size (None: not checked).
    """

    queue: str
    redis_id: str
    died_ms: int
    body: bytes | None
    max_bytes: int | None = None

    @functools.cached_property
    def fields(self) -> dict[str, Any] | None:
        """The body as a dict, or None when it is missing or not JSON (parsed by orjson: a
        million are parsed by ``dlq list``; what orjson refuses, the standard library reads)."""
        if not self.body:
            return None
        try:
            fields = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return layout.message_fields(self.body)
        return fields if isinstance(fields, dict) else None

    @property
    def options(self) -> dict[str, Any]:
        options = (self.fields or {}).get("options")
        return options if isinstance(options, dict) else {}

    @property
    def message_id(self) -> str:
        return str((self.fields or {}).get("message_id", "-"))

    @property
    def actor(self) -> str:
        return str((self.fields or {}).get("actor_name", "-"))

    @property
    def died(self) -> str:
        """When it died, ISO 8601 in UTC to the second."""
        moment = datetime.fromtimestamp(self.died_ms / 1000, tz=UTC)
        return moment.isoformat(timespec="seconds").replace("+00:00", "Z")

    @property
    def reason(self) -> str:
        """Our dead-letter reason, else the traceback's last line, else a description."""
        if self.body is None:
            return "(body missing)"
        if self.max_bytes is not None and len(self.body) > self.max_bytes:
            return (
                f"message of {len(self.body):,} bytes is over MAX_MESSAGE_BYTES "
                f"({self.max_bytes:,})"
            )
        if self.fields is None:
            return "(body is not a Dramatiq message)"
        if reason := self.options.get(layout.DEAD_LETTER_REASON):
            return str(reason)
        lines = str(self.options.get("traceback") or "").strip().splitlines()
        return lines[-1] if lines else "-"

    def summary(self) -> dict[str, Any]:
        """The ``dlq list --json`` entry."""
        return {
            "queue": self.queue,
            "redis_id": self.redis_id,
            "message_id": self.message_id,
            "actor": self.actor,
            "dead_since": self.died,
            "dead_since_ms": self.died_ms,
            "reason": self.reason,
        }


def count(client: redis.Redis, queue: str) -> int:
    """How many dead letters ``queue`` holds."""
    return int(client.zcard(dead_letter_keys(queue)[0]))


def dead_letters(
    client: redis.Redis, queue: str, limit: int | None = None, max_bytes: int | None = None
) -> list[DeadLetter]:
    """The dead letters of ``queue``, oldest first (:func:`read_page` from rank 0).

    Parameters:
      limit: at most this many (default: all).
      max_bytes: ``MAX_MESSAGE_BYTES`` (see :attr:`DeadLetter.max_bytes`).
    """
    size = count(client, queue) if limit is None else limit
    return read_page(client, queue, 0, size, max_bytes) if size > 0 else []


def read_page(
    client: redis.Redis, queue: str, start: int, size: int, max_bytes: int | None = None
) -> list[DeadLetter]:
    """``size`` dead letters of ``queue`` from rank ``start`` (oldest first), in two round
    trips (the zset's entries, then their bodies); those replayed or purged between the two
    are left out."""
    zset, bodies = dead_letter_keys(queue)
    entries = cast(
        list[tuple[Any, float]], client.zrange(zset, start, start + size - 1, withscores=True)
    )
    if not entries:
        return []
    ids = [layout.text(raw_id) for raw_id, _ in entries]
    stored = client.hmget(bodies, ids)
    letters = [
        DeadLetter(queue, redis_id, int(score), layout.raw_bytes(body), max_bytes)
        for (redis_id, (_, score), body) in zip(ids, entries, stored, strict=True)
    ]
    return _still_dead(client, zset, letters)


def stream(
    client: redis.Redis, queue: str, max_bytes: int | None = None, page: int = PAGE
) -> Iterator[DeadLetter]:
    """Every dead letter of ``queue``, oldest first, read ``page`` at a time: constant
    memory however many. Paged by rank: a letter removed meanwhile may make it skip one."""
    start = 0
    while True:
        zset = dead_letter_keys(queue)[0]
        letters = read_page(client, queue, start, page, max_bytes)
        if not letters:
            if client.zcard(zset) <= start:
                return
            start += page  # the whole page was removed between the two reads
            continue
        yield from letters
        start += page


def stream_all(
    client: redis.Redis, queues: Iterable[str], max_bytes: int | None = None
) -> Iterator[DeadLetter]:
    """Every dead letter of ``queues``, oldest first across them (a merge of each queue's
    :func:`stream`): one page per queue in memory."""
    return heapq.merge(
        *(stream(client, queue, max_bytes) for queue in queues),
        key=lambda letter: (letter.died_ms, letter.queue, letter.redis_id),
    )


#: A reason's leading exception type (``ValueError: ...``, ``mod.Error: ...``).
_EXCEPTION = re.compile(
    r"^([A-Za-z_][\w.]*(?:Error|Exception|Exceeded|Interrupt|Exit|Warning|Timeout))(?::\s*|$)"
)
#: What :func:`normalised` masks, in order: quoted values, ids (a word holding a digit and a
#: letter: ``f1``, ``n-17``, a UUID), numbers (``2``, ``12,345``, ``10.0.0.3:6379``).
_MASKS = (
    (re.compile(r"'[^']*'|\"[^\"]*\""), lambda m: m.group(0)[0] + "…" + m.group(0)[0]),
    (re.compile(r"(?<![\w-])(?=[\w-]*[A-Za-z_])[\w-]*\d[\w-]*"), lambda m: "<id>"),
    (re.compile(r"(?<!\w)\d+(?:[.,_:]\d+)*(?!\w)"), lambda m: "<n>"),
)


def exception_of(reason: str) -> tuple[str, str]:
    """``(exception type, the rest)`` of a reason (``"-"`` and the reason when it does not
    start with one, as the worker's own reasons do)."""
    match = _EXCEPTION.match(reason)
    if match is None:
        return "-", reason
    return match.group(1), reason[match.end() :]


def normalised(reason: str) -> str:
    """``reason`` with what differs from job to job masked: quoted values (``'…'``), ids
    (``<id>``) and numbers (``<n>``), on one line."""
    text = " ".join(reason.split())
    for pattern, mask in _MASKS:
        text = pattern.sub(mask, text)
    return text


class Summary:
    """Dead letters counted by (queue, actor, exception type, normalised reason:
    :func:`normalised`), so the same failure of many jobs is one row, in bounded memory:
    past :data:`SUMMARY_KINDS` distinct kinds, the new ones count as "(other reasons)"."""

    OTHER = "(other reasons)"

    def __init__(self, kinds: int = SUMMARY_KINDS) -> None:
        self.kinds = kinds
        self.total = 0
        self.counts: collections.Counter[tuple[str, str, str, str]] = collections.Counter()

    def add(self, letter: DeadLetter) -> None:
        self.total += 1
        key = group_of(letter)
        if key not in self.counts and len(self.counts) >= self.kinds:
            key = (letter.queue, letter.actor, "-", self.OTHER)
        self.counts[key] += 1

    def rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The most frequent kinds first: ``{"count", "queue", "actor", "exception",
        "reason"}``."""
        return [
            {"count": n, "queue": queue, "actor": actor, "exception": exception, "reason": reason}
            for (queue, actor, exception, reason), n in self.counts.most_common(limit)
        ]


def group_of(letter: DeadLetter) -> tuple[str, str, str, str]:
    """The summary's kind of ``letter``: (queue, actor, exception type, normalised reason)."""
    exception, rest = exception_of(" ".join(letter.reason.split()))
    return (letter.queue, letter.actor, exception, normalised(rest)[:200])


def replay_group(
    client: redis.Redis,
    group: tuple[str, str, str, str],
    max_bytes: int | None = None,
    now_ms: int | None = None,
) -> tuple[int, list[str]]:
    """Replay every dead letter of ``group`` (:func:`group_of`); (how many moved, one line
    per letter skipped)."""
    queue = group[0]
    return replay_where(client, queue, lambda letter: group_of(letter) == group, max_bytes, now_ms)


def matches(letter: DeadLetter, sought: str) -> bool:
    """Whether ``letter``'s actor, reason, job id or redis id holds ``sought`` (any case):
    the console's filter."""
    return holds(sought, letter.actor, letter.reason, letter.message_id, letter.redis_id)


def holds(sought: str, *texts: str) -> bool:
    """Whether one of ``texts`` holds ``sought`` (any case): the console's filters (a dead
    letter's :func:`matches`, a waiting job's actor and ids)."""
    return sought.casefold() in "\n".join(texts).casefold()


def replay_where(
    client: redis.Redis,
    queue: str,
    chosen: Callable[[DeadLetter], bool],
    max_bytes: int | None = None,
    now_ms: int | None = None,
) -> tuple[int, list[str]]:
    """Replay every dead letter of ``queue`` that ``chosen`` keeps, a page at a time, each
    page read again past what stays (the others, those that cannot run); (how many moved,
    one line per letter skipped)."""
    moved, left = 0, 0
    skipped: list[str] = []
    while page := read_page(client, queue, left, PAGE, max_bytes):
        kept = [letter for letter in page if chosen(letter)]
        done, problems = replay_page(client, queue, kept, now_ms) if kept else (0, [])
        moved, skipped = moved + done, skipped + problems
        left += len(page) - len(kept) + len(problems)
    return moved, skipped


def purge_where(
    client: redis.Redis,
    queue: str,
    chosen: Callable[[DeadLetter], bool],
    max_bytes: int | None = None,
) -> int:
    """Delete every dead letter of ``queue`` that ``chosen`` keeps, a page at a time, each
    page read again past what stays; how many were deleted."""
    purged, left = 0, 0
    while page := read_page(client, queue, left, PAGE, max_bytes):
        kept = [letter.redis_id for letter in page if chosen(letter)]
        purged += layout.purge_dead_letters(client, queue, kept) if kept else 0
        left += len(page) - len(kept)
    return purged


def arguments_text(fields: dict[str, Any] | None, width: int = 80) -> str:
    """A message's arguments on one line: its positional ``args`` (JSON) and its keyword
    ones as ``name=value`` (a typed actor's model fields are keyword arguments), cut at
    ``width``; ``-`` when it has none or is not readable."""
    if not fields:
        return "-"
    args, kwargs = fields.get("args"), fields.get("kwargs")
    parts = [json.dumps(arg) for arg in args] if isinstance(args, list) else []
    if isinstance(kwargs, dict):
        parts += [f"{name}={json.dumps(value)}" for name, value in kwargs.items()]
    text = ", ".join(parts) or "-"
    return text if len(text) <= width else text[: width - 1] + "…"


def _still_dead(client: redis.Redis, zset: str, letters: list[DeadLetter]) -> list[DeadLetter]:
    """``letters`` without those replayed or purged by someone else between our two reads.

    The zset entry and its body are read in two commands; a body missing because a
    concurrent ``dlq replay`` moved the letter is not a letter without a body.
    """
    bodiless = [letter for letter in letters if letter.body is None]
    if not bodiless:
        return letters
    pipe = client.pipeline(transaction=False)
    for letter in bodiless:
        pipe.zscore(zset, letter.redis_id)
    scores = pipe.execute()
    gone = {
        letter.redis_id for letter, score in zip(bodiless, scores, strict=True) if score is None
    }
    return [letter for letter in letters if letter.redis_id not in gone]


def find(
    client: redis.Redis, queues: Iterable[str], job_id: str, max_bytes: int | None = None
) -> DeadLetter:
    """The dead letter ``job_id`` on one of ``queues``: its redis id, or the job id the logs
    print (its ``message_id``; the latest dead letter of that job when it died more than
    once). ``max_bytes``: see :attr:`DeadLetter.max_bytes`.

    Raises:
      DeadLetterError: when none of the queues holds it (saying so when the job is not
        dead but queued, delayed or running).
    """
    queues = list(queues)
    for queue in queues:
        zset, bodies = dead_letter_keys(queue)
        score = client.zscore(zset, job_id)
        if score is not None:
            body = layout.raw_bytes(client.hget(bodies, job_id))
            letter = DeadLetter(queue, job_id, int(score), body, max_bytes)
            if _still_dead(client, zset, [letter]):
                return letter
    found = [letter for queue in queues for letter in _of_message(client, queue, job_id, max_bytes)]
    if found:
        return max(found, key=lambda letter: (letter.died_ms, letter.redis_id))
    for queue in queues:
        if layout.live_place(client, queue, job_id) is not None:
            raise DeadLetterError(
                f"job {job_id!r} is not a dead letter: it is queued, delayed or running "
                "(see `status`)"
            )
    raise DeadLetterError(
        f"no dead letter {job_id!r} on queue(s) {', '.join(queues)} (as a redis id or a job id)"
    )


def _of_message(
    client: redis.Redis, queue: str, message_id: str, max_bytes: int | None
) -> list[DeadLetter]:
    """The latest dead letter of ``queue`` whose ``message_id`` is ``message_id`` (none:
    ``[]``), read newest first: the page that holds it is the last one read."""
    zset, bodies = dead_letter_keys(queue)
    for candidates in layout.dead_letter_candidates(client, queue, message_id):
        if not candidates:
            continue
        pipe = client.pipeline(transaction=False)
        for redis_id in candidates:
            pipe.zscore(zset, redis_id)
            pipe.hget(bodies, redis_id)
        replies = pipe.execute()
        letters = [
            DeadLetter(queue, redis_id, int(score), layout.raw_bytes(body), max_bytes)
            for redis_id, score, body in zip(candidates, replies[::2], replies[1::2], strict=True)
            if score is not None
        ]
        if found := [letter for letter in letters if letter.message_id == message_id]:
            return found[:1]
    return []


def fresh_copy(letter: DeadLetter, now_ms: int | None = None) -> Message[Any]:
    """The message of ``letter`` made ready for a fresh run on its queue.

    Same ``message_id``; a new redis id; ``retries`` and ``crashes`` at 0; no
    reason, traceback or eta; ``message_timestamp`` now; ``options.replays`` counts
    the replays so far.

    Raises:
      DeadLetterError: when its body is missing or is not a Dramatiq message.
    """
    from dramatiq import Message
    from dramatiq.errors import DecodeError

    if letter.body is None:
        raise DeadLetterError(f"dead letter {letter.redis_id!r} has no body; purge it")
    try:
        message = Message.decode(letter.body)
    except DecodeError:
        raise DeadLetterError(
            f"dead letter {letter.redis_id!r} is not a Dramatiq message; purge it"
        ) from None
    options = {key: value for key, value in message.options.items() if key not in STALE_OPTIONS}
    options.update(
        {
            layout.RETRIES: 0,
            layout.CRASHES: 0,
            layout.REPLAYS: int(options.get(layout.REPLAYS, 0)) + 1,
            layout.REDIS_MESSAGE_ID: str(uuid.uuid4()),
        }
    )
    return dataclasses.replace(
        message,
        queue_name=letter.queue,
        message_timestamp=now_ms if now_ms is not None else int(time.time() * 1000),
        options=options,
    )


def replay_page(
    client: redis.Redis, queue: str, letters: Iterable[DeadLetter], now_ms: int | None = None
) -> tuple[int, list[str]]:
    """Move ``letters`` (of ``queue``) back to the tail of their ready queue, as fresh runs
    (:func:`fresh_copy`), in one round trip; (how many moved, one line per letter skipped
    because it cannot run). A letter already gone (replayed or purged meanwhile) is neither.
    Each is stamped ``now_ms`` (default: Redis's clock, ``TIME``, read once, as every
    timestamp the worker writes: the backlog's age of a replayed message is then right
    whatever the clock of the host that replays it)."""
    now_ms = layout.redis_now_ms(client) if now_ms is None else now_ms
    moves: list[tuple[str, str, bytes, str]] = []
    skipped: list[str] = []
    for letter in letters:
        try:
            message = fresh_copy(letter, now_ms)
        except DeadLetterError as error:
            skipped.append(str(error))
            continue
        new_id = message.options[layout.REDIS_MESSAGE_ID]
        moves.append((letter.redis_id, new_id, message.encode(), message.message_id))
    return layout.replay_dead_letters(client, queue, moves), skipped


# The command line.


def traceback_of(letter: DeadLetter) -> str | None:
    """The traceback Dramatiq's Retries stored with ``letter`` (None: none)."""
    traceback = letter.options.get("traceback")
    return str(traceback) if traceback else None
