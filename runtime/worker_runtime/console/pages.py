"""The console's pages: HTML of the overview (with ``/status.json``), the waiting and
delayed jobs, the activity of the last hour, the dead letters, a dead letter, the summary,
the schedules and the capacity chart, with the forms of the actions (:class:`Console`);
:mod:`.actions` does what a form posts, :mod:`.server` serves them."""

from __future__ import annotations

import html
import itertools
import json
import math
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

from .. import layout
from ..deadletters import store as dlq
from ..service import current
from ..status import (
    Status,
    duration,
    heartbeat_text,
    job_text,
    read_status,
    unserved_text,
)

if TYPE_CHECKING:
    import redis

    from ..pools import PoolsFile


T = TypeVar("T")

#: The variable that enables actions; unset (or empty): the console is read-only.
TOKEN_ENV = "CONSOLE_TOKEN"  # noqa: S105  (a variable's name, not a secret)
#: Dead letters per page of ``/dead``.
PAGE_SIZE = 50
#: Dead letters a filtered page reads at most (a search across more says so).
FILTER_READS = 100_000
#: Waiting or delayed jobs a filtered ``/jobs`` page reads at most, the first in line (a
#: search across more says so), and how many it reads a round trip.
JOB_FILTER_READS, FILTER_WINDOW = 10_000, 1_000
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


class Console:
    """What the pages show and what the actions do, on ``client`` for ``queues``.

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

    # -- pages ------------------------------------------------------------------------

    def status(self) -> Status:
        """What ``status`` reads (:func:`.status.read_status`): the console shows the same."""
        return read_status(self.client, self.queues, self.file)

    def status_json(self) -> bytes:
        """``/status.json``: the :meth:`status` as ``status --json`` prints it."""
        return json.dumps(self.status().as_dict()).encode()

    def _queue_choice(self, queue: str) -> str:
        """A queue's name in the overview; with actions enabled, a button to choose it (for
        pause or resume)."""
        if not self.token:
            return e(queue)
        return (
            f'<label><input type=radio name=queue value="{e(queue)}" required '
            f'aria-label="select queue {e(queue)}"> {e(queue)}</label>'
        )

    def _queue_form(self, queues: str) -> str:
        """The overview's queue table; with actions enabled, in a form that pauses or
        resumes the queue chosen (``POST /queues/act``)."""
        if not self.token:
            return queues
        return (
            f'<form method=post action="{self.link("/queues/act")}">'
            + queues
            + self._action_fields(
                "the selected queue",
                "<button name=action value=pause>Pause queue</button> "
                "<button name=action value=resume>Resume queue</button>",
            )
            + "</form>"
        )

    def _job_choice(self, message_id: str) -> str:
        """With actions enabled, a box to choose a running job (to cancel it); else nothing."""
        if not self.token or not message_id:
            return ""
        return (
            f'<input type=checkbox name=id value="{e(message_id)}" '
            f'aria-label="select running job {e(message_id)}"> '
        )

    def _running_form(self, processes: str, running: bool) -> str:
        """The overview's process table; with actions enabled and a job ``running``, in a
        form that cancels the running jobs chosen (``POST /jobs/act``, ``kind=running``)."""
        if not self.token or not running:
            return processes
        return (
            f'<form method=post action="{self.link("/jobs/act")}">'
            "<input type=hidden name=kind value=running>"
            + processes
            + self._action_fields(
                "the selected running jobs",
                "<button name=action value=cancel>Cancel selected</button>",
            )
            + "</form>"
        )

    def overview(self, params: dict[str, str] | None = None, notice: str = "") -> bytes:
        refresh_s = _refresh(params or {})
        status = self.status()
        queues = table(
            [
                "queue",
                "pool",
                "consumers",
                "waiting",
                "delayed",
                "oldest due",
                "in flight",
                "dead letters",
            ],
            [
                [
                    self._queue_choice(q.queue)
                    + (' <strong class="bad">unserved</strong>' if q.unserved else "")
                    + (' <strong class="note">paused</strong>' if q.paused else "")
                    + (
                        f' <span class="note">throttled ({e(q.throttled)})</span>'
                        if q.throttled
                        else ""
                    ),
                    e(q.pool),
                    e(q.consumers),
                    f'<a href="{self.link("/jobs", queue=q.queue)}">{e(q.waiting)}</a>',
                    f'<a href="{self.link("/jobs", queue=q.queue, kind="delayed")}">'
                    f"{e(q.delayed)}</a>",
                    e(duration(q.oldest_due_s) if q.waiting or q.oldest_due_s else "-"),
                    e(q.inflight),
                    f'<a href="{self.link("/dead", queue=q.queue)}">{e(q.dead_letters)}</a>',
                ]
                for q in status.queues
            ],
            numeric={2, 3, 4, 6, 7},
        )
        flagged = "".join(
            f'<p class="bad unserved">Unserved: {e(unserved_text(q))}.</p>' for q in status.unserved
        )
        rows = []
        for p in status.processes:
            jobs = "<br>".join(
                self._job_choice(job.message_id) + f'<span class="job">{e(job_text(job))}</span> '
                f'<span class="note">{e(job.message_id)}</span>'
                + (
                    f' <progress max=1 value="{job.progress:.4f}">{job.progress:.0%}</progress>'
                    if job.progress is not None
                    else ""
                )
                for job in p.jobs
            )
            running = f"{len(p.jobs)}/{p.concurrency}" if p.concurrency else str(len(p.jobs))
            beat = heartbeat_text(p)
            beat_cell = f'<span class="bad">{e(beat)}</span>' if not p.live else e(beat)
            rows.append(
                [
                    e(p.pool),
                    e(p.host),
                    e(p.pid or "-"),
                    e(running),
                    e(p.prefetched),
                    e(p.delayed),
                    beat_cell,
                    jobs or "-",
                ]
            )
        processes = (
            self._running_form(
                table(
                    [
                        "pool",
                        "host",
                        "pid",
                        "running",
                        "prefetched",
                        "delayed",
                        "heartbeat",
                        "running jobs",
                    ],
                    rows,
                    numeric={3, 4, 5},
                ),
                any(p.jobs for p in status.processes),
            )
            if rows
            else '<p class="note">No worker process has a heartbeat in Redis.</p>'
        )
        mode = (
            "Actions are enabled (CONSOLE_TOKEN is set)."
            if self.token
            else "Read-only: set CONSOLE_TOKEN to enable actions (replay, purge, cancel, "
            "pause, resume)."
        )
        toggle = (
            f'Auto-refresh every {refresh_s} s: <a href="{self.link("/")}">stop</a>'
            if refresh_s
            else "Auto-refresh: "
            + " ".join(
                f'<a href="{self.link("/", refresh=every)}">{every} s</a>' for every in (5, 30)
            )
        )
        return self.page(
            "Queues and workers",
            f'<p class="note">{e(mode)} Redis time {e(_iso_ms(status.now_ms))}. {toggle}</p>'
            + (notice or "")
            + f"<h2>Queues</h2>{flagged}{self._queue_form(queues)}{_downstreams(status)}"
            f"<h2>Worker processes</h2>{processes}",
            refresh_s,
        )

    def jobs(self, params: dict[str, str], notice: str = "") -> bytes:
        """``/jobs?queue=Q&kind=waiting|delayed&page=N&find=T``: the messages waiting on a
        queue (or its delay queue: ``delay=`` and retries in their backoff), in line order,
        :data:`PAGE_SIZE` a page, one round trip a page however many wait; ``find``: only
        those whose actor, job id or redis id holds ``T`` (any case), among the first
        :data:`JOB_FILTER_READS` in line (read :data:`FILTER_WINDOW` a round trip)."""
        queue = self.queue_of(params)
        kind = "delayed" if params.get("kind") == "delayed" else "waiting"
        number = _page_number(params)
        sought = _sought(params)
        listed = layout.delay_queue(queue) if kind == "delayed" else queue
        if sought:
            total, line = _line(self.client, listed, JOB_FILTER_READS)
            entries, matching, read = page_of(
                line, lambda job: _job_matches(job, sought), number, JOB_FILTER_READS
            )
        else:
            total, page = layout.waiting_page(self.client, listed, number * PAGE_SIZE, PAGE_SIZE)
            entries = [
                _Waiting.of(position, redis_id, body)
                for position, (redis_id, body) in enumerate(page, number * PAGE_SIZE + 1)
            ]
            matching, read = total, total
        now_ms = time.time() * 1000
        rows = []
        for job in entries:
            fields = job.fields
            options = (fields or {}).get("options")
            options = options if isinstance(options, dict) else {}
            retries = options.get(layout.RETRIES)
            due = options.get("eta") or (fields or {}).get("message_timestamp")
            when = (
                duration(abs(now_ms - due) / 1000) + (" ago" if due <= now_ms else " from now")
                if isinstance(due, int | float) and not isinstance(due, bool)
                else "-"
            )
            message_id = job.message_id
            rows.append(
                [
                    (
                        f'<input type=checkbox name=id value="{e(message_id)}" '
                        f'aria-label="select {e(message_id)}">'
                        if self.token and message_id
                        else ""
                    ),
                    e(job.position),
                    e(job.redis_id),
                    e(message_id or "-"),
                    e(job.actor or "-"),
                    e(f"retry {retries}" if isinstance(retries, int) and retries else "-"),
                    e(("due " if kind == "delayed" else "sent ") + when),
                    f"<code>{e(dlq.arguments_text(fields))}</code>"
                    if not job.taken
                    else '<span class="note">(taken meanwhile)</span>',
                ]
            )
        pages = max(1, -(-matching // PAGE_SIZE))
        kept = {"find": sought} if sought else {}
        links = [
            f'<a href="{self.link("/jobs", queue=queue, kind=other, **kept)}">{e(other)}</a>'
            for other in ("waiting", "delayed")
            if other != kind
        ]
        if number > 0:
            previous = self.link("/jobs", queue=queue, kind=kind, page=number - 1, **kept)
            links.append(f'<a href="{previous}">previous</a>')
        if number + 1 < pages:
            following = self.link("/jobs", queue=queue, kind=kind, page=number + 1, **kept)
            links.append(f'<a href="{following}">next</a>')
        header = ["", "#", "redis id", "message id", "actor", "retry", "when", "arguments"]
        listing = (
            table(header, rows)
            if rows
            else f'<p class="note">Nothing {e(kind)} on {e(queue)}'
            + (f" matches {e(repr(sought))}" if sought else "")
            + ".</p>"
        )
        acting = (
            self._action_fields(
                "the selected jobs", "<button name=action value=cancel>Cancel selected</button>"
            )
            if rows
            else ""
        )
        found = _found(sought, matching, read, total, "first")
        return self.page(
            f"{kind.capitalize()} jobs: {queue}",
            (notice or "")
            + self._search(
                "/jobs", {"queue": queue, "kind": kind}, sought, "actor, job id or redis id"
            )
            + f"<p>{e(total)} {e(kind)} on {e(queue)}; {e(found)}page {e(number + 1)} of "
            f"{e(pages)}, {'in line order' if kind == 'waiting' else 'by due time'}. "
            f"{' '.join(links)}</p>"
            + f'<form method=post action="{self.link("/jobs/act")}">'
            + f'<input type=hidden name=queue value="{e(queue)}">'
            + f'<input type=hidden name=kind value="{e(kind)}">'
            + (f'<input type=hidden name=find value="{e(sought)}">' if sought else "")
            + listing
            + acting
            + "</form>",
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

    def activity(self) -> bytes:
        """``/activity``: each queue's last hour, a minute a bar: jobs done and failed (the
        workers' passes count them, :func:`.layout.record_activity`) and the oldest due age
        they saw; drawn here as inline SVG, one round trip for every queue."""
        now_ms = layout.redis_now_ms(self.client)
        found = layout.read_activity(self.client, self.queues, now_ms)
        sections = []
        for queue, minutes in found.items():
            done = sum(m[1] for m in minutes)
            failed = sum(m[2] for m in minutes)
            ages = [m[3] for m in minutes if m[3] is not None]
            said = (
                f"Last hour: {done:,} done, {failed:,} failed"
                + (f"; oldest due age up to {duration(max(ages) / 1000)}" if ages else "")
                + "."
            )
            sections.append(
                f'<section class="activity"><h2>{e(queue)}</h2><p>{e(said)}</p>'
                + activity_chart(minutes)
                + "</section>"
            )
        body = (
            '<p class="note">A bar a minute, the last hour (Redis time): jobs done (blue) and '
            "failed (red: retried or dead-lettered), and the oldest due message's age the "
            "workers saw (grey line, its own scale). Workers add to it at each recovery pass, "
            "idle ones once a minute.</p>" + "".join(sections)
        )
        return self.page("Activity, last hour", body)

    def queue_of(self, params: dict[str, str]) -> str:
        """The queue ``params`` names (``queue``); NotFoundError unless it is shown here."""
        queue = params.get("queue", "")
        if queue not in self.queues:
            raise NotFoundError(f"no queue {queue!r} in pools.toml")
        return queue

    def dead(self, params: dict[str, str], notice: str = "") -> bytes:
        queue = self.queue_of(params)
        number = _page_number(params)
        sought = _sought(params)
        total = dlq.count(self.client, queue)
        if sought:
            letters, matching, read = page_of(
                dlq.stream(self.client, queue, self.max_bytes),
                lambda letter: dlq.matches(letter, sought),
                number,
                FILTER_READS,
            )
        else:
            letters = dlq.read_page(
                self.client, queue, number * PAGE_SIZE, PAGE_SIZE, self.max_bytes
            )
            matching, read = total, total
        rows = [
            [
                f'<input type=checkbox name=id value="{e(letter.redis_id)}" '
                f'aria-label="select {e(letter.redis_id)}">',
                f'<a href="{self.link("/dead/show", queue=queue, id=letter.redis_id)}">'
                f"{e(letter.redis_id)}</a>",
                e(letter.actor),
                e(letter.died),
                e(_shorter(letter.reason, 120)),
                f"<code>{e(dlq.arguments_text(letter.fields))}</code>",
            ]
            for letter in letters
        ]
        pages = max(1, -(-matching // PAGE_SIZE))
        kept = {"find": sought} if sought else {}
        links = []
        if number > 0:
            previous = self.link("/dead", queue=queue, page=number - 1, **kept)
            links.append(f'<a href="{previous}">newer</a>')
        if number + 1 < pages:
            following = self.link("/dead", queue=queue, page=number + 1, **kept)
            links.append(f'<a href="{following}">older</a>')
        links.append(f'<a href="{self.link("/dead/summary", queue=queue)}">summary</a>')
        listing = (
            table(["", "redis id", "actor", "dead since", "reason", "arguments"], rows)
            if rows
            else '<p class="note">No dead letters here.</p>'
        )
        found = _found(sought, matching, read, total, "oldest")
        search = self._search(
            "/dead", {"queue": queue}, sought, "actor, reason, job id or redis id"
        )
        body = (
            (notice or "")
            + search
            + f"<p>{e(total)} dead letters on {e(queue)}; {e(found)}page {e(number + 1)} of "
            + f"{e(pages)}, oldest first. "
            + " ".join(links)
            + "</p>"
            + f'<form method=post action="{self.link("/dead/act")}">'
            + f'<input type=hidden name=queue value="{e(queue)}">'
            + (f'<input type=hidden name=find value="{e(sought)}">' if sought else "")
            + listing
            + self._action_fields(
                "the selected dead letters", _dead_buttons(matching if sought else 0, read >= total)
            )
            + "</form>"
        )
        return self.page(f"Dead letters: {queue}", body)

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

    def summary(self, params: dict[str, str], notice: str = "") -> bytes:
        queue = self.queue_of(params)
        counted = dlq.Summary()
        for letter in dlq.stream(self.client, queue, self.max_bytes):
            counted.add(letter)
        kinds = counted.rows(100)
        rows = [
            [
                (
                    f'<input type=radio name=group value="{e(_group_value(r))}" '
                    f'aria-label="select this group" required>'
                    if self.token and r["reason"] != dlq.Summary.OTHER
                    else ""
                ),
                e(f"{r['count']:,}"),
                e(r["actor"]),
                e(r["exception"]),
                e(r["reason"]),
            ]
            for r in kinds
        ]
        listing = table(["", "count", "actor", "exception", "reason"], rows, numeric={1})
        fields = self._action_fields(
            "every dead letter of the selected group",
            "<button name=action value=replay-group>Replay all of this group</button>",
        )
        body = (
            (notice or "")
            + f"<p>{e(counted.total)} dead letters on {e(queue)}, grouped by actor, exception "
            "and reason (numbers, ids and quoted values masked). "
            f'<a href="{self.link("/dead", queue=queue)}">list</a></p>'
            + f'<form method=post action="{self.link("/dead/act")}">'
            + f'<input type=hidden name=queue value="{e(queue)}">'
            + listing
            + fields
            + "</form>"
        )
        return self.page(f"Dead letters by actor and reason: {queue}", body)

    def show(self, params: dict[str, str]) -> bytes:
        queue = self.queue_of(params)
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
                f'<form method=post action="{self.link("/dead/act")}">'
                f'<input type=hidden name=queue value="{e(queue)}">'
                f'<input type=hidden name=id value="{e(letter.redis_id)}">'
                + self._action_fields("this dead letter", _DEAD_BUTTONS)
                + "</form>"
            )
        return self.page(f"Dead letter {letter.redis_id}", body)

    def schedules(self) -> bytes:
        from ..scheduling.schedules import schedule_rows
        from ..settings import pools

        schedules = dict(pools().schedules)
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
        return self.page("Schedules", body)

    def capacity(self) -> bytes:
        """Each queue's last ``capacity`` result: a chart and a table (none: how to get one)."""
        stored = self.client.mget([layout.capacity_key(queue) for queue in self.queues])
        sections = []
        for queue, raw in zip(self.queues, stored, strict=True):
            if raw is None:
                continue
            result = layout.message_fields(raw)
            levels = _levels(result)
            if result is None or not levels:
                sections.append(
                    f"<h2>{e(queue)}</h2><p class=bad>The stored result is not readable.</p>"
                )
                continue
            knee = result.get("stops_rising_at")
            measured = result.get("measured_at_ms")
            said = (
                f"Actor {result.get('actor', '-')}, {result.get('jobs', '-')} jobs per level, "
                f"best of {result.get('rounds', '-')} rounds"
                + (f", measured {_iso_ms(measured)}" if isinstance(measured, int) else "")
                + ". "
                + (
                    f"Throughput stops rising at concurrency {knee}."
                    if knee is not None
                    else "Throughput still rises at the highest level measured."
                )
            )
            rows = [
                [
                    e(c),
                    e(f"{rate:.1f}"),
                    e(" ".join(f"{r:.1f}" for r in rounds)),
                ]
                for c, rate, rounds in levels
            ]
            warnings = "".join(
                f'<p class="bad warning">Warning: {e(line)}.</p>' for line in _warnings(result)
            )
            verdict = result.get("verdict")
            sections.append(
                f"<h2>{e(queue)}</h2><p>{e(said)}</p>{warnings}"
                + (f'<p class="verdict">{e(verdict)}</p>' if isinstance(verdict, str) else "")
                + capacity_chart(levels, knee if isinstance(knee, int) else None)
                + table(["concurrency", "jobs/s", "rounds"], rows, numeric={0, 1})
            )
        body = "".join(sections) or (
            '<p class="note">No capacity result stored: run <code>capacity --actor NAME</code> '
            "against this Redis (a queue with no other worker); the last result of each queue "
            "is shown here.</p>"
        )
        return self.page("Capacity", body)


class NotFoundError(Exception):
    """A page of something that does not exist (an unknown queue or id)."""


#: The auto-refresh periods a page accepts (``?refresh=S``), seconds.
REFRESH_S = range(2, 601)


def _group_value(row: dict[str, Any]) -> str:
    """A summary row's group as a form carries it (JSON: queue, actor, exception, reason)."""
    return json.dumps([row["queue"], row["actor"], row["exception"], row["reason"]])


#: The buttons of a dead letter (or of the selected ones).
_DEAD_BUTTONS = (
    "<button name=action value=replay>Replay selected</button> "
    "<button name=action value=purge>Purge selected</button>"
)


def _dead_buttons(matching: int, exact: bool) -> str:
    """The dead-letter page's buttons; on a filtered page (``matching`` > 0 letters match the
    filter; ``exact``: every letter was read to count them) also: replay or purge every one
    that matches."""
    if not matching:
        return _DEAD_BUTTONS
    every = f"all {matching:,}" if exact else "all"
    return (
        f"{_DEAD_BUTTONS} <button name=action value=replay-matching>Replay {every} matching"
        f"</button> <button name=action value=purge-matching>Purge {every} matching</button>"
    )


def page_of(
    items: Iterable[T], keep: Callable[[T], bool], number: int, reads: int
) -> tuple[list[T], int, int]:
    """Page ``number`` (:data:`PAGE_SIZE` a page) of ``items`` that ``keep`` keeps, reading
    at most ``reads`` of them: (the page, how many match, how many were read). A filtered
    page's one reader: the dead letters' and the waiting jobs'."""
    first = number * PAGE_SIZE
    page: list[T] = []
    matching = read = 0
    for item in itertools.islice(items, reads):
        read += 1
        if keep(item):
            if first <= matching < first + PAGE_SIZE:
                page.append(item)
            matching += 1
    return page, matching, read


class _Waiting(NamedTuple):
    """A message of ``/jobs``: its place in line (from 1), its redis id, its fields (None:
    not readable) and whether it was taken between the two reads of its page."""

    position: int
    redis_id: str
    fields: dict[str, Any] | None
    taken: bool

    @classmethod
    def of(cls, position: int, redis_id: str, body: bytes | None) -> _Waiting:
        fields = layout.message_fields(body) if body is not None else None
        return cls(position, redis_id, fields, body is None)

    @property
    def message_id(self) -> str:
        return str((self.fields or {}).get("message_id", ""))

    @property
    def actor(self) -> str:
        return str((self.fields or {}).get("actor_name", ""))


def _job_matches(job: _Waiting, sought: str) -> bool:
    """Whether a waiting job's actor, job id or redis id holds ``sought`` (any case)."""
    return dlq.holds(sought, job.actor, job.message_id, job.redis_id)


def _line(client: redis.Redis, listed: str, reads: int) -> tuple[int, Iterator[_Waiting]]:
    """How many wait on ``listed`` (a queue or its delay queue), and its first ``reads``
    messages in line, read :data:`FILTER_WINDOW` a round trip as they are consumed."""
    total, window = layout.waiting_page(client, listed, 0, min(FILTER_WINDOW, reads))

    def entries(window: list[tuple[str, bytes | None]]) -> Iterator[_Waiting]:
        start = 0
        while window:
            for offset, (redis_id, body) in enumerate(window):
                yield _Waiting.of(start + offset + 1, redis_id, body)
            start += len(window)
            if len(window) < FILTER_WINDOW or start >= reads:
                return
            size = min(FILTER_WINDOW, reads - start)
            window = layout.waiting_page(client, listed, start, size)[1]

    return total, entries(window)


def _found(sought: str, matching: int, read: int, total: int, which: str) -> str:
    """What a filtered page says of its filter (nothing when not filtered): how many match,
    and when it read fewer than all (``which`` it read: ``oldest``...), that it did."""
    if not sought:
        return ""
    short = f" (of the {which} {read} read; narrow the search)" if read < total else ""
    return f"{matching} of them match {sought!r}{short}; "


def _sought(params: dict[str, str]) -> str:
    """What a page is filtered by (``?find=T``, trimmed, at most 200 characters)."""
    return params.get("find", "").strip()[:200]


def _page_number(params: dict[str, str]) -> int:
    """The page asked for (``?page=N``, from 0; anything else: the first)."""
    page = params.get("page", "")
    return int(page) if page.isdigit() else 0


def _refresh(params: dict[str, str]) -> int | None:
    """The page's ``refresh`` period (seconds) when it is one of :data:`REFRESH_S`."""
    try:
        every = int(params.get("refresh", ""))
    except ValueError:
        return None
    return every if every in REFRESH_S else None


def _downstreams(status: Status) -> str:
    """The downstream budgets in use (flow control, read with the status), or nothing."""
    if not status.downstreams:
        return ""
    rows = [
        [
            e(d.name),
            e(f"{d.in_use}/{d.limit}"),
            e("-" if d.calls_per_s is None else f"{d.calls_per_s:g}/s"),
            e(", ".join(f"{q} ({why})" for q, why in sorted(d.throttled.items())) or "-"),
        ]
        for d in status.downstreams
    ]
    return "<h2>Downstream budgets</h2>" + table(
        ["downstream", "in use", "rate", "throttled"], rows, numeric={1}
    )


def _iso_ms(ms: int) -> str:
    from ..scheduling.schedules import utc_iso

    return utc_iso(ms / 1000)


def _levels(result: dict[str, Any] | None) -> list[tuple[int, float, list[float]]]:
    """(concurrency, jobs/s, rounds) of each level of a stored ``capacity`` result, lowest
    first; those not made of numbers left out (the record comes from Redis)."""
    found = []
    for level in (result or {}).get("levels") or []:
        if not isinstance(level, dict):
            continue
        c, rate, rounds = level.get("concurrency"), level.get("jobs_per_s"), level.get("rounds")
        numbers = [float(r) for r in rounds if _finite(r)] if isinstance(rounds, list) else []
        if isinstance(c, int) and not isinstance(c, bool) and _finite(rate):
            found.append((c, float(cast(float, rate)), numbers))
    return sorted(found)


def _warnings(result: dict[str, Any]) -> list[str]:
    """The warnings ``capacity`` printed with a stored result (its ``warnings``), or, for a
    result stored before it kept them, a line naming its noisy levels."""
    warnings = result.get("warnings")
    if isinstance(warnings, list):
        return [str(line) for line in warnings]
    noisy = result.get("noisy")
    if isinstance(noisy, list) and noisy:
        levels = ", ".join(str(level) for level in noisy)
        return [f"the rounds of concurrency {levels} differ widely: the verdict may be wrong"]
    return []


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


#: The activity chart's size (SVG user units): a bar a minute.
ACTIVITY_W, ACTIVITY_H, ACTIVITY_PAD = 600, 120, 14


def activity_chart(minutes: list[tuple[int, int, int, int | None]]) -> str:
    """A queue's last hour as inline SVG (no script, nothing fetched): a bar a minute of the
    jobs done with the failed ones on top, and a line of the oldest due age on its own
    scale; scales to its box (``viewBox``), every text escaped."""
    top = max([done + failed for _, done, failed, _ in minutes] + [1])
    oldest = max([age for *_, age in minutes if age is not None] + [1])
    step = ACTIVITY_W / max(1, len(minutes))
    height = ACTIVITY_H - 2 * ACTIVITY_PAD
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" viewBox="0 0 {ACTIVITY_W} '
        f'{ACTIVITY_H}" class="activity-chart" preserveAspectRatio="none">'
        f"<title>{e('jobs a minute and the oldest due age, last hour')}</title>",
        f'<text x="2" y="11" font-size="10" fill="currentColor">{e(f"{top:,} a minute")}</text>',
    ]
    points = []
    for index, (minute, done, failed, age) in enumerate(minutes):
        x = index * step
        base = ACTIVITY_PAD + height
        done_h, failed_h = done / top * height, failed / top * height
        label = f"{_iso_ms(minute * 60_000)}: {done} done, {failed} failed"
        if done:
            parts.append(
                f'<rect class="done" x="{x:.1f}" y="{base - done_h:.1f}" width="{step * 0.8:.1f}" '
                f'height="{done_h:.1f}" fill="#1f77b4"><title>{e(label)}</title></rect>'
            )
        if failed:
            parts.append(
                f'<rect class="failed" x="{x:.1f}" y="{base - done_h - failed_h:.1f}" '
                f'width="{step * 0.8:.1f}" height="{failed_h:.1f}" fill="#d62728">'
                f"<title>{e(label)}</title></rect>"
            )
        if age is not None:
            points.append(f"{x + step * 0.4:.1f},{base - age / oldest * height:.1f}")
    if points:
        parts.append(
            f'<polyline class="age" points="{" ".join(points)}" fill="none" stroke="#888"/>'
        )
    parts.append("</svg>")
    return "".join(parts)


#: The chart's size and margins (SVG user units).
CHART_W, CHART_H, CHART_LEFT, CHART_BOTTOM, CHART_PAD = 640, 300, 56, 40, 16


def capacity_chart(levels: list[tuple[int, float, list[float]]], knee: int | None) -> str:
    """Jobs/s against concurrency as inline SVG (no script, nothing fetched): the best
    round of each level joined by a line, every round a dot, the level where throughput
    stops rising (``knee``) marked; levels evenly spaced (they usually double), the y axis
    from 0. Every text in it is escaped."""
    top = max([rate for _, rate, _ in levels] + [r for *_, rounds in levels for r in rounds])
    top = top * 1.1 or 1.0
    width, height = CHART_W - CHART_LEFT - CHART_PAD, CHART_H - CHART_BOTTOM - CHART_PAD
    step = width / max(1, len(levels) - 1) if len(levels) > 1 else 0.0

    def x(index: int) -> float:
        return CHART_LEFT + (index * step if len(levels) > 1 else width / 2)

    def y(rate: float) -> float:
        return CHART_PAD + height - rate / top * height

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{CHART_W}" '
        f'height="{CHART_H}" viewBox="0 0 {CHART_W} {CHART_H}" class="chart">'
        f"<title>{e('jobs/s against concurrency')}</title>",
        f'<line x1="{CHART_LEFT}" y1="{y(0):.1f}" x2="{CHART_W - CHART_PAD}" y2="{y(0):.1f}" '
        'stroke="#888"/>',
        f'<line x1="{CHART_LEFT}" y1="{CHART_PAD}" x2="{CHART_LEFT}" y2="{y(0):.1f}" '
        'stroke="#888"/>',
    ]
    for tick in (0.0, top / 2, top / 1.1):
        parts.append(
            f'<text x="{CHART_LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end" '
            f'font-size="11">{e(f"{tick:.0f}")}</text>'
        )
    parts.append(
        f'<text x="{CHART_LEFT + width / 2:.1f}" y="{CHART_H - 6}" text-anchor="middle" '
        f'font-size="12">{e("concurrency")}</text>'
        f'<text x="12" y="{CHART_PAD + height / 2:.1f}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 12 {CHART_PAD + height / 2:.1f})">{e("jobs/s")}</text>'
    )
    points = " ".join(f"{x(i):.1f},{y(rate):.1f}" for i, (_, rate, _) in enumerate(levels))
    parts.append(f'<polyline class="best" points="{points}" fill="none" stroke="#1f5fa8"/>')
    for i, (concurrency, rate, rounds) in enumerate(levels):
        if concurrency == knee:
            parts.append(
                f'<line class="knee" x1="{x(i):.1f}" y1="{CHART_PAD}" x2="{x(i):.1f}" '
                f'y2="{y(0):.1f}" stroke="#a00" stroke-dasharray="4 3"/>'
            )
        parts.extend(
            f'<circle class="round" cx="{x(i):.1f}" cy="{y(r):.1f}" r="2.5" fill="#999"/>'
            for r in rounds
        )
        parts.append(
            f'<circle class="level" cx="{x(i):.1f}" cy="{y(rate):.1f}" r="4" fill="#1f5fa8">'
            f"<title>{e(f'concurrency {concurrency}: {rate:.1f} jobs/s')}</title></circle>"
            f'<text x="{x(i):.1f}" y="{y(0) + 16:.1f}" text-anchor="middle" '
            f'font-size="11">{e(concurrency)}</text>'
            f'<text x="{x(i):.1f}" y="{y(rate) - 8:.1f}" text-anchor="middle" '
            f'font-size="11">{e(f"{rate:.1f}")}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _shorter(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
