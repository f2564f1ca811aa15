"""The handler API for long jobs (:mod:`worker_runtime.lifecycle`), importable from the
service's own package: ``from <package>.lifecycle import checkpoint, shutdown_requested``."""

from worker_runtime.lifecycle import Requeue, checkpoint, shutdown_requested

__all__ = ["Requeue", "checkpoint", "shutdown_requested"]
