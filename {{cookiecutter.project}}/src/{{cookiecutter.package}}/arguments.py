"""What the commands share of argparse: a documented sub-command, argument types.

argparse shows an :class:`argparse.ArgumentTypeError`'s message after the option's name
and exits with ``EX_USAGE`` (2).
"""

from __future__ import annotations

import argparse
from typing import Any


def command_parser(
    commands: Any, name: str, help_text: str, description: str | None
) -> argparse.ArgumentParser:
    """Add command ``name`` to the CLI's ``commands`` (argparse subparsers); its ``--help``
    shows ``description`` (the command module's docstring) as written."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name,
        help=help_text,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def positive_int(text: str) -> int:
    """``text`` as a whole number of at least 1 (a count, a limit)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value
