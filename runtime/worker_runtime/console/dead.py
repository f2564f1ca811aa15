"""The dead-letter pages: a queue's dead letters (``/dead``, paged or filtered), their
summary by actor and reason (``/dead/summary``) and a dead letter (``/dead/show``), with the
forms that replay or purge them."""

from __future__ import annotations

import json
from typing import Any

from ..deadletters import store as dlq
from .chrome import Chrome, NotFoundError, e, table
from .paging import PAGE_SIZE, found_note, page_number, page_of, sought_in

#: Dead letters a filtered page reads at most (a search across more says so).
FILTER_READS = 100_000


class DeadLetterPages(Chrome):
    """The dead-letter pages (a part of :class:`.pages.Console`)."""

    def dead(self, params: dict[str, str], notice: str = "") -> bytes:
        queue = self.queue_of(params)
        number = page_number(params)
        sought = sought_in(params)
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
        found = found_note(sought, matching, read, total, "oldest")
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


def _shorter(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
