"""The service's configuration, validated at boot.

The runtime's variables (``WORKER_*``, ``REDIS_URL``, ``METRICS_PORT``, ...: the README's
configuration table) come from :class:`worker_runtime.settings.WorkerSettings`; add the
service's own here, as fields: field ``x_y`` is read from the variable ``X_Y``, and a bad
value refuses to boot like theirs (exit 78, one line naming the variable and the rule)::

    partner_api_url: Annotated[str, Field(pattern=r"^https://")] = "https://partner.example"
    \"\"\"The partner's API (HTTPS only).\"\"\"

Read them in a handler with ``worker_runtime.settings.load_settings()``.
"""

from __future__ import annotations

from worker_runtime.settings import WorkerSettings


class Settings(WorkerSettings):
    """The runtime's variables and the service's own (none yet)."""
