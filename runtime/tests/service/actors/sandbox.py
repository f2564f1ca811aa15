"""Sandbox pool: customer-supplied code, run by :func:`worker_runtime.sandbox.run_untrusted`.

A breach by the customer's code (timeout, memory, forbidden network, ...) is a
result: it is logged and returned, never retried. Only a failure of the sandbox
itself raises :class:`worker_runtime.sandbox.SandboxError`, which Dramatiq retries.

A worker process that serves this queue checks the sandbox once, at boot
(:func:`worker_runtime.sandbox.check_sandbox`): where it cannot run (no layer keeps a snippet from
the worker's files and processes, or libseccomp is missing) the process refuses to boot
with one line and exit 78, instead of failing every job.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import dramatiq

from worker_runtime import layout
from worker_runtime.broker import POOL_ENV
from worker_runtime.sandbox import Limits, SandboxError, check_sandbox, run_untrusted
from worker_runtime.settings import load_settings, refuse

logger = logging.getLogger(__name__)


def _serves_sandbox() -> bool:
    """Whether this is a worker process that serves this queue (not a producer, nor a
    worker of another pool, which never pay the sandbox's boot check)."""
    if not os.environ.get(POOL_ENV):
        return False
    return layout.SANDBOX_QUEUE in load_settings().worker_queues


def _check_at_boot(serves: bool) -> None:
    """Refuse to boot (exit 78, one line) where the sandbox cannot run."""
    if not serves:
        return
    try:
        layers = check_sandbox()
    except SandboxError as error:
        refuse([f"the sandbox cannot run here: {' '.join(str(error).split())}"])
    logger.info("sandbox checked", extra={"sandbox_layers": list(layers)})


_check_at_boot(_serves_sandbox())


@dramatiq.actor(queue_name=layout.SANDBOX_QUEUE, max_retries=2)
def run_customer_code(
    source: str, payload: Any = None, limits: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run ``main(payload)`` from ``source`` in the sandbox and return the result as a dict.

    Parameters:
      source(str): the customer's Python source; it defines ``main(payload)``.
      payload(Any): JSON data passed to ``main``.
      limits(dict|None): overrides of :class:`worker_runtime.sandbox.Limits` fields, e.g.
        ``{"cpu_seconds": 2}``; defaults to ``Limits()``.
    """
    result = run_untrusted(source, payload, limits=Limits(**(limits or {})))
    logger.info(
        "sandbox run finished",
        extra={
            "sandbox_status": result.status,
            "sandbox_error": (result.error or "").splitlines()[0] if result.error else None,
            "sandbox_cpu_seconds": result.cpu_seconds,
            "sandbox_wall_seconds": result.wall_seconds,
            "sandbox_max_rss_bytes": result.max_rss_bytes,
            "sandbox_layers": list(result.layers),
        },
    )
    return result.to_dict()
