"""Pause and resume a queue for every worker of every pool.

    pause <queue>      no worker of any pool fetches it (decided in the fetch script,
                       :mod:`.layout.flow`); kept in Redis, so it survives every restart
    resume <queue>     fetched again at once (its idle consumers are woken)

A paused queue still takes new messages, and its delayed ones still become due (they wait
on its ready list); the jobs running when it was paused finish. ``status``, the console
and the metric ``queue_paused{queue}`` show it (:mod:`.flow`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import layout
from .cli.args import command_parser
from .exitcodes import EX_FAILURE, EX_OK, EX_USAGE


def _queue(name: str) -> tuple[str | None, str]:
    """``name`` when pools.toml declares it, else None and the line that says so."""
    from .settings import pools

    known = [queue for pool in pools().pools.values() for queue in pool.queues]
    if name in known:
        return name, ""
    return None, f"{name!r} is not a queue of pools.toml (one of: {', '.join(known)})"


def _switch(args: argparse.Namespace) -> int:
    import redis

    from .status import connect

    queue, problem = _queue(args.queue)
    if queue is None:
        print(f"{args.command}: {problem}", file=sys.stderr)
        return EX_USAGE
    client, url = connect()
    try:
        if args.command == "pause":
            changed = layout.pause(client, queue)
        else:
            changed = layout.resume(client, queue, layout.WAKE_CHANNEL)
    except redis.RedisError as error:
        print(f"{args.command}: Redis at {url} failed: {error}", file=sys.stderr)
        return EX_FAILURE
    finally:
        client.close()
    state = "paused" if args.command == "pause" else "resumed"
    print(f"{queue}: {state}" if changed else f"{queue}: already {state}")
    return EX_OK


_HELPS = {
    "pause": "stop every worker fetching a queue (kept in Redis)",
    "resume": "let the workers fetch a paused queue again",
}


def _add(commands: Any, name: str) -> None:
    parser = command_parser(commands, name, _HELPS[name], __doc__)
    parser.add_argument("queue", help="a queue of pools.toml")
    parser.set_defaults(run=_switch)


def add_pause(commands: Any) -> None:
    """Add ``pause <queue>`` to the CLI's ``commands`` (argparse subparsers)."""
    _add(commands, "pause")


def add_resume(commands: Any) -> None:
    """Add ``resume <queue>`` to the CLI's ``commands`` (argparse subparsers)."""
    _add(commands, "resume")
