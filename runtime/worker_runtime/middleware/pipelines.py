"""Pipelines: Dramatiq's pipelines, with nothing done for a message outside a pipeline, and a
pipeline that would hand a typed actor its previous result refused when it is sent."""

from __future__ import annotations

from typing import Any

import dramatiq.middleware
from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy
from dramatiq.middleware import MiddlewareError

from .. import layout
from ..typed import TypedActor


class PipelineRefusedError(MiddlewareError, ValueError):
    """A pipeline one of whose stages cannot be handed on (the message says why); raised by
    ``pipeline(...).run()``, nothing enqueued."""


def typed_stage(actor_name: str) -> PipelineRefusedError:
    """The refusal of a typed actor's stage that would get the previous result."""
    return PipelineRefusedError(
        f"pipeline refused: typed actor {actor_name!r} cannot take the previous result as "
        "an argument (its arguments are its model's fields): send its message with "
        "pipe_ignore=True, or make the stage an untyped actor"
    )


def sandbox_stage(actor_name: str, next_name: str) -> PipelineRefusedError:
    """The refusal of a stage of the sandbox's queue followed by one of another queue."""
    return PipelineRefusedError(
        f"pipeline refused: stage {actor_name!r} runs under the sandbox's Redis user, which "
        f"may enqueue only on its own queue: the next stage {next_name!r} would be lost; "
        "start another pipeline from the sandbox stage's result instead"
    )


class Pipelines(dramatiq.middleware.Pipelines):
    """Dramatiq's :class:`~dramatiq.middleware.Pipelines`, called only for a message that
    has a ``pipe_target`` (the next actor of its pipeline). Dramatiq's hook imports a
    module on every call before it looks; for most jobs there is nothing to pipe.

    Dramatiq appends each stage's result to the next stage's positional arguments. A
    typed actor's message carries its model's fields by name (:mod:`..typed`), so the
    result would land on a field already given; a pipeline with such a stage, not sent
    with ``pipe_ignore=True``, is refused at ``run()`` (:class:`PipelineRefusedError`),
    and a message received that way is dead-lettered by ``ArgumentModels``. So is a stage
    of the sandbox's queue followed by a stage of another queue (the sandbox's Redis user
    could not enqueue it). A message outside a pipeline costs one dictionary look-up when
    it is enqueued.
    """

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        previous, queue = message.actor_name, message.queue_name
        target = message.options.get("pipe_target")
        while target is not None:
            actor, before = broker.actors.get(target["actor_name"]), broker.actors.get(previous)
            ignored = target["options"].get("pipe_ignore") or (
                before is not None and before.options.get("pipe_ignore")
            )
            if isinstance(actor, TypedActor) and not ignored:
                raise typed_stage(actor.actor_name)
            here, there = layout.namespace_of(queue), layout.namespace_of(target["queue_name"])
            if here != layout.NAMESPACE and there != here:
                raise sandbox_stage(previous, target["actor_name"])
            previous, queue = target["actor_name"], target["queue_name"]
            target = target["options"].get("pipe_target")

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
