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
    shows the short part of ``description`` (the command module's docstring): its summary
    and usage (:func:`short_help`); the whole text is in docs/commands.md (``make docs``)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name,
        help=help_text,
        description=short_help(description),
        epilog=f"The whole text: docs/commands.md ({name})." if description else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def short_help(doc: str | None) -> str | None:
    """The summary and usage of a command module's docstring ``doc``: its paragraphs up to
    and including the first indented one (the usage block), or the first alone."""
    if not doc:
        return doc
    paragraphs = doc.strip().split("\n\n")
    for end, paragraph in enumerate(paragraphs):
        if paragraph.startswith(" "):
            return "\n\n".join(paragraphs[: end + 1])
    return paragraphs[0]


def positive_int(text: str) -> int:
    """``text`` as a whole number of at least 1 (a count, a limit)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value
