"""Untrusted code (:mod:`worker_runtime.sandbox`)::

from service.sandbox import Limits, run_untrusted
"""

from worker_runtime.sandbox import Limits, SandboxError, SandboxResult, run_untrusted

__all__ = ["Limits", "SandboxError", "SandboxResult", "run_untrusted"]
