"""Metrics: placeholder until the metrics middleware lands (issue 4)."""

from __future__ import annotations

from dramatiq import Middleware


class Metrics(Middleware):
    """Records job outcomes and durations (to be implemented)."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
