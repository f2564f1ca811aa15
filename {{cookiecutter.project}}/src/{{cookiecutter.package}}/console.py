"""The web console: the queues, the running jobs, the dead letters and the schedules in a page.

    console [--host 127.0.0.1] [--port 9292]

Pages (plain HTML, no script, standard library ``http.server``):

* ``/``: each queue (waiting, delayed, oldest due, in flight, dead letters) and each worker
  process (pool, host, pid, held, heartbeat) with the jobs it runs (actor, running time):
  what ``status`` prints, from Redis alone.
* ``/dead?queue=Q&page=N``: the dead letters of a queue, oldest first, :data:`PAGE_SIZE` a
  page, each with a box to select it; replay or purge the selected ones.
* ``/dead/summary?queue=Q``: the dead letters counted by actor and reason (read in pages).
* ``/dead/show?queue=Q&id=ID``: one dead letter: reason, traceback as lines, message.
* ``/schedules``: each schedule of pools.toml, its next fire times and last runs.

Read-only unless ``CONSOLE_TOKEN`` is set. An action (``POST /dead/replay`` or
``/dead/purge``) needs that token typed into its form, the box "I have reviewed them"
ticked, and the operator's name; it acts on the ids selected and nothing else, and is
logged (one JSON line: event ``console_action``, who, from where, what, how many moved).
A refused action changes nothing and says why (403 without the token or with a wrong one,
400 without the confirmation or a selection).

It binds 127.0.0.1 by default: reach it with ``kubectl port-forward``. Every response
carries ``Content-Security-Policy: default-src 'none'`` (no script, no frame, no form
posted elsewhere), ``X-Frame-Options: DENY``, ``X-Content-Type-Options: nosniff``,
``Referrer-Policy: no-referrer`` and ``Cache-Control: no-store``; everything shown is
escaped (job arguments and tracebacks are untrusted input).
"""

from __future__ import annotations

import argparse
import hmac
import html
import json
import logging
import os
import sys
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from . import dlq, layout
from .arguments import command_parser
from .exitcodes import EX_CONFIG, EX_OK
from .status import Status, duration, pools_queues, read_status

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)

#: The variable that enables actions; unset (or empty): the console is read-only.
TOKEN_ENV = "CONSOLE_TOKEN"  # noqa: S105  (a variable's name, not a secret)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9292
#: Dead letters per page of ``/dead``.
PAGE_SIZE = 50
#: Most bytes a form may post (ids of a page, a token, a name).
MAX_FORM_BYTES = 64 * 1024
#: The headers of every response.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; form-action 'self'; frame-ancestors 'none'; "
        "base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
STYLE = b"""
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
nav a { margin-right: 1em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border-bottom: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left;
         vertical-align: top; }
td.n, th.n { text-align: right; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; white-space: pre-wrap; }
.note { color: #666; } .bad { color: #a00; } .ok { color: #070; }
fieldset { margin-top: 1em; }
"""


def e(value: Any) -> str:
    """``value`` as escaped HTML text (quotes too: safe in an attribute)."""
    return html.escape(str(value), quote=True)


def q(**params: Any) -> str:
    """A query string of ``params``."""
    return urllib.parse.urlencode(params)


def page(title: str, body: str) -> bytes:
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{e(title)} - {{ cookiecutter.project }}</title>"
        '<link rel=stylesheet href="/console.css"></head><body>'
        '<nav><a href="/">Queues and workers</a><a href="/schedules">Schedules</a></nav>'
        f"<h1>{e(title)}</h1>{body}</body></html>"
    ).encode()


def table(header: list[str], rows: list[list[str]], numeric: set[int] | None = None) -> str:
    """An HTML table; the cells of ``rows`` are HTML already (escape what goes in)."""
    numeric = numeric or set()

    def cls(index: int) -> str:
        return ' class="n"' if index in numeric else ""

    head = "".join(f"<th{cls(i)}>{e(h)}</th>" for i, h in enumerate(header))
    body = "".join(
        "<tr>" + "".join(f"<td{cls(i)}>{cell}</td>" for i, cell in enumerate(row)) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class Console:
    """What the pages show and what the actions do, on ``client`` for ``queues``.

    Parameters:
      client: a Redis client (``REDIS_URL``).
      queues: the queues shown (default: every queue of pools.toml).
      token: ``CONSOLE_TOKEN``; None or empty: read-only.
      max_bytes: ``MAX_MESSAGE_BYTES`` (a dead letter over it shows its size as its reason).
    """

    def __init__(
        self,
        client: redis.Redis,
        queues: list[str],
        token: str | None,
        max_bytes: int | None = None,
    ) -> None:
        self.client = client
        self.queues = queues
        self.token = token or None
        self.max_bytes = max_bytes

    # -- pages ------------------------------------------------------------------------

    def overview(self) -> bytes:
        status: Status = read_status(self.client, self.queues)
        queues = table(
            ["queue", "waiting", "delayed", "oldest due", "in flight", "dead letters"],
            [
                [
                    e(q.queue),
                    e(q.waiting),
                    e(q.delayed),
                    e(duration(q.oldest_due_s) if q.waiting else "-"),
                    e(q.inflight),
                    f'<a href="/dead?{e(q_(queue=q.queue))}">{e(q.dead_letters)}</a>',
                ]
                for q in status.queues
            ],
            numeric={1, 2, 4, 5},
        )
        rows = []
        for p in status.processes:
            jobs = "<br>".join(
                f"{e(job.actor)} for {e(duration(job.running_s))} "
                f'<span class="note">({e(job.queue)}, {e(job.message_id)})</span>'
                for job in p.jobs
            )
            beat = duration(p.heartbeat_age_s) + " ago" + (" (silent)" if p.silent else "")
            held = f"{p.held}/{p.concurrency}" if p.concurrency else str(p.held)
            rows.append([e(p.pool), e(p.host), e(p.pid or "-"), e(held), e(beat), jobs or "-"])
        processes = (
            table(["pool", "host", "pid", "held", "heartbeat", "running jobs"], rows)
            if rows
            else '<p class="note">No worker process has a heartbeat in Redis.</p>'
        )
        mode = (
            "Actions are enabled (CONSOLE_TOKEN is set)."
            if self.token
            else "Read-only: set CONSOLE_TOKEN to enable replay and purge."
        )
        return page(
            "Queues and workers",
            f'<p class="note">{e(mode)} Redis time {e(_iso(status.now_ms))}.</p>'
            f"<h2>Queues</h2>{queues}<h2>Worker processes</h2>{processes}",
        )

    def _queue(self, params: dict[str, str]) -> str:
        queue = params.get("queue", "")
        if queue not in self.queues:
            raise NotFoundError(f"no queue {queue!r} in pools.toml")
        return queue

    def dead(self, params: dict[str, str], notice: str = "") -> bytes:
        queue = self._queue(params)
        try:
            number = max(0, int(params.get("page", "0")))
        except ValueError:
            number = 0
        total = dlq.count(self.client, queue)
        letters = dlq.read_page(self.client, queue, number * PAGE_SIZE, PAGE_SIZE, self.max_bytes)
        rows = [
            [
                f'<input type=checkbox name=id value="{e(letter.redis_id)}" '
                f'aria-label="select {e(letter.redis_id)}">',
                f'<a href="/dead/show?{e(q_(queue=queue, id=letter.redis_id))}">'
                f"{e(letter.redis_id)}</a>",
                e(letter.actor),
                e(letter.died),
                e(_shorter(letter.reason, 120)),
                f"<code>{e(_truncate_json(letter.fields, 'args'))}</code>",
            ]
            for letter in letters
        ]
        pages = max(1, -(-total // PAGE_SIZE))
        links = []
        if number > 0:
            links.append(f'<a href="/dead?{e(q_(queue=queue, page=number - 1))}">newer</a>')
        if number + 1 < pages:
            links.append(f'<a href="/dead?{e(q_(queue=queue, page=number + 1))}">older</a>')
        links.append(f'<a href="/dead/summary?{e(q_(queue=queue))}">summary</a>')
        listing = (
            table(["", "redis id", "actor", "dead since", "reason", "args"], rows)
            if rows
            else '<p class="note">No dead letters here.</p>'
        )
        body = (
            (notice or "")
            + f"<p>{e(total)} dead letters on {e(queue)}; page {e(number + 1)} of {e(pages)}, "
            + "oldest first. "
            + " ".join(links)
            + "</p>"
            + '<form method=post action="/dead/act">'
            + f'<input type=hidden name=queue value="{e(queue)}">'
            + listing
            + self._action_fields()
            + "</form>"
        )
        return page(f"Dead letters: {queue}", body)

    def _action_fields(self) -> str:
        if not self.token:
            return (
                '<p class="note">Read-only: replay and purge need CONSOLE_TOKEN set where '
                "the console runs.</p>"
            )
        return (
            "<fieldset><legend>Act on the selected dead letters</legend>"
            "<label>Your name <input name=who required maxlength=80 autocomplete=off></label> "
            "<label>Token <input type=password name=token required autocomplete=off></label> "
            "<label><input type=checkbox name=confirm value=yes required> "
            "I have reviewed the selected dead letters</label> "
            "<button name=action value=replay>Replay selected</button> "
            "<button name=action value=purge>Purge selected</button></fieldset>"
        )

    def summary(self, params: dict[str, str]) -> bytes:
        queue = self._queue(params)
        counted = dlq.Summary()
        for letter in dlq.stream(self.client, queue, self.max_bytes):
            counted.add(letter)
        rows = [[e(f"{r['count']:,}"), e(r["actor"]), e(r["reason"])] for r in counted.rows(100)]
        body = (
            f"<p>{e(counted.total)} dead letters on {e(queue)}. "
            f'<a href="/dead?{e(q_(queue=queue))}">list</a></p>'
            + table(["count", "actor", "reason"], rows, numeric={0})
        )
        return page(f"Dead letters by actor and reason: {queue}", body)

    def show(self, params: dict[str, str]) -> bytes:
        queue = self._queue(params)
        try:
            letter = dlq.find(self.client, [queue], params.get("id", ""), self.max_bytes)
        except dlq.DeadLetterError as error:
            raise NotFoundError(str(error)) from None
        traceback = dlq.traceback_of(letter)
        fields = dict(letter.fields or {})
        if fields:
            fields["options"] = {k: v for k, v in letter.options.items() if k != "traceback"}
        facts = [
            ["queue", e(letter.queue)],
            ["redis id", e(letter.redis_id)],
            ["message id", e(letter.message_id)],
            ["actor", e(letter.actor)],
            ["dead since", e(letter.died)],
            ["reason", e(letter.reason)],
        ]
        body = table(["", ""], facts)
        if traceback:
            body += f"<h2>Traceback</h2><pre>{e(traceback)}</pre>"
        if fields:
            body += f"<h2>Message</h2><pre>{e(json.dumps(fields, indent=2))}</pre>"
        elif letter.body is not None:
            body += f"<h2>Body</h2><pre>{e(letter.body.decode(errors='replace'))}</pre>"
        if self.token:
            body += (
                '<form method=post action="/dead/act">'
                f'<input type=hidden name=queue value="{e(queue)}">'
                f'<input type=hidden name=id value="{e(letter.redis_id)}">'
                + self._action_fields().replace("the selected dead letters", "this dead letter")
                + "</form>"
            )
        return page(f"Dead letter {letter.redis_id}", body)

    def schedules(self) -> bytes:
        from .scheduler import load_schedules, schedule_rows

        schedules = load_schedules()
        rows = schedule_rows(schedules, layout.read_states(self.client, schedules), time.time(), 3)
        cells = [
            [
                e(r["schedule"]),
                e(r["actor"]),
                f"<code>{e(r['cron'])}</code> {e(r['timezone'])}",
                "<br>".join(e(t) for t in r["next"]),
                e(r["last_fired"] or "never") + (" (running)" if r["running"] else ""),
                e(r["last_success"] or "never"),
                e(", ".join(f"{k}={v}" for k, v in (r["runs"] or {}).items()) or "-"),
            ]
            for r in rows
        ]
        body = (
            table(
                ["schedule", "actor", "cron", "next", "last fired", "last success", "runs"], cells
            )
            if cells
            else '<p class="note">No schedules in pools.toml.</p>'
        )
        return page("Schedules", body)

    # -- actions ----------------------------------------------------------------------

    def act(self, form: dict[str, list[str]], remote: str) -> tuple[int, bytes]:
        """Replay or purge the selected dead letters; (HTTP status, page)."""
        queue = self._queue({"queue": _one(form, "queue")})
        action = _one(form, "action")
        ids = list(dict.fromkeys(form.get("id", [])))
        who = _one(form, "who").strip()[:80]
        params = {"queue": queue}
        refusal = self._refusal(form, action, ids, who)
        if refusal:
            status, why = refusal
            logger.warning(
                "console action refused: %s",
                why,
                extra={
                    "event": "console_action",
                    "action": action,
                    "queue": queue,
                    "ids": ids,
                    "who": who,
                    "remote": remote,
                    "outcome": "refused",
                },
            )
            return status, self.dead(params, notice=f'<p class="bad">Refused: {e(why)}</p>')
        letters = [
            letter
            for redis_id in ids
            for letter in _found(self.client, queue, redis_id, self.max_bytes)
        ]
        if action == "replay":
            now_ms = layout.redis_now_ms(self.client)  # a replay is stamped on Redis's clock
            moves, problems = [], []
            for letter in letters:
                try:
                    message = dlq.fresh_copy(letter, now_ms)
                except dlq.DeadLetterError as error:
                    problems.append(str(error))
                    continue
                new_id = message.options[layout.REDIS_MESSAGE_ID]
                moves.append((letter.redis_id, new_id, message.encode()))
            done = layout.replay_dead_letters(self.client, queue, moves)
        else:
            problems = []
            chosen = [letter.redis_id for letter in letters]
            done = layout.purge_dead_letters(self.client, queue, chosen)
        verb = "replayed" if action == "replay" else "purged"
        logger.info(
            "console %s %d of %d selected dead letters of %s for %s",
            verb,
            done,
            len(ids),
            queue,
            who,
            extra={
                "event": "console_action",
                "action": action,
                "queue": queue,
                "ids": ids,
                "who": who,
                "remote": remote,
                "outcome": verb,
                "count": done,
            },
        )
        said = f"{verb.capitalize()} {done} of {len(ids)} selected dead letters"
        said += "".join(f"; {p}" for p in problems)
        return 200, self.dead(params, notice=f'<p class="ok">{e(said)}.</p>')

    def _refusal(
        self, form: dict[str, list[str]], action: str, ids: list[str], who: str
    ) -> tuple[int, str] | None:
        if not self.token:
            return 403, "the console is read-only (CONSOLE_TOKEN is not set)"
        if not hmac.compare_digest(_one(form, "token").encode(), self.token.encode()):
            return 403, "wrong or missing token; nothing was changed"
        if action not in ("replay", "purge"):
            return 400, "unknown action"
        if _one(form, "confirm") != "yes":
            return 400, "tick the confirmation box; nothing was changed"
        if not who:
            return 400, "give your name (the action is logged with it); nothing was changed"
        if not ids:
            return 400, "select at least one dead letter; nothing was changed"
        return None


class NotFoundError(Exception):
    """A page of something that does not exist (an unknown queue or id)."""


def q_(**params: Any) -> str:
    return q(**params)


def _one(form: dict[str, list[str]], name: str) -> str:
    values = form.get(name) or [""]
    return values[0]


def _found(
    client: redis.Redis, queue: str, redis_id: str, max_bytes: int | None
) -> list[dlq.DeadLetter]:
    try:
        return [dlq.find(client, [queue], redis_id, max_bytes)]
    except dlq.DeadLetterError:
        return []


def _shorter(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _truncate_json(fields: dict[str, Any] | None, name: str, width: int = 80) -> str:
    if not fields or name not in fields:
        return "-"
    text = json.dumps(fields[name])
    return text if len(text) <= width else text[: width - 1] + "…"


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


class ConsoleServer(ThreadingHTTPServer):
    """The console's HTTP server (one thread per request)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], console: Console) -> None:
        super().__init__(address, _Handler)
        self.console = console


class _Handler(BaseHTTPRequestHandler):
    server: ConsoleServer
    server_version = "console"
    sys_version = ""

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        params = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
        console = self.server.console
        routes: dict[str, Callable[[], bytes]] = {
            "/": console.overview,
            "/dead": lambda: console.dead(params),
            "/dead/summary": lambda: console.summary(params),
            "/dead/show": lambda: console.show(params),
            "/schedules": console.schedules,
        }
        if url.path == "/console.css":
            self._send(200, STYLE, "text/css; charset=utf-8")
            return
        route = routes.get(url.path)
        if route is None:
            self._send(404, page("Not found", "<p>No such page.</p>"))
            return
        self._serve(route)

    def do_POST(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/dead/act":
            self._send(404, page("Not found", "<p>No such page.</p>"))
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_FORM_BYTES:
            self._send(413, page("Refused", "<p>The form is too big.</p>"))
            return
        form = urllib.parse.parse_qs(self.rfile.read(length).decode(errors="replace"))
        remote = self.client_address[0]
        result: dict[str, tuple[int, bytes]] = {}

        def act() -> bytes:
            result["done"] = self.server.console.act(form, remote)
            return result["done"][1]

        self._serve(act, status=lambda: result.get("done", (200, b""))[0])

    def _serve(self, route: Callable[[], bytes], status: Callable[[], int] = lambda: 200) -> None:
        import redis

        try:
            body = route()
        except NotFoundError as error:
            self._send(404, page("Not found", f"<p>{e(error)}</p>"))
            return
        except redis.RedisError as error:
            self._send(503, page("Redis failed", f'<p class="bad">{e(error)}</p>'))
            return
        self._send(status(), body)

    def _send(self, status: int, body: bytes, kind: str = "text/html; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("console %s: " + format, self.client_address[0], *args)


def _console(args: argparse.Namespace) -> int:
    from . import logs
    from .settings import load_redis_settings
    from .status import connect

    settings = load_redis_settings()
    logs.configure("{{ cookiecutter.project }}-console", "INFO")
    client, url = connect()
    console = Console(client, pools_queues(), os.environ.get(TOKEN_ENV), settings.max_message_bytes)
    try:
        server = ConsoleServer((args.host, args.port), console)
    except OSError as error:
        print(f"console: cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr)
        return EX_CONFIG
    mode = "actions enabled" if console.token else f"read-only ({TOKEN_ENV} not set)"
    logger.info(
        "console on http://%s:%d/ (%s), Redis at %s",
        args.host,
        server.server_port,
        mode,
        url,
        extra={"event": "console_start"},
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        client.close()
    return EX_OK


def add_command(commands: Any) -> None:
    """Add ``console [--host H] [--port P]`` to the CLI's ``commands`` (argparse subparsers)."""
    console = command_parser(commands, "console", "the web console (read-only by default)", __doc__)
    console.add_argument("--host", default=DEFAULT_HOST, help=f"address (default {DEFAULT_HOST})")
    console.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})"
    )
    console.set_defaults(run=_console)
