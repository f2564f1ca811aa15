"""Metrics exporter: placeholder until issue 4 lands."""

from __future__ import annotations

from .settings import Settings


def start_exporter(settings: Settings) -> None:
    """Serve /metrics, /livez and /readyz on METRICS_PORT (to be implemented)."""
