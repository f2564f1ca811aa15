"""Dead letters: the messages the worker gave up on, and what an operator can do with them.

    dlq list [--queue Q] [--limit N] [--json]     the oldest dead letters (a table: 100 unless
                                                  --limit), then a summary by actor and reason
    dlq show <redis-id> [--queue Q] [--json]      one dead letter: its reason, its traceback
                                                  as lines, its message
    dlq replay (<redis-id>... | --all --yes) [--queue Q] [--dry-run]
                                                  send them again, as a fresh run
    dlq purge (--all | <redis-id>...) [--queue Q] --yes
                                                  delete them (refused without --yes)

Every command reads the dead letters in pages (:data:`PAGE` at a time), so a million
take the memory of one page: ``list`` streams them oldest first across queues and
counts them by queue, actor and reason as it goes; ``replay --all`` and ``purge --all``
work page by page (one round trip per page) and say how far they are on stderr every
second. ``replay --all``, like ``purge``, does nothing without ``--yes``.

Without ``--queue`` the commands look at every queue of pools.toml: an operator
looks across pools. Dead letters are kept where Dramatiq keeps them (see
:mod:`.layout`): the zset ``dramatiq:<queue>.XQ`` maps each redis message id to
the time it died (ms), the hash ``dramatiq:<queue>.XQ.msgs`` holds its body, a
Dramatiq message with ``options.dead_letter_reason`` (ours) and
``options.traceback`` (Dramatiq's Retries) when known.

Dead letters are kept ``DLQ_RETENTION_DAYS`` days (default 14), time enough to
diagnose and replay them: every worker deletes the older ones of its queues (the
:class:`~.middleware.recovery.Recovery` pass). The commands need ``REDIS_URL``
(and pools.toml) only, never a worker setting such as ``WORKER_POOL``.

A replay keeps the ``message_id`` (idempotency keys rely on it) and gives the
message a new redis id, zero ``retries`` and ``crashes``, no reason or traceback,
and a new ``message_timestamp`` (so an actor's ``max_age`` counts from the replay).
It is one Lua call per message: remove it from the dead letters, store its body,
push it on the ready queue. The removal is the guard, so two replays running at
once send each message exactly once, and none is lost. Purge removes with the
same guard.

Exit codes (:mod:`.exitcodes`): ``EX_OK`` done, ``EX_FAILURE`` unknown id or Redis
unreachable (one line, no traceback), ``EX_USAGE`` (e.g. ``purge`` without ``--yes``),
``EX_CONFIG`` bad configuration.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import heapq
import itertools
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import orjson

from .. import layout
from ..cli.args import command_parser, positive_int
from ..exitcodes import EX_FAILURE, EX_OK, EX_USAGE
from ..layout import dead_letter_keys

if TYPE_CHECKING:
    import redis
    from dramatiq import Message

#: Characters of the reason shown in the ``dlq list`` table (``--json`` has all of it).
REASON_WIDTH = 60
#: Dead letters read per round trip (ids, times and bodies) by the commands that stream.
PAGE = 500
#: Rows of the ``dlq list`` table unless ``--limit`` says otherwise.
DEFAULT_ROWS = 100
#: Distinct (queue, actor, reason) the summary counts one by one; beyond, "(other reasons)".
SUMMARY_KINDS = 10_000
#: Lines of the summary that ``dlq list`` prints (the most frequent first).
SUMMARY_LINES = 20
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


class Summary:
    """Dead letters counted by (queue, actor, reason), in bounded memory: past
    :data:`SUMMARY_KINDS` distinct kinds, the new ones count as "(other reasons)"."""

    OTHER = "(other reasons)"

    def __init__(self, kinds: int = SUMMARY_KINDS) -> None:
        self.kinds = kinds
        self.total = 0
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()

    def add(self, letter: DeadLetter) -> None:
        self.total += 1
        key = (letter.queue, letter.actor, " ".join(letter.reason.split())[:200])
        if key not in self.counts and len(self.counts) >= self.kinds:
            key = (letter.queue, letter.actor, self.OTHER)
        self.counts[key] += 1

    def rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The most frequent kinds first: ``{"count", "queue", "actor", "reason"}``."""
        return [
            {"count": n, "queue": queue, "actor": actor, "reason": reason}
            for (queue, actor, reason), n in self.counts.most_common(limit)
        ]


class Progress:
    """Says on stderr how far a long command is, at most once a second (nothing when it
    ends within the first second)."""

    def __init__(self, verb: str, total: int, every_s: float = 1.0) -> None:
        self.verb, self.total, self.every_s = verb, total, every_s
        self.done = 0
        self._said = time.monotonic()

    def step(self, count: int = 1) -> None:
        self.done += count
        now = time.monotonic()
        if now - self._said >= self.every_s:
            self._said = now
            share = f" ({100 * self.done / self.total:.0f} %)" if self.total else ""
            print(f"{self.verb} {self.done:,} of {self.total:,}{share}", file=sys.stderr)


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
    client: redis.Redis, queues: Iterable[str], redis_id: str, max_bytes: int | None = None
) -> DeadLetter:
    """The dead letter ``redis_id`` on one of ``queues`` (``max_bytes``: see
    :attr:`DeadLetter.max_bytes`).

    Raises:
      DeadLetterError: when none of the queues holds it.
    """
    queues = list(queues)
    for queue in queues:
        zset, bodies = dead_letter_keys(queue)
        score = client.zscore(zset, redis_id)
        if score is not None:
            body = layout.raw_bytes(client.hget(bodies, redis_id))
            letter = DeadLetter(queue, redis_id, int(score), body, max_bytes)
            if _still_dead(client, zset, [letter]):
                return letter
    raise DeadLetterError(f"no dead letter {redis_id!r} on queue(s) {', '.join(queues)}")


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


def _connect() -> tuple[redis.Redis, str, int]:
    """A Redis client for ``REDIS_URL``, the URL with its password masked, and
    ``MAX_MESSAGE_BYTES``."""
    from ..redisclient import connect
    from ..settings import load_redis_settings, mask_url

    settings = load_redis_settings()
    url = settings.redis_url.get_secret_value()
    client = connect(url, socket_timeout=10, socket_connect_timeout=5)
    return client, mask_url(url), settings.max_message_bytes


def _queues(client: redis.Redis, queue: str | None) -> list[str]:
    """``[queue]``, or every queue of pools.toml.

    Raises:
      DeadLetterError: when ``queue`` is not in pools.toml and has no dead letters.
    """
    from ..settings import pools

    declared = pools()
    if queue is None:
        return [name for pool in declared.pools.values() for name in pool.queues]
    if declared.pool_of_queue(queue) is None and not client.exists(dead_letter_keys(queue)[0]):
        raise DeadLetterError(f"queue {queue!r} is not in pools.toml and has no dead letters")
    return [queue]


def _named(client: redis.Redis, args: argparse.Namespace) -> list[DeadLetter]:
    """The dead letters the ids name; every id must exist."""
    queues = _queues(client, args.queue)
    return [
        find(client, queues, redis_id, args.max_message_bytes)
        for redis_id in dict.fromkeys(args.ids)
    ]


def _each_page(
    client: redis.Redis,
    args: argparse.Namespace,
    act: Callable[[list[DeadLetter]], tuple[int, int]],
) -> None:
    """Call ``act`` on each page of the letters ``--all`` or the ids select; ``act``
    returns (removed by it, left in place). With ``--all`` each page is read again from
    the head of the zset, past what was left in place (what ``act`` removed, or another
    replay removed, no longer shifts the pages)."""
    if not args.all:
        by_queue: dict[str, list[DeadLetter]] = {}
        for letter in _named(client, args):
            by_queue.setdefault(letter.queue, []).append(letter)
        for page in by_queue.values():
            act(page)
        return
    for queue in _queues(client, args.queue):
        left = 0
        while page := read_page(client, queue, left, PAGE, args.max_message_bytes):
            _, kept = act(page)
            left += kept


def _selected_count(client: redis.Redis, args: argparse.Namespace) -> int:
    """How many letters ``--all`` or the ids select (every id must exist)."""
    if args.all:
        return sum(count(client, queue) for queue in _queues(client, args.queue))
    return len(_named(client, args))


def _plural(number: int, noun: str = "dead letter") -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _list(client: redis.Redis, args: argparse.Namespace) -> int:
    queues = _queues(client, args.queue)
    total = sum(count(client, queue) for queue in queues)
    letters = stream_all(client, queues, args.max_message_bytes)
    if args.json:  # a JSON array, written as it is read
        limit = args.limit if args.limit is not None else total
        sys.stdout.write("[")
        for index, letter in enumerate(itertools.islice(letters, limit)):
            sys.stdout.write(("," if index else "") + "\n  " + json.dumps(letter.summary()))
        sys.stdout.write("\n]\n" if total and limit else "]\n")
        return EX_OK
    if not total:
        print(f"no dead letters on {', '.join(queues)}")
        return EX_OK
    limit = args.limit if args.limit is not None else DEFAULT_ROWS
    summary, progress = Summary(), Progress("read", total)
    widths: list[int] | None = None
    shown = 0
    batch: list[tuple[str, ...]] = []
    header = ("QUEUE", "REDIS ID", "MESSAGE ID", "ACTOR", "DEAD SINCE", "REASON")
    for letter in letters:
        summary.add(letter)
        progress.step()
        if shown < limit:
            shown += 1
            batch.append(_row(letter))
        if batch and (len(batch) == PAGE or shown == limit):
            widths = widths or _widths([header, *batch])
            if shown == len(batch):
                print(_aligned(header, widths))
            print("\n".join(_aligned(row, widths) for row in batch))
            batch = []
    if batch:
        widths = widths or _widths([header, *batch])
        if shown == len(batch):
            print(_aligned(header, widths))
        print("\n".join(_aligned(row, widths) for row in batch))
    rows = summary.rows(SUMMARY_LINES)
    print("\nBY QUEUE, ACTOR AND REASON")
    table: list[tuple[str, ...]] = [("COUNT", "QUEUE", "ACTOR", "REASON")]
    table += [
        (f"{r['count']:,}", r["queue"], r["actor"], _truncate(r["reason"], REASON_WIDTH))
        for r in rows
    ]
    print(_table(table))
    if len(summary.counts) > len(rows):
        print(f"... and {len(summary.counts) - len(rows):,} more kinds")
    counted = summary.total
    print(
        f"\n{shown:,} of {counted:,} dead letters" if shown < counted else f"\n{_plural(counted)}"
    )
    return EX_OK


def _row(letter: DeadLetter) -> tuple[str, ...]:
    return (
        letter.queue,
        letter.redis_id,
        letter.message_id,
        letter.actor,
        letter.died,
        _truncate(letter.reason, REASON_WIDTH),
    )


def _widths(rows: list[tuple[str, ...]]) -> list[int]:
    return [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]


def _aligned(row: tuple[str, ...], widths: list[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()


def _truncate(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = _widths(rows)
    return "\n".join(_aligned(row, widths) for row in rows)


def traceback_of(letter: DeadLetter) -> str | None:
    """The traceback Dramatiq's Retries stored with ``letter`` (None: none)."""
    traceback = letter.options.get("traceback")
    return str(traceback) if traceback else None


def _show(client: redis.Redis, args: argparse.Namespace) -> int:
    letter = find(client, _queues(client, args.queue), args.id, args.max_message_bytes)
    shown: dict[str, Any] = {
        "queue": letter.queue,
        "redis_id": letter.redis_id,
        "dead_since": letter.died,
        "reason": letter.reason,
    }
    if letter.fields is not None:
        shown["message"] = letter.fields
    else:
        shown["body"] = None if letter.body is None else letter.body.decode(errors="replace")
    if args.json:
        print(json.dumps(shown, indent=2))
        return EX_OK
    traceback = traceback_of(letter)
    lines = [
        f"queue:       {letter.queue}",
        f"redis id:    {letter.redis_id}",
        f"message id:  {letter.message_id}",
        f"actor:       {letter.actor}",
        f"dead since:  {letter.died}",
        f"reason:      {letter.reason}",
    ]
    if traceback:
        lines += ["", "traceback:", *("  " + line for line in traceback.rstrip().splitlines())]
    if letter.fields is not None:
        message = dict(letter.fields)
        options = {k: v for k, v in letter.options.items() if k != "traceback"}
        message["options"] = options
        lines += ["", "message:", json.dumps(message, indent=2)]
    else:
        lines += ["", "body:", str(shown["body"])]
    print("\n".join(lines))
    return EX_OK


def _replay(client: redis.Redis, args: argparse.Namespace) -> int:
    total = _selected_count(client, args)
    if args.all and not args.yes and not args.dry_run:
        print(
            f"dlq replay: refusing to replay {_plural(total)} without --yes "
            "(nothing sent; review them with `dlq list`, or --dry-run)",
            file=sys.stderr,
        )
        return EX_USAGE
    if not args.all:  # named ones: refuse the whole batch before moving any
        for letter in _named(client, args):
            fresh_copy(letter)
    if args.dry_run:
        shown = 0
        for letter in (
            stream_all(client, _queues(client, args.queue), args.max_message_bytes)
            if args.all
            else _named(client, args)
        ):
            print(f"would replay {letter.queue} {letter.redis_id} ({letter.actor})")
            shown += 1
        print(f"would replay {_plural(shown)}")
        return EX_OK
    progress = Progress("replayed", total)
    moved = gone = skipped = 0

    def act(page: list[DeadLetter]) -> tuple[int, int]:
        nonlocal moved, gone, skipped
        done, problems = replay_page(client, page[0].queue, page)  # only --all skips any:
        for problem in problems:  # named ones were checked
            print(f"dlq replay: skipped: {problem}", file=sys.stderr)
        moved, skipped = moved + done, skipped + len(problems)
        gone += len(page) - len(problems) - done
        progress.step(len(page))
        return done, len(problems)

    _each_page(client, args, act)
    said = f"replayed {_plural(moved)}" + (f" ({gone} already gone)" if gone else "")
    print(said + (f"; skipped {skipped} that cannot run (purge them)" if skipped else ""))
    return EX_OK


def _purge(client: redis.Redis, args: argparse.Namespace) -> int:
    total = _selected_count(client, args)
    if not args.yes:
        print(
            f"dlq purge: refusing to delete {_plural(total)} without --yes "
            "(nothing deleted; review them with `dlq list`)",
            file=sys.stderr,
        )
        return EX_USAGE
    progress = Progress("purged", total)
    deleted = gone = 0

    def act(page: list[DeadLetter]) -> tuple[int, int]:
        nonlocal deleted, gone
        ids = [letter.redis_id for letter in page]
        done = layout.purge_dead_letters(client, page[0].queue, ids)
        deleted, gone = deleted + done, gone + len(page) - done
        progress.step(len(page))
        return done, 0

    _each_page(client, args, act)
    print(f"purged {_plural(deleted)}" + (f" ({gone} already gone)" if gone else ""))
    return EX_OK


def _command(
    run: Callable[[redis.Redis, argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Wrap ``run`` with a Redis client, one-line errors and the exit codes."""

    @functools.wraps(run)
    def command(args: argparse.Namespace) -> int:
        import redis

        if getattr(args, "ids", None) is not None and bool(args.ids) == bool(args.all):
            print(f"dlq {args.action}: give either --all or redis ids", file=sys.stderr)
            return EX_USAGE
        client, url, args.max_message_bytes = _connect()
        try:
            return run(client, args)
        except DeadLetterError as error:
            print(f"dlq {args.action}: {error}", file=sys.stderr)
            return EX_FAILURE
        except (redis.ConnectionError, redis.TimeoutError) as error:
            print(f"dlq {args.action}: Redis at {url} is unreachable: {error}", file=sys.stderr)
            return EX_FAILURE
        except redis.RedisError as error:
            print(f"dlq {args.action}: Redis at {url} failed: {error}", file=sys.stderr)
            return EX_FAILURE
        finally:
            client.close()

    return command


QUEUE_HELP = "one queue (default: every queue of pools.toml)"


def _selecting(actions: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    """Sub-command ``name`` of ``dlq`` acting on a selection: redis ids, or ``--all`` (of
    ``--queue``)."""
    parser: argparse.ArgumentParser = actions.add_parser(name, help=help_text)
    parser.add_argument("ids", nargs="*", metavar="redis-id")
    parser.add_argument("--all", action="store_true", help="every dead letter of the queues")
    parser.add_argument("--queue", help=QUEUE_HELP)
    return parser


def add_commands(commands: Any) -> None:
    """Add ``dlq list|show|replay|purge`` to the CLI's ``commands`` (argparse subparsers)."""
    dlq = command_parser(commands, "dlq", "dead-letter tooling", __doc__)
    actions = dlq.add_subparsers(dest="action", required=True)

    listing = actions.add_parser("list", help="the oldest dead letters, a summary by reason")
    listing.add_argument("--queue", help=QUEUE_HELP)
    listing.add_argument(
        "--limit", type=positive_int, metavar="N", help=f"rows (default {DEFAULT_ROWS})"
    )
    listing.add_argument("--json", action="store_true", help="JSON instead of a table")
    listing.set_defaults(run=_command(_list))

    show = actions.add_parser("show", help="one dead letter: reason, traceback, message")
    show.add_argument("id", metavar="redis-id")
    show.add_argument("--queue", help=QUEUE_HELP)
    show.add_argument("--json", action="store_true", help="the whole record as JSON")
    show.set_defaults(run=_command(_show))

    replaying = _selecting(actions, "replay", "send dead letters again, as a fresh run")
    replaying.add_argument("--dry-run", action="store_true", help="only say what would be sent")
    replaying.add_argument("--yes", action="store_true", help="really replay --all")
    replaying.set_defaults(run=_command(_replay))

    purging = _selecting(actions, "purge", "delete dead letters (needs --yes)")
    purging.add_argument("--yes", action="store_true", help="really delete them")
    purging.set_defaults(run=_command(_purge))
