"""Dead letters: the messages the worker gave up on, and what an operator can do with them.

    dlq list [--queue Q] [--limit N] [--json]     the oldest dead letters (a table: 100 unless
                                                  --limit), then a summary by actor and reason
    dlq show <id> [--queue Q] [--json]            one dead letter: its reason, its traceback
                                                  as lines, its message
    dlq replay (<id>... | --all --yes) [--queue Q] [--dry-run]
                                                  send them again, as a fresh run
    dlq purge (--all | <id>...) [--queue Q] --yes
                                                  delete them (refused without --yes)

An ``<id>`` is the job id every log line prints (``message_id``) or the dead letter's
redis id (``dlq list`` shows both). A job id is looked for in the dead letters' bodies
inside Redis, newest first, a page per call (:func:`.layout.dead_letter_candidates`: no
body crosses the network): a job that just died is found in the first call; one that is
not there reads them all (:data:`.layout.lookup.SCAN_PAGE` a call). A job that is not dead
(queued, delayed, running) is said so, from the message index.

Every command reads the dead letters in pages (:data:`PAGE` at a time), so a million
take the memory of one page: ``list`` streams them oldest first across queues and
counts them by queue, actor, exception type and normalised reason as it goes (numbers,
ids and quoted values masked: :func:`.store.normalised`, so one failure of many jobs is one
row); ``replay --all`` and ``purge --all`` work page by page (one round trip per page)
and say how far they are on stderr every second. ``replay --all``, like ``purge``, does
nothing without ``--yes``.

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
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import layout
from ..cli.args import command_parser, positive_int
from ..exitcodes import EX_FAILURE, EX_OK, EX_USAGE
from ..layout import dead_letter_keys
from .store import (
    PAGE,
    DeadLetter,
    DeadLetterError,
    Summary,
    count,
    find,
    fresh_copy,
    read_page,
    replay_page,
    stream_all,
    traceback_of,
)

if TYPE_CHECKING:
    import redis

#: Characters of the reason shown in the ``dlq list`` table (``--json`` has all of it).
REASON_WIDTH = 60
#: Rows of the ``dlq list`` table unless ``--limit`` says otherwise.
DEFAULT_ROWS = 100
#: Lines of the summary that ``dlq list`` prints (the most frequent first).
SUMMARY_LINES = 20


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
    print("\nBY QUEUE, ACTOR, EXCEPTION AND REASON (numbers, ids and quoted values masked)")
    table: list[tuple[str, ...]] = [("COUNT", "QUEUE", "ACTOR", "EXCEPTION", "REASON")]
    table += [
        (
            f"{r['count']:,}",
            r["queue"],
            r["actor"],
            r["exception"],
            _truncate(r["reason"], REASON_WIDTH),
        )
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
            print(f"dlq {args.action}: give either --all or ids", file=sys.stderr)
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
ID_HELP = "the job id the logs print (message_id) or the dead letter's redis id"


def _selecting(actions: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    """Sub-command ``name`` of ``dlq`` acting on a selection: redis ids, or ``--all`` (of
    ``--queue``)."""
    parser: argparse.ArgumentParser = actions.add_parser(name, help=help_text)
    parser.add_argument("ids", nargs="*", metavar="id", help=ID_HELP)
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
    show.add_argument("id", metavar="id", help=ID_HELP)
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
