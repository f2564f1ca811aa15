"""Pipelines: Dramatiq's pipelines, with nothing done for a message outside a pipeline."""

from __future__ import annotations

from typing import Any

import dramatiq.middleware
from dramatiq import Broker
from dramatiq.broker import MessageProxy


class Pipelines(dramatiq.middleware.Pipelines):
    """Dramatiq's :class:`~dramatiq.middleware.Pipelines`, called only for a message that
    has a ``pipe_target`` (the next actor of its pipeline). Dramatiq's hook imports a
    module on every call before it looks; for most jobs there is nothing to pipe.
    """

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        if message.options.get("pipe_target") is not None:
            super().after_process_message(broker, message, result=result, exception=exception)  # type: ignore[no-untyped-call]
