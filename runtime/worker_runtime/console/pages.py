"""The console's pages assembled (:class:`Console`): the overview with ``/status.json``
(:mod:`.overview`), the waiting and delayed jobs (:mod:`.jobs`), the dead letters, their
summary and a dead letter (:mod:`.dead`), the activity of the last hour and the capacity
chart (:mod:`.charts`) and the schedules (:mod:`.schedules`), on the chrome they share
(:mod:`.chrome`), with the forms of the actions; :mod:`.actions` does what a form posts,
:mod:`.server` serves them."""

from __future__ import annotations

from .charts import ChartPages
from .dead import DeadLetterPages
from .jobs import JobPages
from .overview import OverviewPages
from .schedules import SchedulePages


class Console(OverviewPages, JobPages, DeadLetterPages, ChartPages, SchedulePages):
    """What the pages show and what the actions do: every page of the console, each kept
    in the module of its concept, on the state and chrome they share (:class:`.chrome.Chrome`,
    whose parameters it takes)."""
