"""Cancellation: a message named by ``producer.cancel`` is skipped if it has not started, and
interrupted if it runs; either way it is acked and counted ``cancelled``, never a failure."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import redis
from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage
from dramatiq.middleware.threading import raise_thread_exception
from dramatiq.worker import Worker

from .. import layout
from ..lifecycle import Cancelled
from ..settlement import CANCELLED_OPTION

logger = logging.getLogger(__name__)


class Cancellation(Middleware):
    """Keeps this process's copy of the cancellations in force and acts on them.

    A listener thread (one Redis connection, no polling) subscribes to
    :data:`..layout.CANCEL_CHANNEL`, then reads :data:`..layout.CANCELLED`, so no
    cancellation announced before or while it (re)connects is missed. A message it names:

    * not started yet (queued, delayed, a retry copy): skipped when fetched, acked;
    * running in this process: interrupted at once with :class:`..lifecycle.Cancelled`
      (as the time limit interrupts: Python code at once, a C call when it returns; an
      ``async def`` handler's coroutine is cancelled). ``checkpoint()`` needs nothing more.

    Both are counted ``jobs_processed_total{outcome="cancelled"}`` and never retried.
    Per job it costs two dictionary operations and one set look-up.

    The sandbox's queue has its own cancellations (:func:`..layout.cancelled_key` of its
    namespace, which its Redis user may read; it may not subscribe): a process serving it
    asks Redis whether each message is cancelled before running it (one round trip per
    job: a sandbox job starts a confined process, far slower), and its listener polls every
    :attr:`LISTEN_S` for the cancellations recorded since, to interrupt a running job.

    Parameters:
      client: the broker's Redis client.
      queues: the queues this process serves (``WORKER_QUEUES``).
    """

    #: Seconds between two tries to listen again after the connection was lost.
    RECONNECT_S = 1.0
    #: Longest wait for an announcement before looking whether the worker stops.
    LISTEN_S = 1.0
    #: Seconds between two prunings of lapsed cancellations from memory.
    PRUNE_S = 600.0

    def __init__(self, client: redis.Redis, queues: list[str]) -> None:
        self.client = client
        namespaces = layout.namespaces_of(queues)
        self.listens = layout.NAMESPACE in namespaces
        #: The sandbox's namespace when this process serves its queue (it polls), else None.
        self.polls = layout.SANDBOX_NAMESPACE if not self.listens and namespaces else None
        #: Message id -> when its cancellation lapses (epoch ms).
        self.cancelled: dict[str, float] = {}
        #: Handler thread id -> the message id it runs (each thread sets and pops its own).
        self._running: dict[int, str] = {}
        self._stopped = threading.Event()
        #: When the latest cancellation read lapses (Redis time, ms): the poll reads from it.
        self._read_to: int | None = None
        self._listener: threading.Thread | None = None
        #: Held while a cancel looks for its message among the running ones; a handler that
        #: ends takes it only while :attr:`_cancelling` (most jobs take no lock).
        self._lock = threading.Lock()
        self._cancelling = 0

    # -- the listener -------------------------------------------------------------------

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        """Read the cancellations in force before the consumers fetch anything (else a
        message cancelled while no worker ran could run before the listener has read them),
        then start the listener."""
        if (self.listens or self.polls) and self._listener is None:
            with contextlib.suppress(redis.RedisError):  # unreachable: the listener reads them
                self._load()
            self._listener = threading.Thread(
                target=self._listen if self.listens else self._poll,
                name="cancellations",
                daemon=True,
            )
            self._listener.start()

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._stopped.set()

    def _listen(self) -> None:
        pruned = time.monotonic()
        while not self._stopped.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            try:
                pubsub.subscribe(layout.CANCEL_CHANNEL)
                pubsub.get_message(timeout=self.LISTEN_S)  # the subscription is confirmed
                self._load()
                while not self._stopped.is_set():
                    announced = pubsub.get_message(timeout=self.LISTEN_S)
                    if announced is not None:
                        self.cancel(layout.text(announced["data"]))
                    if time.monotonic() - pruned > self.PRUNE_S:
                        pruned = time.monotonic()
                        self._prune()
            except redis.exceptions.NoPermissionError as error:
                logger.warning(
                    "cancellations are not heard (the Redis user may not subscribe): %s", error
                )
                return
            except redis.RedisError:
                self._stopped.wait(self.RECONNECT_S)
            finally:
                pubsub.close()

    def _poll(self) -> None:
        """The sandbox's listener: read the cancellations recorded since the last read."""
        while not self._stopped.wait(self.LISTEN_S):
            try:
                self._load()
            except redis.RedisError as error:
                logger.debug("cancellations not read: %s", error)

    def _load(self) -> None:
        """Record every cancellation in force (:func:`..layout.cancelled_ids`), or those
        recorded since the last read (the sandbox's, polled)."""
        namespace = self.polls or layout.NAMESPACE
        after = self._read_to if self.polls else None
        for message_id, lapses in layout.cancelled_ids(self.client, namespace, after).items():
            self._read_to = max(self._read_to or 0, lapses)
            if message_id not in self.cancelled:
                self.cancel(message_id, lapses)

    def cancel(self, message_id: str, lapses: float | None = None) -> bool:
        """Record the cancellation of ``message_id`` (until ``lapses``, epoch ms; default:
        :data:`..layout.CANCEL_TTL_MS` from now) and interrupt it if it runs here; True
        when it did."""
        self.cancelled[message_id] = lapses or time.time() * 1000 + layout.CANCEL_TTL_MS
        self._cancelling += 1
        try:
            with self._lock:
                for thread_id, running in list(self._running.items()):
                    if running == message_id:
                        raise_thread_exception(thread_id, Cancelled)
                        logger.info("cancelled job interrupted", extra={"job_id": message_id})
                        return True
            return False
        finally:
            self._cancelling -= 1

    def _prune(self) -> None:
        now = time.time() * 1000
        for message_id, lapses in list(self.cancelled.items()):
            if lapses < now:
                self.cancelled.pop(message_id, None)

    # -- per message ----------------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        me, message_id = threading.get_ident(), message.message_id
        self._running[me] = message_id  # first: a cancel that comes now sees it
        if message_id in self.cancelled or self._cancelled_in_redis(message_id):
            self._running.pop(me, None)
            message.options[CANCELLED_OPTION] = True
            raise SkipMessage("cancelled")

    def _cancelled_in_redis(self, message_id: str) -> bool:
        """The sandbox's look-up (:attr:`polls`); False elsewhere, or when Redis does not
        answer (the job runs: its poll interrupts it once Redis answers)."""
        if self.polls is None:
            return False
        try:
            return layout.is_cancelled(self.client, message_id, self.polls)
        except redis.RedisError as error:
            logger.warning("cannot tell whether a job is cancelled: %s", error)
            return False

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        try:  # while a cancel looks (under its lock), it either interrupted the handler or
            if self._cancelling:  # sees it ended
                with self._lock:
                    self._running.pop(threading.get_ident(), None)
            else:
                self._running.pop(threading.get_ident(), None)
        except Cancelled:
            pass  # raised a moment too late, into this hook: the job had ended

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._running.pop(threading.get_ident(), None)
