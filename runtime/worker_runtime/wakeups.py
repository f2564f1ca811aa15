"""The wake-ups: a listener on the wake channel that wakes the consumer of each queue a
producer names (:class:`WakeUps`), used by the consumer's broker (:mod:`.consumer`)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

import redis

from . import layout


class Wakeable(Protocol):
    """What the wake-ups need of a broker (:class:`.redisbroker.SettlingRedisBroker`)."""

    client: Any  # redis.Redis (Dramatiq leaves it untyped)

    def wake(self, queue: str) -> None: ...


logger = logging.getLogger(__name__)


class WakeUps(threading.Thread):
    """Listens on the wake channel (:data:`.layout.WAKE_CHANNEL`, one connection of its own)
    and wakes the consumer of each queue a producer names
    (:meth:`.redisbroker.SettlingRedisBroker.wake`).
    Costs no round trip while idle. A lost connection is reopened after
    :data:`RECONNECT_S`; a user without pub/sub rights logs one line and only polls.

    Parameters:
      broker: the broker whose consumers it wakes.
    """

    #: Seconds between two tries to listen again after the connection was lost.
    RECONNECT_S = 1.0
    #: Longest wait for a message before looking whether :meth:`stop` was called.
    LISTEN_S = 1.0

    def __init__(self, broker: Wakeable) -> None:
        super().__init__(name="wake-ups", daemon=True)
        self.broker = broker
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.is_set():
            pubsub = self.broker.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(layout.WAKE_CHANNEL)
                while not self._stopped.is_set():
                    message = pubsub.get_message(timeout=self.LISTEN_S)
                    if message is not None:
                        self.broker.wake(layout.text(message["data"]))
            except redis.exceptions.NoPermissionError as error:
                logger.info("no wake-ups (the Redis user may not subscribe): %s", error)
                return
            except redis.RedisError:
                self._stopped.wait(self.RECONNECT_S)
            finally:
                pubsub.close()


#: Dramatiq writes ``actor_name`` near the start of a body: where :func:`_actor_in` looks.
