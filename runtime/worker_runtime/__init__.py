"""worker_runtime: the worker runtime of worker-template's services.

A service (a bake) describes itself with :class:`Service` and keeps only what its team
owns (actors, settings, the broker's middleware); everything else lives here, versioned,
and reaches every service through one pin. Light on purpose: ``healthcheck live`` imports
it, so the handler API (:func:`checkpoint`, :func:`shutdown_requested`) is loaded lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .service import Service, current, runtime_version

if TYPE_CHECKING:
    from .lifecycle import checkpoint, shutdown_requested

__version__ = runtime_version()

__all__ = ["Service", "__version__", "checkpoint", "current", "shutdown_requested"]


def __getattr__(name: str) -> Any:
    if name in ("checkpoint", "shutdown_requested"):
        from . import lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(f"module 'worker_runtime' has no attribute {name!r}")
