"""Dead letters: the messages the worker gave up on, and what an operator can do with them.

    dlq list [--queue Q] [--limit N] [--json]     a table of dead letters, oldest first
    dlq show <redis-id> [--queue Q]               one dead letter, the whole message as JSON
    dlq replay (--all | <redis-id>...) [--queue Q] [--dry-run]
                                                  send them again, as a fresh run
    dlq purge (--all | <redis-id>...) [--queue Q] --yes
                                                  delete them (refused without --yes)

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
import dataclasses
import functools
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from . import layout
from .arguments import command_parser, positive_int
from .exitcodes import EX_FAILURE, EX_OK, EX_USAGE
from .layout import dead_letter_keys

if TYPE_CHECKING:
    import redis
    from dramatiq import Message

#: Characters of the reason shown in the ``dlq list`` table (``--json`` has all of it).
REASON_WIDTH = 60
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
        """The body as a dict, or None when it is missing or not JSON."""
        return layout.message_fields(self.body)

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
    """The dead letters of ``queue``, oldest first.

    Parameters:
      limit: at most this many (default: all).
      max_bytes: ``MAX_MESSAGE_BYTES`` (see :attr:`DeadLetter.max_bytes`).
    """
    zset, bodies = dead_letter_keys(queue)
    stop = -1 if limit is None else limit - 1
    entries = cast(list[tuple[Any, float]], client.zrange(zset, 0, stop, withscores=True))
    if not entries:
        return []
    ids = [layout.text(raw_id) for raw_id, _ in entries]
    stored = client.hmget(bodies, ids)
    letters = [
        DeadLetter(queue, redis_id, int(score), layout.raw_bytes(body), max_bytes)
        for (redis_id, (_, score), body) in zip(ids, entries, stored, strict=True)
    ]
    return _still_dead(client, zset, letters)


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


def replay(client: redis.Redis, letter: DeadLetter, now_ms: int | None = None) -> bool:
    """Move ``letter`` back to the tail of its ready queue; False when it was already gone.
    Its ``message_timestamp`` is ``now_ms`` (default: Redis's clock, ``TIME``, as every
    timestamp the worker writes: the backlog's age of the replayed message is then right
    whatever the clock of the host that replays it)."""
    message = fresh_copy(letter, layout.redis_now_ms(client) if now_ms is None else now_ms)
    new_id = message.options[layout.REDIS_MESSAGE_ID]
    return layout.replay_dead_letter(
        client, letter.queue, letter.redis_id, new_id, message.encode()
    )


def purge(client: redis.Redis, letter: DeadLetter) -> bool:
    """Delete ``letter``; False when it was already gone."""
    return layout.purge_dead_letter(client, letter.queue, letter.redis_id)


# The command line.


def _connect() -> tuple[redis.Redis, str, int]:
    """A Redis client for ``REDIS_URL``, the URL with its password masked, and
    ``MAX_MESSAGE_BYTES``."""
    from .redisclient import connect
    from .settings import load_redis_settings, mask_url

    settings = load_redis_settings()
    url = settings.redis_url.get_secret_value()
    client = connect(url, socket_timeout=10, socket_connect_timeout=5)
    return client, mask_url(url), settings.max_message_bytes


def _queues(client: redis.Redis, queue: str | None) -> list[str]:
    """``[queue]``, or every queue of pools.toml.

    Raises:
      DeadLetterError: when ``queue`` is not in pools.toml and has no dead letters.
    """
    from .settings import pools

    declared = pools()
    if queue is None:
        return [name for pool in declared.pools.values() for name in pool.queues]
    if declared.pool_of_queue(queue) is None and not client.exists(dead_letter_keys(queue)[0]):
        raise DeadLetterError(f"queue {queue!r} is not in pools.toml and has no dead letters")
    return [queue]


def _selected(client: redis.Redis, args: argparse.Namespace) -> list[DeadLetter]:
    """The dead letters that ``--all`` or the ids name; every id must exist."""
    queues = _queues(client, args.queue)
    if args.all:
        return [
            letter
            for queue in queues
            for letter in dead_letters(client, queue, max_bytes=args.max_message_bytes)
        ]
    return [
        find(client, queues, redis_id, args.max_message_bytes)
        for redis_id in dict.fromkeys(args.ids)
    ]


def _plural(number: int, noun: str = "dead letter") -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _list(client: redis.Redis, args: argparse.Namespace) -> int:
    queues = _queues(client, args.queue)
    total = sum(count(client, queue) for queue in queues)
    letters = sorted(
        (
            letter
            for queue in queues
            for letter in dead_letters(client, queue, args.limit, args.max_message_bytes)
        ),
        key=lambda letter: (letter.died_ms, letter.queue, letter.redis_id),
    )[: args.limit]
    if args.json:
        print(json.dumps([letter.summary() for letter in letters], indent=2))
        return EX_OK
    if not letters:
        print(f"no dead letters on {', '.join(queues)}")
        return EX_OK
    rows: list[tuple[str, ...]] = [
        ("QUEUE", "REDIS ID", "MESSAGE ID", "ACTOR", "DEAD SINCE", "REASON")
    ]
    rows += [
        (
            letter.queue,
            letter.redis_id,
            letter.message_id,
            letter.actor,
            letter.died,
            _truncate(letter.reason, REASON_WIDTH),
        )
        for letter in letters
    ]
    print(_table(rows))
    shown = f"{len(letters)} of {total}" if len(letters) < total else str(total)
    print(f"\n{shown} dead letter{'' if total == 1 else 's'}")
    return EX_OK


def _truncate(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


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
    print(json.dumps(shown, indent=2))
    return EX_OK


def _replay(client: redis.Redis, args: argparse.Namespace) -> int:
    letters = _selected(client, args)
    for letter in letters:
        fresh_copy(letter)  # refuse the whole batch before moving any, if one cannot run
    if args.dry_run:
        for letter in letters:
            print(f"would replay {letter.queue} {letter.redis_id} ({letter.actor})")
        print(f"would replay {_plural(len(letters))}")
        return EX_OK
    now_ms = layout.redis_now_ms(client)
    moved = sum(replay(client, letter, now_ms) for letter in letters)
    gone = len(letters) - moved
    print(f"replayed {_plural(moved)}" + (f" ({gone} already gone)" if gone else ""))
    return EX_OK


def _purge(client: redis.Redis, args: argparse.Namespace) -> int:
    letters = _selected(client, args)
    if not args.yes:
        print(
            f"dlq purge: refusing to delete {_plural(len(letters))} without --yes "
            "(nothing deleted; review them with `dlq list`)",
            file=sys.stderr,
        )
        return EX_USAGE
    deleted = sum(purge(client, letter) for letter in letters)
    gone = len(letters) - deleted
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


def add_commands(commands: Any) -> None:
    """Add ``dlq list|show|replay|purge`` to the CLI's ``commands`` (argparse subparsers)."""
    dlq = command_parser(commands, "dlq", "dead-letter tooling", __doc__)
    actions = dlq.add_subparsers(dest="action", required=True)
    queue_help = "one queue (default: every queue of pools.toml)"

    listing = actions.add_parser("list", help="a table of dead letters, oldest first")
    listing.add_argument("--queue", help=queue_help)
    listing.add_argument("--limit", type=positive_int, metavar="N", help="show at most N")
    listing.add_argument("--json", action="store_true", help="JSON instead of a table")
    listing.set_defaults(run=_command(_list))

    show = actions.add_parser("show", help="one dead letter: the whole message as JSON")
    show.add_argument("id", metavar="redis-id")
    show.add_argument("--queue", help=queue_help)
    show.set_defaults(run=_command(_show))

    replaying = actions.add_parser("replay", help="send dead letters again, as a fresh run")
    replaying.add_argument("ids", nargs="*", metavar="redis-id")
    replaying.add_argument("--all", action="store_true", help="every dead letter of the queues")
    replaying.add_argument("--queue", help=queue_help)
    replaying.add_argument("--dry-run", action="store_true", help="only say what would be sent")
    replaying.set_defaults(run=_command(_replay))

    purging = actions.add_parser("purge", help="delete dead letters (needs --yes)")
    purging.add_argument("ids", nargs="*", metavar="redis-id")
    purging.add_argument("--all", action="store_true", help="every dead letter of the queues")
    purging.add_argument("--queue", help=queue_help)
    purging.add_argument("--yes", action="store_true", help="really delete them")
    purging.set_defaults(run=_command(_purge))
