"""GroupCompletion: Dramatiq's group completion callbacks, fired once when every member of the
group has completed, whatever is delivered twice, and never lost to a Redis error."""

from __future__ import annotations

import logging
from typing import Any

import redis
from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy
from dramatiq.middleware import GroupCallbacks
from dramatiq.rate_limits.backends import RedisBackend

from ..layout import group_member_done, release_group_callbacks
from ..settlement import REQUEUE, settle_with

logger = logging.getLogger(__name__)

#: How long a group's barrier and its completed-members set live (Dramatiq's default, a day).
BARRIER_TTL_MS = 86_400_000


class GroupCompletion(GroupCallbacks):
    """Dramatiq's :class:`~dramatiq.middleware.GroupCallbacks` (``group(...).run()`` with
    ``add_completion_callback``), with its barrier counted per member
    (:data:`..layout.GROUP_MEMBER_DONE`) instead of decremented per delivery: Dramatiq's
    counts a member twice when it is delivered twice (a worker killed before the ack,
    recovery) and fires the callbacks before the last member has run.

    When the callbacks cannot be enqueued (Redis refused or is unreachable), the claim is
    released and the member's delivery is requeued (its settlement): it runs again and
    enqueues them then, so a completion is not lost; handlers are idempotent. A message of
    no group costs one dictionary look-up.

    Parameters:
      client: the broker's Redis client (the barrier's ``RedisBackend``).
    """

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(RedisBackend(client=client), barrier_ttl=BARRIER_TTL_MS)
        self.client = client

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
        callbacks = options.get("group_completion_callbacks") or []
        claimed = False
        try:
            claimed = group_member_done(
                self.client, completion, message.message_id, self.barrier_ttl
            )
            for callback in callbacks if claimed else []:
                broker.enqueue(Message(**callback))
        except redis.RedisError as error:
            if claimed:
                try:
                    release_group_callbacks(self.client, completion)
                except redis.RedisError:
                    logger.exception("group callbacks of %s may be lost", completion)
            logger.warning(
                "group member requeued: its completion could not be recorded: %s",
                error,
                extra={"job_id": message.message_id, "group": completion},
            )
            settle_with(message, REQUEUE)
