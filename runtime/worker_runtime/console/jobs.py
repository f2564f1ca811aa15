"""The waiting and delayed jobs of a queue (``/jobs``): a page in line order, one round
trip a page however many wait, or filtered over the first in line, with the form that
cancels the jobs chosen."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import layout
from ..deadletters import store as dlq
from ..status import duration
from .chrome import Chrome, e, table
from .paging import PAGE_SIZE, found_note, page_number, page_of, sought_in

if TYPE_CHECKING:
    import redis

#: Waiting or delayed jobs a filtered ``/jobs`` page reads at most, the first in line (a
#: search across more says so), and how many it reads a round trip.
JOB_FILTER_READS, FILTER_WINDOW = 10_000, 1_000


class JobPages(Chrome):
    """The page of the waiting and delayed jobs (a part of :class:`.pages.Console`)."""

    def jobs(self, params: dict[str, str], notice: str = "") -> bytes:
        """``/jobs?queue=Q&kind=waiting|delayed&page=N&find=T``: the messages waiting on a
        queue (or its delay queue: ``delay=`` and retries in their backoff), in line order,
        :data:`.paging.PAGE_SIZE` a page, one round trip a page however many wait; ``find``:
        only those whose actor, job id or redis id holds ``T`` (any case), among the first
        :data:`JOB_FILTER_READS` in line (read :data:`FILTER_WINDOW` a round trip)."""
        queue = self.queue_of(params)
        kind = "delayed" if params.get("kind") == "delayed" else "waiting"
        number = page_number(params)
        sought = sought_in(params)
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
        found = found_note(sought, matching, read, total, "first")
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
