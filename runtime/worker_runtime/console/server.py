"""The web console: the queues, the running jobs, the dead letters and the schedules in a page.

    console [--host 127.0.0.1] [--port 9292]

Pages (plain HTML, no script, standard library ``http.server``):

* ``/``: each queue (its pool and live consumers, waiting, delayed, oldest due, in flight,
  dead letters; unserved work flagged) and each worker process (pool, host, pid, running,
  prefetched, delayed, heartbeat, stale) with the jobs it runs (actor, running time,
  progress and note): what ``status`` prints, read by the same function, from Redis alone.
* ``/status.json``: the same, as ``status --json`` prints it.
* ``/jobs?queue=Q&kind=waiting|delayed&page=N&find=T``: the messages waiting on a queue,
  or on its delay queue (``delay=``, retries in their backoff, marked), with their
  arguments, :data:`PAGE_SIZE` a page, one round trip a page; ``find``: only those whose
  actor, job id or redis id holds ``T``, among the first :data:`JOB_FILTER_READS` in line.
* ``/dead?queue=Q&page=N&find=T``: the dead letters of a queue, oldest first,
  :data:`PAGE_SIZE` a page, each with a box to select it; replay or purge the selected
  ones; ``find``: only those whose actor, reason, job id or redis id holds ``T``.
* ``/dead/summary?queue=Q``: the dead letters counted by actor and reason (read in pages).
* ``/dead/show?queue=Q&id=ID``: one dead letter: reason, traceback as lines, message.
* ``/activity``: each queue's last hour, a bar a minute: jobs done and failed, and the
  oldest due age the workers saw (counters the workers keep in Redis, an hour of them).
* ``/schedules``: each schedule of pools.toml, its next fire times and last runs.
* ``/capacity``: each queue's last ``capacity`` result (:func:`.layout.capacity_key`) as a
  chart drawn here (inline SVG: jobs/s against concurrency, every round, where it stops
  rising) and a table.

Also mountable in the exporter: with ``CONSOLE_IN_EXPORTER=true`` the worker's exporter
serves the same pages under ``/console/`` on ``METRICS_PORT`` (:data:`EXPORTER_PREFIX`),
with the same token, headers and escaping (off by default).

Read-only unless ``CONSOLE_TOKEN`` is set. An action needs that token typed into its
form, the box "I have reviewed ..." ticked, and the operator's name: ``POST /dead/act``
replays or purges the selected dead letters, every one matching the page's filter, or a
whole group of the summary; ``POST /jobs/act`` cancels the selected jobs (waiting or
delayed on ``/jobs``, running on the overview); ``POST /queues/act`` pauses or resumes the
queue chosen on the overview (as ``pause`` and ``resume`` do). It acts on what was
chosen and nothing else, and is logged (one JSON line: event ``console_action``, who, from
where, what, how many moved). A refused action changes nothing and says why (403 without
the token or with a wrong one, 400 without the confirmation or a selection).

It binds 127.0.0.1 by default: reach it with ``kubectl port-forward``. Every response
carries ``Content-Security-Policy: default-src 'none'`` (no script, no frame, no form
posted elsewhere), ``X-Frame-Options: DENY``, ``X-Content-Type-Options: nosniff``,
``Referrer-Policy: no-referrer`` and ``Cache-Control: no-store``; everything shown is
escaped (job arguments and tracebacks are untrusted input).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from ..cli.args import command_parser
from ..exitcodes import EX_CONFIG, EX_OK
from ..service import current
from ..status import pools_file, pools_queues
from . import actions
from .chrome import STYLE, TOKEN_ENV, NotFoundError, e
from .pages import Console

if TYPE_CHECKING:
    from ..exporter import Mount
    from ..settings import WorkerSettings

logger = logging.getLogger(__name__)

#: Where the exporter mounts the console (``CONSOLE_IN_EXPORTER``).
EXPORTER_PREFIX = "/console"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9292
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


def serve(handler: BaseHTTPRequestHandler, console: Console, method: str) -> None:
    """Answer ``handler``'s request (``GET`` or ``POST``) with ``console``'s pages, whose
    paths start with :attr:`Console.prefix`: the console's own server and the exporter
    (which mounts it) both call this, so both send the same pages and headers."""
    url = urllib.parse.urlsplit(handler.path)
    path = url.path[len(console.prefix) :] if url.path.startswith(console.prefix) else None
    path = "/" if path == "" else path
    if method == "POST":
        _post(handler, console, path)
        return
    params = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
    routes: dict[str, Callable[[], bytes]] = {
        "/": lambda: console.overview(params),
        "/dead": lambda: console.dead(params),
        "/jobs": lambda: console.jobs(params),
        "/dead/summary": lambda: console.summary(params),
        "/dead/show": lambda: console.show(params),
        "/schedules": console.schedules,
        "/capacity": console.capacity,
        "/activity": console.activity,
    }
    if path == "/console.css":
        send(handler, 200, STYLE, "text/css; charset=utf-8")
        return
    if path == "/status.json":
        _answer(handler, console, console.status_json, kind="application/json")
        return
    route = routes.get(path or "")
    if route is None:
        send(handler, 404, console.page("Not found", "<p>No such page.</p>"))
        return
    _answer(handler, console, route)


def _post(handler: BaseHTTPRequestHandler, console: Console, path: str | None) -> None:
    acts: dict[str, Callable[[Console, dict[str, list[str]], str], tuple[int, bytes]]] = {
        "/dead/act": actions.dead,
        "/jobs/act": actions.jobs,
        "/queues/act": actions.queues,
    }
    if path not in acts:
        send(handler, 404, console.page("Not found", "<p>No such page.</p>"))
        return
    try:
        length = int(handler.headers.get("Content-Length") or 0)
    except ValueError:
        length = -1
    if not 0 <= length <= MAX_FORM_BYTES:
        send(handler, 413, console.page("Refused", "<p>The form is too big.</p>"))
        return
    form = urllib.parse.parse_qs(handler.rfile.read(length).decode(errors="replace"))
    remote = handler.client_address[0]
    result: dict[str, tuple[int, bytes]] = {}

    def act() -> bytes:
        result["done"] = acts[path](console, form, remote)
        return result["done"][1]

    _answer(handler, console, act, status=lambda: result.get("done", (200, b""))[0])


def _answer(
    handler: BaseHTTPRequestHandler,
    console: Console,
    route: Callable[[], bytes],
    status: Callable[[], int] = lambda: 200,
    kind: str = "text/html; charset=utf-8",
) -> None:
    import redis

    try:
        body = route()
    except NotFoundError as error:
        send(handler, 404, console.page("Not found", f"<p>{e(error)}</p>"))
        return
    except redis.RedisError as error:
        send(handler, 503, console.page("Redis failed", f'<p class="bad">{e(error)}</p>'))
        return
    send(handler, status(), body, kind)


def send(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: bytes,
    kind: str = "text/html; charset=utf-8",
) -> None:
    """Send ``body`` with the :data:`SECURITY_HEADERS`."""
    from ..exporter import send as send_with

    send_with(handler, status, body, kind, SECURITY_HEADERS)


class ConsoleServer(ThreadingHTTPServer):
    """The console's own HTTP server (one thread per request)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], console: Console) -> None:
        super().__init__(address, _Handler)
        self.console = console


class _Handler(BaseHTTPRequestHandler):
    server: ConsoleServer
    server_version = "console"
    sys_version = ""

    def do_GET(self) -> None:
        serve(self, self.server.console, "GET")

    def do_POST(self) -> None:
        serve(self, self.server.console, "POST")

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("console %s: " + format, self.client_address[0], *args)


def exporter_mount(settings: WorkerSettings) -> dict[str, Mount]:
    """The console as the exporter mounts it (``CONSOLE_IN_EXPORTER``): its pages under
    :data:`EXPORTER_PREFIX` on ``METRICS_PORT``, every queue of pools.toml, on a Redis client
    of its own (a page of dead letters must not hold up a scrape), read-only unless
    ``CONSOLE_TOKEN`` is set."""
    from ..redisclient import connect

    client = connect(
        settings.redis_url.get_secret_value(), socket_timeout=10, socket_connect_timeout=5
    )
    console = Console(
        client,
        pools_queues(),
        os.environ.get(TOKEN_ENV),
        settings.max_message_bytes,
        prefix=EXPORTER_PREFIX,
        file=pools_file(),
    )
    logger.info(
        "console mounted at %s/ on the metrics port (%s)",
        EXPORTER_PREFIX,
        "actions enabled" if console.token else f"read-only: {TOKEN_ENV} is not set",
        extra={"event": "console_start", "port": settings.metrics_port},
    )
    return {EXPORTER_PREFIX: lambda handler, method: serve(handler, console, method)}


def _console(args: argparse.Namespace) -> int:
    from .. import logs
    from ..settings import load_redis_settings
    from ..status import connect

    settings = load_redis_settings()
    logs.configure(f"{current().project}-console", settings.log_level, settings.log_format)
    client, url = connect()
    console = Console(
        client,
        pools_queues(),
        os.environ.get(TOKEN_ENV),
        settings.max_message_bytes,
        file=pools_file(),
    )
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
