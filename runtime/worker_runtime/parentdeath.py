"""The kernel's parent-death signal (Linux's ``PR_SET_PDEATHSIG``, prctl(2)).

A process that must not outlive the one that started it asks the kernel for SIGTERM when
that parent dies, even by SIGKILL, and then drains as on any SIGTERM: a worker process under
its supervisor (:func:`die_with_parent`), the worker under ``worker --watch`` and a
benchmark's worker under ``capacity`` (:func:`stop_with_parent`, set by the parent at
spawn). Elsewhere than Linux both do nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

from .exitcodes import EX_FAILURE

#: prctl(2)'s option: the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child is sent SIGTERM when ``parent``
    (the pid of the process that spawns it) dies, the setting kept across exec, and exits
    at once (``EX_FAILURE``) if ``parent`` died already. The libc call is looked up here,
    before the fork: the child only calls it."""
    if sys.platform != "linux":
        return lambda: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(EX_FAILURE)

    return arm
