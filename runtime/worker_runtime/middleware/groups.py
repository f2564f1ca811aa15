"""GroupCompletion: Dramatiq's group completion callbacks, fired once when every member of the
group has completed, whatever is delivered twice, and never lost to a Redis error or to a
worker killed at the worst moment."""

from __future__ import annotations

import logging
from typing import Any

import redis
from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy
from dramatiq.middleware import GroupCallbacks, MiddlewareError
from dramatiq.rate_limits.backends import RedisBackend

from ..layout import (
    NAMESPACE,
    REDIS_MESSAGE_ID,
    Callback,
    group_member_done,
    namespace_of,
    stored_priority,
)
from ..settlement import REQUEUE, settle_with

logger = logging.getLogger(__name__)

#: How long a group's barrier and its completed-members set live (Dramatiq's default, a day).
BARRIER_TTL_MS = 86_400_000


class GroupRefusedError(MiddlewareError, ValueError):
    """A group the service cannot complete (the message says why); raised by
    ``group(...).run()``."""


class GroupCompletion(GroupCallbacks):
    """Dramatiq's :class:`~dramatiq.middleware.GroupCallbacks` (``group(...).run()`` with
    ``add_completion_callback``), with its barrier counted per member
    (:data:`..layout.GROUP_MEMBER_DONE`) instead of decremented per delivery: Dramatiq's
    counts a member twice when it is delivered twice (a worker killed before the ack,
    recovery) and fires the callbacks before the last member has run.

    The last member's completion and its group's callbacks are one script: the callbacks
    (carried by every member since ``run()``) are prepared as the broker enqueues a message
    (``before_enqueue`` emitted), then recorded and enqueued together, ``after_enqueue``
    emitted after. A worker killed at any moment either did neither (the member is
    delivered again and enqueues them then) or both (the member delivered again finds the
    group complete and enqueues nothing): the callbacks run exactly once.

    A member of the sandbox's queue is refused at ``run()`` (:class:`GroupRefusedError`):
    the sandbox's Redis user may not write the group's keys. When Redis refuses or is
    unreachable, the member's delivery is requeued (its
    settlement): it runs again and completes the group then; handlers are idempotent. A
    message of no group costs one dictionary look-up.

    Parameters:
      client: the broker's Redis client (the barrier's ``RedisBackend``).
    """

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(RedisBackend(client=client), barrier_ttl=BARRIER_TTL_MS)
        self.client = client

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        """Refuse a group member of the sandbox's queue (:class:`GroupRefusedError`)."""
        if "group_completion_uuid" in message.options and (
            namespace_of(message.queue_name) != NAMESPACE
        ):
            raise GroupRefusedError(
                f"group refused: member {message.actor_name!r} runs under the sandbox's Redis "
                "user, which may not record the group's completion: its callbacks would never "
                "fire; complete the group from an actor of another queue"
            )

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        options = message.options
        if "group_completion_uuid" not in options or exception is not None:
            return
        completion = options["group_completion_uuid"]
        try:
            callbacks = [
                prepare(broker, Message(**callback))
                for callback in options.get("group_completion_callbacks") or []
            ]
            stored = [
                Callback(
                    c.queue_name,
                    c.options[REDIS_MESSAGE_ID],
                    c.encode(),
                    c.message_id,
                    stored_priority(c.options),
                )
                for c in callbacks
            ]
            fired = group_member_done(
                self.client, completion, message.message_id, self.barrier_ttl, stored
            )
        except redis.exceptions.NoPermissionError as error:
            # A member of the sandbox's queue sent past the refusal at send: requeued, it
            # would run again for ever; it is acked, the group's callbacks do not fire.
            logger.error(
                "group completion not recorded: this worker's Redis user may not write the "
                "group's keys, its callbacks will not fire: %s",
                error,
                extra={"job_id": message.message_id, "group": completion},
            )
            return
        except redis.RedisError as error:
            logger.warning(
                "group member requeued: its completion could not be recorded: %s",
                error,
                extra={"job_id": message.message_id, "group": completion},
            )
            settle_with(message, REQUEUE)
            return
        for callback in callbacks if fired else []:
            broker.emit_after("enqueue", callback, None)


def prepare(broker: Broker, message: Message[Any]) -> Message[Any]:
    """``message`` as ``broker`` enqueues it (the service's broker's ``prepare_enqueue``)."""
    prepared: Message[Any] = broker.prepare_enqueue(message)  # type: ignore[attr-defined]
    return prepared
