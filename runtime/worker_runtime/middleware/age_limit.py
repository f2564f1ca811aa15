"""ClockedAgeLimit: Dramatiq's AgeLimit, judged by Redis's clock instead of this host's."""

from __future__ import annotations

from typing import cast

from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import AgeLimit, SkipMessage

from ..settlement import SettlingBroker


class ClockedAgeLimit(AgeLimit):
    """Dramatiq's :class:`~dramatiq.middleware.AgeLimit` (an actor's or a message's
    ``max_age``, ms: an older message is not run but dead-lettered), its age counted on
    Redis's clock (the broker's ``redis_millis``), the clock the service's producers stamp
    ``message_timestamp`` with. Dramatiq's compares with this host's clock: on a worker
    300 s ahead every message with a ``max_age`` under 300 s was dead-lettered unrun, on
    one behind a stale message ran.

    Parameters:
      max_age: the default age limit, ms (default None: none; as in Dramatiq).
    """

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        actor = broker.get_actor(message.actor_name)
        max_age = message.options.get("max_age") or actor.options.get("max_age", self.max_age)
        if not max_age:
            return
        now = cast(SettlingBroker, broker).redis_millis()
        if now - message.message_timestamp >= max_age:
            self.logger.warning("Message %r has exceeded its age limit.", message.message_id)
            message.fail()
            raise SkipMessage("Message age limit exceeded")
