"""The charts: each queue's activity of the last hour (``/activity``) and its last
``capacity`` result (``/capacity``), drawn as inline SVG (no script, nothing fetched)."""

from __future__ import annotations

import math
from typing import Any, cast

from .. import layout
from ..status import duration
from .chrome import Chrome, e, iso_ms, table


class ChartPages(Chrome):
    """The activity and capacity pages (a part of :class:`.pages.Console`)."""

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
                + (f", measured {iso_ms(measured)}" if isinstance(measured, int) else "")
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
        label = f"{iso_ms(minute * 60_000)}: {done} done, {failed} failed"
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
