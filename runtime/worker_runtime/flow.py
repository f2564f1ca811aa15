"""Flow control as an operator sees it: paused queues, downstream budgets in use.

:func:`read_flow` is the one read of the flow state that ``status``, the console and the
exporter share: the paused queues, and per downstream resource of pools.toml its budget in
use (every pool's deliveries holding a slot), its limit with this environment's overrides
(``DOWNSTREAM_<NAME>_*``), its rate, and the queues it holds back now.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import layout

if TYPE_CHECKING:
    import redis

    from .pools import PoolsFile


@dataclass(frozen=True)
class DownstreamStatus:
    """One downstream resource now: ``in_use`` of ``limit`` (``capacity - reserved``),
    its rate (calls a second, None: none) and tokens now, the queues whose pools use it,
    and ``throttled``: those of them with messages waiting that it holds back now
    (``budget``: every slot taken; ``rate``: no whole token)."""

    name: str
    in_use: int
    limit: int
    calls_per_s: float | None
    tokens: float | None
    queues: list[str]
    throttled: dict[str, str]


@dataclass(frozen=True)
class FlowState:
    """The paused queues (queue -> paused since, Redis ms) and the downstream resources."""

    now_ms: int
    paused: dict[str, int]
    downstreams: list[DownstreamStatus]

    def throttled(self, queue: str) -> str:
        """Why ``queue``'s waiting messages are held back now ('' when they are not)."""
        for resource in self.downstreams:
            if queue in resource.throttled:
                return resource.throttled[queue]
        return ""


def read_flow(
    client: redis.Redis,
    file: PoolsFile,
    waiting: Mapping[str, int],
    env: Mapping[str, str] | None = None,
) -> FlowState:
    """The flow state of ``file``'s queues in two round trips (``waiting``: queue -> its
    ready messages, from the backlog the caller read). Raises :class:`.pools.PoolsFileError`
    for a bad ``DOWNSTREAM_*`` variable of ``env`` (default: this process's environment)."""
    from .pools import effective_downstreams

    resources = effective_downstreams(file, os.environ if env is None else env)
    queues = [queue for pool in file.pools.values() for queue in pool.queues]
    paused = layout.paused_queues(client, queues)
    uses = layout.downstream_use(client, list(resources))
    now = uses[0].now_ms if uses else layout.redis_now_ms(client)
    found = []
    for use in uses:
        resource = resources[use.name]
        rate = resource.calls_per_s
        tokens = None if rate is None else use.tokens_now(rate, resource.effective_burst)
        served = [q for pool in file.pools.values() if use.name in pool.uses for q in pool.queues]
        reason = layout.BUDGET if use.in_use >= resource.budget else ""
        if not reason and tokens is not None and tokens < 1:
            reason = layout.RATE
        throttled = {q: reason for q in served if reason and waiting.get(q, 0) > 0}
        found.append(
            DownstreamStatus(
                use.name,
                use.in_use,
                resource.budget,
                rate,
                None if tokens is None else round(tokens, 3),
                served,
                throttled,
            )
        )
    return FlowState(now, paused, found)


def render(state: FlowState) -> str:
    """The lines ``status`` adds: paused queues, then each resource's budget in use."""
    lines = [
        f"paused: {queue} (for {(state.now_ms - since) / 1000:.0f}s)"
        for queue, since in sorted(state.paused.items())
    ]
    if state.downstreams:
        rows: list[tuple[str, ...]] = [("DOWNSTREAM", "IN USE", "RATE", "THROTTLED")]
        rows += [
            (
                d.name,
                f"{d.in_use}/{d.limit}",
                "-" if d.calls_per_s is None else f"{d.calls_per_s:g}/s",
                ", ".join(f"{q} ({why})" for q, why in sorted(d.throttled.items())) or "-",
            )
            for d in state.downstreams
        ]
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines += [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]
    return "\n".join(lines)
