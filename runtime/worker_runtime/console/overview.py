"""The overview (``/``, ``/status.json``): the queues, the downstream budgets and the
worker processes as ``status`` reads them, with the forms that pause or resume a queue and
cancel running jobs, and its auto-refresh."""

from __future__ import annotations

import json

from ..status import (
    Status,
    duration,
    heartbeat_text,
    job_text,
    read_status,
    unserved_text,
)
from .chrome import Chrome, e, iso_ms, table

#: The auto-refresh periods a page accepts (``?refresh=S``), seconds.
REFRESH_S = range(2, 601)


class OverviewPages(Chrome):
    """The overview's page and its JSON (a part of :class:`.pages.Console`)."""

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
            f'<p class="note">{e(mode)} Redis time {e(iso_ms(status.now_ms))}. {toggle}</p>'
            + (notice or "")
            + f"<h2>Queues</h2>{flagged}{self._queue_form(queues)}{_downstreams(status)}"
            f"<h2>Worker processes</h2>{processes}",
            refresh_s,
        )


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
