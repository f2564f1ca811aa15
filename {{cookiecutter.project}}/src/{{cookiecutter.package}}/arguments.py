"""Argument types the commands share (``type=`` callables of argparse).

argparse shows an :class:`argparse.ArgumentTypeError`'s message after the option's name
and exits with ``EX_USAGE`` (2).
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """``text`` as a whole number of at least 1 (a count, a limit)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value
