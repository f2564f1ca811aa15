"""What every page of the console shares: the page chrome (:meth:`Chrome.page`: the
navigation, the style sheet :data:`STYLE`, the meta refresh), the HTML helpers (:func:`e`,
:func:`q`, :func:`table`), the links, the action fieldset and the filter form, and the
console's state (:class:`Chrome`, which :class:`.pages.Console` assembles the pages on)."""

from __future__ import annotations

import html
import urllib.parse
from typing import TYPE_CHECKING, Any

from ..service import current

if TYPE_CHECKING:
    import redis

    from ..pools import PoolsFile

#: The variable that enables actions; unset (or empty): the console is read-only.
TOKEN_ENV = "CONSOLE_TOKEN"  # noqa: S105  (a variable's name, not a secret)
STYLE = b"""
:root { color-scheme: light dark; --fg: #222; --bg: #fff; --muted: #666; --line: #ddd;
        --code: #f6f6f6; --bad: #a00; --ok: #070; --link: #1f5fa8; }
@media (prefers-color-scheme: dark) {
  :root { --fg: #ddd; --bg: #16181c; --muted: #999; --line: #333; --code: #22252b;
          --bad: #ff7b72; --ok: #56d364; --link: #79b8ff; }
}
body { font-family: system-ui, sans-serif; margin: 1.5em; color: var(--fg);
       background: var(--bg); }
a { color: var(--link); }
nav a { margin-right: 1em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border-bottom: 1px solid var(--line); padding: 0.25em 0.6em; text-align: left;
         vertical-align: top; }
td.n, th.n { text-align: right; }
pre { background: var(--code); padding: 0.6em; overflow-x: auto; white-space: pre-wrap; }
.note { color: var(--muted); } .bad { color: var(--bad); } .ok { color: var(--ok); }
fieldset { margin-top: 1em; }
svg.activity-chart { width: 100%; max-width: 600px; height: 120px; display: block; }
svg.chart { max-width: 100%; height: auto; display: block; }
@media (max-width: 640px) {
  body { margin: 0.6em; }
  nav a { display: inline-block; margin: 0 0.8em 0.4em 0; }
  table, tbody, tr, td { display: block; width: 100%; box-sizing: border-box; }
  thead { display: none; }
  tr { border: 1px solid var(--line); margin-bottom: 0.6em; padding: 0.2em 0; }
  td { border: none; padding: 0.15em 0.6em; overflow-wrap: anywhere; }
  td.n { text-align: left; }
  td[data-label]:not([data-label=""])::before { content: attr(data-label) ": ";
    color: var(--muted); }
  input, button { font-size: 1em; }
}
"""


def e(value: Any) -> str:
    """``value`` as escaped HTML text (quotes too: safe in an attribute)."""
    return html.escape(str(value), quote=True)


def q(**params: Any) -> str:
    """A query string of ``params``."""
    return urllib.parse.urlencode(params)


def table(header: list[str], rows: list[list[str]], numeric: set[int] | None = None) -> str:
    """An HTML table; the cells of ``rows`` are HTML already (escape what goes in). Each
    cell carries its column's name (``data-label``): a narrow screen shows the rows as
    cards, each value under its name."""
    numeric = numeric or set()

    def cls(index: int) -> str:
        return ' class="n"' if index in numeric else ""

    head = "".join(f"<th{cls(i)}>{e(h)}</th>" for i, h in enumerate(header))
    labels = [f' data-label="{e(h)}"' for h in header]
    body = "".join(
        "<tr>"
        + "".join(
            f"<td{cls(i)}{labels[i] if i < len(labels) else ''}>{cell}</td>"
            for i, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class NotFoundError(Exception):
    """A page of something that does not exist (an unknown queue or id)."""


class Chrome:
    """The console's state and what every page shares, on ``client`` for ``queues``.

    Parameters:
      client: a Redis client (``REDIS_URL``).
      queues: the queues shown (default: every queue of pools.toml).
      token: ``CONSOLE_TOKEN``; None or empty: read-only.
      max_bytes: ``MAX_MESSAGE_BYTES`` (a dead letter over it shows its size as its reason).
      prefix: the path the pages are served under (default ``""``: the root; the exporter
        mounts them under :data:`EXPORTER_PREFIX`).
      file: pools.toml (each queue's pool; default: none known).
    """

    def __init__(
        self,
        client: redis.Redis,
        queues: list[str],
        token: str | None,
        max_bytes: int | None = None,
        prefix: str = "",
        file: PoolsFile | None = None,
    ) -> None:
        self.client = client
        self.queues = queues
        self.file = file
        self.token = token or None
        self.max_bytes = max_bytes
        self.prefix = prefix.rstrip("/")

    def link(self, path: str, **params: Any) -> str:
        """The escaped href of page ``path`` with ``params`` (under :attr:`prefix`)."""
        return e(self.prefix + path + (f"?{q(**params)}" if params else ""))

    def page(self, title: str, body: str, refresh_s: int | None = None) -> bytes:
        """A whole page: ``title`` (escaped here) and ``body`` (HTML already); reloaded
        every ``refresh_s`` seconds when given (a meta refresh: no script, the CSP holds)."""
        nav = "".join(
            f'<a href="{self.link(path)}">{e(name)}</a>'
            for path, name in (
                ("/", "Queues and workers"),
                ("/activity", "Activity"),
                ("/schedules", "Schedules"),
                ("/capacity", "Capacity"),
            )
        )
        return (
            "<!doctype html><html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            + (f'<meta http-equiv=refresh content="{refresh_s}">' if refresh_s else "")
            + f"<title>{e(title)} - {e(current().project)}</title>"
            f'<link rel=stylesheet href="{self.link("/console.css")}"></head><body>'
            f"<nav>{nav}</nav><h1>{e(title)}</h1>{body}</body></html>"
        ).encode()

    def _action_fields(self, what: str, buttons: str) -> str:
        """The fieldset of an action on ``what``: the operator's name (logged), the token,
        the confirmation, and ``buttons`` (HTML); read-only: a note instead."""
        if not self.token:
            return (
                '<p class="note">Read-only: actions (replay, purge, cancel, pause, resume) '
                "need CONSOLE_TOKEN set where the console runs.</p>"
            )
        return (
            f"<fieldset><legend>Act on {e(what)}</legend>"
            "<label>Your name <input name=who required maxlength=80 autocomplete=off></label> "
            "<label>Token <input type=password name=token required autocomplete=off></label> "
            "<label><input type=checkbox name=confirm value=yes required> "
            f"I have reviewed {e(what)}</label> {buttons}</fieldset>"
        )

    def _search(self, path: str, hidden: dict[str, str], sought: str, what: str) -> str:
        """The filter form of page ``path`` (``GET``, ``find``; ``hidden``: the page's other
        parameters kept), showing ``sought``; ``what``: what it searches (a placeholder)."""
        return (
            f'<form method=get action="{self.link(path)}" class="search">'
            + "".join(
                f'<input type=hidden name="{e(name)}" value="{e(value)}">'
                for name, value in hidden.items()
            )
            + f'<label>Find <input name=find value="{e(sought)}" maxlength=200 '
            f'placeholder="{e(what)}"></label> '
            "<button>Filter</button></form>"
        )

    def queue_of(self, params: dict[str, str]) -> str:
        """The queue ``params`` names (``queue``); NotFoundError unless it is shown here."""
        queue = params.get("queue", "")
        if queue not in self.queues:
            raise NotFoundError(f"no queue {queue!r} in pools.toml")
        return queue


def iso_ms(ms: int) -> str:
    """``ms`` (milliseconds since the epoch) as an ISO time, UTC."""
    from ..scheduling.schedules import utc_iso

    return utc_iso(ms / 1000)
