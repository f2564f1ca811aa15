"""HeldCheck: a message this worker no longer holds never starts here."""

from __future__ import annotations

import logging

import redis
from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage

from .. import layout
from ..holds import HOLD_EPOCH, HoldWatch
from ..settlement import SKIPPED_OPTION

logger = logging.getLogger(__name__)


class HeldCheck(Middleware):
    """Before a handler starts, make sure this process still holds its message.

    A process that was stopped or frozen past ``WORKER_HEARTBEAT_TIMEOUT_MS`` wakes up with
    prefetched messages another worker has recovered and runs already. When the
    heartbeats left no gap since the message was fetched (:class:`..holds.HoldWatch`, no
    Redis call: the usual case) it starts; otherwise Redis is asked
    (:func:`..layout.still_held`, which beats too). A message no longer held is skipped
    unless this process fetched it again meanwhile (the broker's ``give_up``): its
    settlement stores nothing and it is counted in ``jobs_lost_total`` and logged, once
    (the Metrics middleware). When Redis does not answer, the message starts (its
    settlement decides, as for any delivery).
    """

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        holds: HoldWatch | None = getattr(broker, "holds", None)
        if holds is None or holds.sure(getattr(message, HOLD_EPOCH, -1)):
            return
        redis_id = message.options.get(layout.REDIS_MESSAGE_ID, "")
        try:
            held = layout.still_held(
                broker.client,  # type: ignore[attr-defined]
                broker.broker_id,  # type: ignore[attr-defined]
                message.queue_name,
                redis_id,
            )
        except redis.RedisError as error:
            logger.warning("cannot tell whether this worker still holds a job: %s", error)
            return
        give_up = getattr(broker, "give_up", None)
        if not held and (give_up is None or give_up(message)):
            message.options[SKIPPED_OPTION] = True
            raise SkipMessage("no longer held: another worker recovered it")
