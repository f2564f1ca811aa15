"""Capacity measurement (to be implemented)."""

from __future__ import annotations

from typing import Any


def add_command(commands: Any) -> None:
    """Add ``capacity`` to the CLI."""
    commands.add_parser("capacity", help="throughput against concurrency").set_defaults(
        run=lambda args: 0)
