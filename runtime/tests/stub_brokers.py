"""Dramatiq StubBrokers for the middleware's unit tests, with the collaborators that the
middleware find on the worker's broker injected instead of a RedisBroker around them."""

from __future__ import annotations

from typing import Any

import dramatiq
import redis
from dramatiq import Worker
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.brokers.stub import StubBroker

from worker_runtime.settlement import Settlement, SettlingBroker, ending


class SettlingStubBroker(StubBroker, SettlingBroker):
    """A StubBroker that ends each delivery as the worker's SettlingRedisBroker does, with
    the :class:`Settlement` the middleware asked for (:func:`.settlement.ending`), recorded in
    :attr:`settled` as (queue, Redis id, settlement) instead of stored in Redis."""

    def __init__(self, middleware: list[dramatiq.Middleware]) -> None:
        super().__init__(middleware=middleware)
        self.settled: list[tuple[str, str, Settlement]] = []

    def settle(self, queue: str, redis_id: str, settlement: Settlement) -> bool:
        self.settled.append((queue, redis_id, settlement))
        return True

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 100) -> Consumer:
        consumer = super().consume(queue_name, prefetch, timeout)
        return _SettlingStubConsumer(self, queue_name, consumer)

    def settlements(self) -> list[Settlement]:
        """What ended each delivery, in order."""
        return [settlement for _, _, settlement in self.settled]


class _SettlingStubConsumer(Consumer):
    """The StubBroker's consumer, settling each delivery as ``SettlingConsumer`` does."""

    def __init__(self, broker: SettlingStubBroker, queue: str, consumer: Any) -> None:
        self.broker, self.queue, self.consumer = broker, queue, consumer

    def __next__(self) -> MessageProxy | None:
        found: MessageProxy | None = next(self.consumer)
        return found

    def ack(self, message: MessageProxy) -> None:
        self.broker.settle(self.queue, message.message_id, ending(message, failed=False))
        self.consumer.ack(message)

    def nack(self, message: MessageProxy) -> None:
        self.broker.settle(self.queue, message.message_id, ending(message, failed=True))
        self.consumer.nack(message)

    def requeue(self, messages: Any) -> None:
        self.consumer.requeue(messages)

    def close(self) -> None:
        self.consumer.close()


class RedisStubBroker(StubBroker):
    """A StubBroker that carries what the Redis-facing middleware read from the worker's
    RedisBroker: its ``client`` (a real Redis, for the Lua) and its ``broker_id``."""

    def __init__(
        self, middleware: list[dramatiq.Middleware], client: redis.Redis, broker_id: str = "w-1"
    ) -> None:
        super().__init__(middleware=middleware)
        self.client = client
        self.broker_id = broker_id

    def reclaim_orphans(self, now: float) -> int:
        """The worker's broker requeues what it holds in Redis but lost in memory; this
        one holds nothing in memory and keeps its Redis as it is (the pass's own test uses
        the worker's broker)."""
        return 0

    def keep_time(self, redis_ms: int) -> None:
        """The worker's broker keeps Redis's clock for Dramatiq's dispatch script; this one
        dispatches nothing."""

    def observe_epochs(self, epochs: dict[str, Any]) -> None:
        """The worker's broker notices a reset from the epochs; this one holds nothing."""


def work_off(broker: StubBroker, queue: str) -> None:
    """Run a Worker with one thread on ``broker`` until ``queue`` is empty and settled;
    handlers that fail do not stop it (their outcomes are what the tests look at)."""
    worker = Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        broker.join(queue, timeout=5000, fail_fast=False)
    finally:
        worker.stop()
