"""Sandbox pool: customer-supplied code, run by :func:`..sandbox.run_untrusted`.

A breach by the customer's code (timeout, memory, forbidden network, ...) is a
result: it is logged and returned, never retried. Only a failure of the sandbox
itself raises :class:`..sandbox.SandboxError`, which Dramatiq retries.
"""

from __future__ import annotations

import logging
from typing import Any

import dramatiq

from ..sandbox import Limits, run_untrusted

logger = logging.getLogger(__name__)


@dramatiq.actor(queue_name="untrusted", max_retries=2)
def run_customer_code(
    source: str, payload: Any = None, limits: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run ``main(payload)`` from ``source`` in the sandbox and return the result as a dict.

    Parameters:
      source(str): the customer's Python source; it defines ``main(payload)``.
      payload(Any): JSON data passed to ``main``.
      limits(dict|None): overrides of :class:`..sandbox.Limits` fields, e.g.
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
