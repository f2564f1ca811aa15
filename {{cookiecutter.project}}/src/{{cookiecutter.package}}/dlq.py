"""Dead-letter tooling (to be implemented)."""

from __future__ import annotations

import argparse
from typing import Any


def add_commands(commands: Any) -> None:
    """Add ``dlq list|show|replay|purge`` to the CLI."""
    dlq = commands.add_parser("dlq", help="dead-letter tooling")
    dlq.set_defaults(run=lambda args: 0)


_ = argparse
