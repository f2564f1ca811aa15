"""Schedules: the ``[schedules.<name>]`` tables of pools.toml, and the arithmetic of their ticks.

    [schedules.nightly_report]
    actor = "build_report"     # an actor of the service
    cron = "0 6 * * *"         # 5 fields, or 6 with a leading seconds field
    timezone = "UTC"           # IANA name (default UTC); ticks follow its daylight saving
    missed = "skip"            # or "catch_up": required, no default
    dst = "once"               # or "every": a repeated local time (fall-back) fires once
    catch_up_limit = 10        # catch_up: at most this many missed ticks are enqueued
    max_runtime_s = 3600       # lease of the run lock, renewed while the run lasts
    args = ["nightly", 1000]   # optional, like kwargs = {}

A tick is an instant (whole epoch seconds) at which the cron expression matches in
the schedule's time zone.

Daylight saving time, ticks by croniter: when clocks go back, a local time occurs
twice (``0 2 * * *`` in Europe/Berlin on the last Sunday of October: 02:00 CEST, then
02:00 CET an hour later). ``dst = "once"`` (the default) fires the first of the two
only: a wall-clock time fires once (an hourly schedule then waits two hours across the
change); ``dst = "every"`` fires at both instants (every real hour). When clocks go
forward, the skipped local times (02:00 to 02:59 in Europe/Berlin on the last Sunday
of March) fire once, at the first instant after the gap (03:00 CEST), with either
setting: a daily job still runs that day. UTC has neither.

:mod:`.scheduler` enqueues one message per tick; the worker's
:class:`.middleware.ScheduleLock` keeps two runs of a schedule apart.

The model checks what it can alone (expression, time zone, policy, JSON arguments);
:func:`actor_problems` checks what needs the actors (the actor exists, its queue is
served by a pool, the arguments fit its signature). Both refuse to boot (exit 78).
"""

from __future__ import annotations

import inspect
import json
import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from croniter.croniter import CroniterError
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from ..layout import ScheduleState

ScheduleName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]*$", max_length=64)]
#: A cron expression has 5 fields, or 6 with a leading seconds field (one tick a second at most).
MIN_FIELDS, MAX_FIELDS = 5, 6
#: Message ids of scheduled runs: uuid5(namespace, "<schedule>@<tick>"), the same on every
#: scheduler replica, so a tick has one id wherever and however often it is computed.
TICK_NAMESPACE = uuid.UUID("6f1c3d0e-8a4b-5c7d-9e2f-0a1b2c3d4e5f")
#: Message options a scheduled run carries (read by the ScheduleLock middleware).
OPTION_SCHEDULE = "schedule"
OPTION_TICK = "schedule_tick"
OPTION_LEASE_MS = "schedule_lease_ms"


class Schedule(BaseModel):
    """One ``[schedules.<name>]`` table.

    Parameters:
      actor: name of an actor of the service (its queue must be served by a pool).
      cron: 5 fields (minute hour day month weekday) or 6 with a leading seconds field;
        ``@daily`` and friends work too. Parsed by croniter.
      timezone: IANA time zone of the expression (default ``UTC``).
      missed: what happens to ticks that passed while no scheduler ran: ``skip`` (counted
        as missed, only the latest fires if it is still on time) or ``catch_up`` (each is
        enqueued once, oldest first). Required: the choice is explicit per schedule.
      dst: ``once`` (default) or ``every``: whether a local time that occurs twice when
        clocks go back fires at its first instant only, or at both (see above).
      catch_up_limit: ``catch_up`` enqueues at most this many missed ticks, the latest ones
        (default 10); older ones are counted as missed.
      max_runtime_s: lease of the run lock in seconds (default 3600). The worker renews it
        while the run lasts; it only matters when a worker dies mid-run: the next run may
        start at most this long after the death.
      args, kwargs: the actor's arguments (JSON values).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    actor: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128)]
    cron: Annotated[str, Field(min_length=1, max_length=200)]
    timezone: str = "UTC"
    missed: Literal["skip", "catch_up"]
    dst: Literal["once", "every"] = "once"
    catch_up_limit: Annotated[int, Field(ge=1, le=1000)] = 10
    max_runtime_s: Annotated[int, Field(ge=1, le=7 * 86_400)] = 3600
    args: list[Any] = []
    kwargs: dict[str, Any] = {}

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str) -> str:
        fields = value.split()
        if not value.startswith("@") and not MIN_FIELDS <= len(fields) <= MAX_FIELDS:
            raise ValueError(
                f"{value!r} has {len(fields)} fields: use 5 (minute hour day month weekday) "
                "or 6 (second minute hour day month weekday)"
            )
        try:
            croniter(value, 0.0, second_at_beginning=True).get_next(float)
        except CroniterError as error:
            raise ValueError(f"{value!r} is not a cron expression: {error}") from None
        return " ".join(fields)

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{value!r} is not an IANA time zone such as Europe/Paris") from None
        return value

    @model_validator(mode="after")
    def _json_arguments(self) -> Schedule:
        try:
            json.dumps([self.args, self.kwargs])
        except (TypeError, ValueError) as error:
            raise ValueError(f"args and kwargs must be JSON values: {error}") from None
        return self

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    @property
    def lease_ms(self) -> int:
        return self.max_runtime_s * 1000

    def _iter(self, start: float) -> croniter:
        base = datetime.fromtimestamp(start, UTC).astimezone(self.zone)
        return croniter(self.cron, base, second_at_beginning=True)

    def _fires(self, tick: int) -> bool:
        """Whether croniter's match ``tick`` fires: with ``dst = "once"``, not the second
        instant of a local time that occurs twice (``fold`` 1, clocks gone back)."""
        return self.dst == "every" or datetime.fromtimestamp(tick, self.zone).fold == 0

    def _matches(self, start: float, forward: bool) -> Iterator[int]:
        it = self._iter(start)
        step = it.get_next if forward else it.get_prev
        while True:
            tick = int(step(float))
            if self._fires(tick):
                yield tick

    def ticks_after(self, after: float) -> Iterator[int]:
        """Ticks strictly after ``after`` (epoch seconds), in order, without end."""
        return self._matches(math.floor(after), forward=True)

    def latest_tick(self, now: float) -> int:
        """The latest tick at or before ``now``."""
        return next(self._matches(math.floor(now) + 1, forward=False))

    def ticks_before(self, until: float, after: float, limit: int) -> list[int]:
        """Up to ``limit`` ticks in (``after``, ``until``], the latest ones, oldest first."""
        found: list[int] = []
        ticks = self._matches(math.floor(until) + 1, forward=False)
        while len(found) < limit:
            tick = next(ticks)
            if tick <= after:
                break
            found.append(tick)
        return found[::-1]

    def count_ticks(self, after: float, before: float, cap: int = 100_000) -> int:
        """How many ticks lie in (``after``, ``before``) (stops counting at ``cap``)."""
        count = 0
        for tick in self.ticks_after(after):
            if tick >= before or count >= cap:
                return count
            count += 1
        return count  # pragma: no cover  (the iterator never ends)

    def next_ticks(self, now: float, count: int) -> list[datetime]:
        """The next ``count`` fire times after ``now``, in the schedule's time zone."""
        ticks = self.ticks_after(now)
        return [datetime.fromtimestamp(next(ticks), self.zone) for _ in range(count)]


def tick_message_id(schedule: str, tick: int) -> str:
    """The message id of ``schedule``'s run at ``tick``: the same on every replica."""
    return str(uuid.uuid5(TICK_NAMESPACE, f"{schedule}@{tick}"))


def actor_problems(
    schedules: Mapping[str, Schedule],
    actors: Mapping[str, tuple[str, inspect.Signature]],
    pool_of_queue: Callable[[str], str | None],
) -> list[str]:
    """Why the schedules cannot run with these actors: one line per problem, naming the key.

    Parameters:
      schedules: the ``[schedules.*]`` tables.
      actors: actor name -> (queue name, what its arguments must fit), e.g. from
        ``broker.actors`` (:func:`.typed.signature_of`).
      pool_of_queue: the pool that serves a queue, or None (``PoolsFile.pool_of_queue``).
    """
    problems = []
    for name, schedule in schedules.items():
        key = f"schedules.{name}"
        if schedule.actor not in actors:
            known = ", ".join(sorted(actors)) or "none"
            problems.append(f"{key}.actor: {schedule.actor!r} is not an actor (actors: {known})")
            continue
        queue, signature = actors[schedule.actor]
        if pool_of_queue(queue) is None:
            problems.append(
                f"{key}.actor: {schedule.actor!r} uses queue {queue!r}, which no pool serves"
            )
        try:
            signature.bind(*schedule.args, **schedule.kwargs)
        except TypeError as error:
            shown = ", ".join(
                str(p.replace(annotation=p.empty)) for p in signature.parameters.values()
            )
            problems.append(f"{key}.args: do not fit {schedule.actor}({shown}): {error}")
    return problems


def utc_iso(seconds: float) -> str:
    """``seconds`` since the epoch as ISO 8601 in UTC, to the second (``2026-01-31T02:30:00Z``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def schedule_rows(
    schedules: dict[str, Schedule], states: dict[str, ScheduleState], now: float, count: int
) -> list[dict[str, Any]]:
    """What ``schedules --json`` and the console show of each schedule: its definition,
    its next ``count`` fire times after ``now``, its last run (``states``: Redis's)."""
    rows: list[dict[str, Any]] = []
    for name, schedule in schedules.items():
        state = states.get(name)
        rows.append(
            {
                "schedule": name,
                "actor": schedule.actor,
                "cron": schedule.cron,
                "timezone": schedule.timezone,
                "missed": schedule.missed,
                "dst": schedule.dst,
                "next": [t.isoformat() for t in schedule.next_ticks(now, count)],
                "last_fired": utc_iso(state.fired) if state and state.fired else None,
                "last_success": utc_iso(state.success_at) if state and state.success_at else None,
                "running": bool(state and state.running),
                "runs": state.runs if state else None,
            }
        )
    return rows
