"""The schedules (``/schedules``): each schedule of pools.toml, its next times and its
last runs."""

from __future__ import annotations

import time

from .. import layout
from .chrome import Chrome, e, table


class SchedulePages(Chrome):
    """The schedules' page (a part of :class:`.pages.Console`)."""

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
