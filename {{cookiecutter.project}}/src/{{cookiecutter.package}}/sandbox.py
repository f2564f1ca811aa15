"""Untrusted code (:mod:`worker_runtime.sandbox`), importable from the service's own
package: ``from <package>.sandbox import Limits, run_untrusted``."""

from worker_runtime.sandbox import Limits, SandboxError, SandboxResult, run_untrusted

__all__ = ["Limits", "SandboxError", "SandboxResult", "run_untrusted"]
