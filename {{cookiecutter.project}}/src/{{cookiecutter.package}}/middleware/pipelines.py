"""Pipelines: Dramatiq's pipelines, with nothing done for a message outside a pipeline, and a
pipeline that would hand a typed actor its previous result refused when it is sent."""

from __future__ import annotations

from typing import Any

import dramatiq.middleware
from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy
from dramatiq.middleware import MiddlewareError

from ..typed import TypedActor


class PipelineRefusedError(MiddlewareError, ValueError):
    """A pipeline whose next stage is a typed actor that would get the previous stage's
    result as an extra argument; raised by ``pipeline(...).run()``, nothing enqueued."""

    def __init__(self, actor_name: str) -> None:
        super().__init__(
            f"pipeline refused: typed actor {actor_name!r} cannot take the previous result as "
            "an argument (its arguments are its model's fields): send its message with "
            "pipe_ignore=True, or make the stage an untyped actor"
        )


class Pipelines(dramatiq.middleware.Pipelines):
    """Dramatiq's :class:`~dramatiq.middleware.Pipelines`, called only for a message that
    has a ``pipe_target`` (the next actor of its pipeline). Dramatiq's hook imports a
    module on every call before it looks; for most jobs there is nothing to pipe.

    Dramatiq appends each stage's result to the next stage's positional arguments. A
    typed actor's message carries its model's fields by name (:mod:`..typed`), so the
    result would land on a field already given; a pipeline with such a stage, not sent
    with ``pipe_ignore=True``, is refused at ``run()`` (:class:`PipelineRefusedError`),
    and a message received that way is dead-lettered by ``ArgumentModels``. A message
    outside a pipeline costs one dictionary look-up when it is enqueued.
    """

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        previous, target = message.actor_name, message.options.get("pipe_target")
        while target is not None:
            actor, before = broker.actors.get(target["actor_name"]), broker.actors.get(previous)
            ignored = target["options"].get("pipe_ignore") or (
                before is not None and before.options.get("pipe_ignore")
            )
            if isinstance(actor, TypedActor) and not ignored:
                raise PipelineRefusedError(actor.actor_name)
            previous, target = target["actor_name"], target["options"].get("pipe_target")

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
