"""The error every guard raises."""

from __future__ import annotations

import pulumi


class GuardError(pulumi.RunError, ValueError):
    """A stack refused before anything is created; the message names the pools and numbers.

    A subclass of :class:`pulumi.RunError`, so ``pulumi preview`` prints the message
    without a traceback.
    """
