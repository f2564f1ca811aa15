"""The console's pages: HTML of the overview, the dead letters, a dead letter, the
schedules and the capacity chart, and the actions a form asks for (:class:`Console`);
:mod:`.server` serves them."""

from __future__ import annotations

import hmac
import html
import json
import logging
import math
import time
import urllib.parse
from typing import TYPE_CHECKING, Any, cast

from .. import layout
from ..deadletters import store as dlq
from ..service import current
from ..status import Status, duration, read_status

if TYPE_CHECKING:
    import redis


logger = logging.getLogger(__name__)

#: The variable that enables actions; unset (or empty): the console is read-only.
TOKEN_ENV = "CONSOLE_TOKEN"  # noqa: S105  (a variable's name, not a secret)
#: Dead letters per page of ``/dead``.
PAGE_SIZE = 50
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
      prefix: the path the pages are served under (default ``""``: the root; the exporter
        mounts them under :data:`EXPORTER_PREFIX`).
    """

    def __init__(
        self,
        client: redis.Redis,
        queues: list[str],
        token: str | None,
        max_bytes: int | None = None,
        prefix: str = "",
    ) -> None:
        self.client = client
        self.queues = queues
        self.token = token or None
        self.max_bytes = max_bytes
        self.prefix = prefix.rstrip("/")

    def link(self, path: str, **params: Any) -> str:
        """The escaped href of page ``path`` with ``params`` (under :attr:`prefix`)."""
        return e(self.prefix + path + (f"?{q(**params)}" if params else ""))

    def page(self, title: str, body: str) -> bytes:
        """A whole page: ``title`` (escaped here) and ``body`` (HTML already)."""
        nav = "".join(
            f'<a href="{self.link(path)}">{e(name)}</a>'
            for path, name in (
                ("/", "Queues and workers"),
                ("/schedules", "Schedules"),
                ("/capacity", "Capacity"),
            )
        )
        return (
            "<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<title>{e(title)} - {e(current().project)}</title>"
            f'<link rel=stylesheet href="{self.link("/console.css")}"></head><body>'
            f"<nav>{nav}</nav><h1>{e(title)}</h1>{body}</body></html>"
        ).encode()

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
                    f'<a href="{self.link("/dead", queue=q.queue)}">{e(q.dead_letters)}</a>',
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
        return self.page(
            "Queues and workers",
            f'<p class="note">{e(mode)} Redis time {e(_iso_ms(status.now_ms))}.</p>'
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
                f'<a href="{self.link("/dead/show", queue=queue, id=letter.redis_id)}">'
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
            links.append(f'<a href="{self.link("/dead", queue=queue, page=number - 1)}">newer</a>')
        if number + 1 < pages:
            links.append(f'<a href="{self.link("/dead", queue=queue, page=number + 1)}">older</a>')
        links.append(f'<a href="{self.link("/dead/summary", queue=queue)}">summary</a>')
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
            + f'<form method=post action="{self.link("/dead/act")}">'
            + f'<input type=hidden name=queue value="{e(queue)}">'
            + listing
            + self._action_fields()
            + "</form>"
        )
        return self.page(f"Dead letters: {queue}", body)

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
            f'<a href="{self.link("/dead", queue=queue)}">list</a></p>'
            + table(["count", "actor", "reason"], rows, numeric={0})
        )
        return self.page(f"Dead letters by actor and reason: {queue}", body)

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
                f'<form method=post action="{self.link("/dead/act")}">'
                f'<input type=hidden name=queue value="{e(queue)}">'
                f'<input type=hidden name=id value="{e(letter.redis_id)}">'
                + self._action_fields().replace("the selected dead letters", "this dead letter")
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
            sections.append(
                f"<h2>{e(queue)}</h2><p>{e(said)}</p>"
                + capacity_chart(levels, knee if isinstance(knee, int) else None)
                + table(["concurrency", "jobs/s", "rounds"], rows, numeric={0, 1})
            )
        body = "".join(sections) or (
            '<p class="note">No capacity result stored: run <code>capacity --actor NAME</code> '
            "against this Redis (a queue with no other worker); the last result of each queue "
            "is shown here.</p>"
        )
        return self.page("Capacity", body)

    # -- actions ----------------------------------------------------------------------

    def act(self, form: dict[str, list[str]], remote: str) -> tuple[int, bytes]:
        """Replay or purge the selected dead letters; (HTTP status, page)."""
        queue = self._queue({"queue": _one(form, "queue")})
        action = _one(form, "action")
        ids = list(dict.fromkeys(form.get("id", [])))
        who = _one(form, "who").strip()[:80]
        params = {"queue": queue}
        refusal = self._refusal(form, action, ids, who)
        logged = {"action": action, "queue": queue, "ids": ids, "who": who, "remote": remote}
        if refusal:
            status, why = refusal
            logger.warning(
                "console action refused: %s", why, extra=_action_record(logged, "refused")
            )
            return status, self.dead(params, notice=f'<p class="bad">Refused: {e(why)}</p>')
        letters = [
            letter
            for redis_id in ids
            for letter in _found(self.client, queue, redis_id, self.max_bytes)
        ]
        problems: list[str] = []
        if action == "replay":
            done, problems = dlq.replay_page(self.client, queue, letters)
        else:
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
            extra=_action_record(logged, verb, count=done),
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


def _iso_ms(ms: int) -> str:
    from ..scheduling.schedules import utc_iso

    return utc_iso(ms / 1000)


def _action_record(logged: dict[str, Any], outcome: str, **more: Any) -> dict[str, Any]:
    """The ``extra`` of a ``console_action`` log line: ``logged`` (action, queue, ids, who,
    remote), its ``outcome`` and ``more``."""
    return {"event": "console_action", **logged, "outcome": outcome, **more}


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


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


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
