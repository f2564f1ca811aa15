"""Our Redis consumer: nothing fetched is stranded, no delivery ends before its outcome is stored.

Dramatiq's ``_RedisConsumer`` fetches bodies without their Redis ids and decodes them
in the consumer thread: one body that is not a Dramatiq message (not JSON, a JSON
list, no ``actor_name``, ``options: null``, no ``redis_message_id``) raises there and
leaves itself and the good messages fetched with it in the acks set, counted nowhere.
Its Retries enqueue the retry copy from a middleware hook, where a Redis error is
logged and swallowed, and the original is acked later: a retry is lost when Redis is
down at that moment. :class:`SettlingRedisBroker` and :class:`SettlingConsumer` fix both:

* The fetch returns each Redis id with its body, and every body is checked
  (:func:`.messages.inspect`) before it is handed on. A malformed message is dead-lettered
  at once, by id, with the reason in ``options.dead_letter_reason`` (``dlq list``
  shows it), counted as ``jobs_processed_total{outcome="dead_letter"}`` and logged; the
  messages fetched with it are handed on as usual.
* A delivery ends with one :class:`Settlement`, stored in one Lua call with the ack:
  the retry copy is stored on the delay queue, the message requeued or dead-lettered
  *together with* its removal from the acks set, or not at all. While Redis does not
  answer the settlement is retried (Dramatiq retries ``post_process_message`` every
  5 s) and the message stays held: if the process dies meanwhile, it is redelivered.
  Middleware asks for a settlement with :func:`.settlement.settle_with`.
* A handler's freed slot is refilled by its settlement: the same Lua call that stores
  the outcome takes the next message, so with prefetch equal to the concurrency (no
  message waits behind a long job in a busy process while another replica idles) a
  handler's next job costs no round trip of its own. Each thread sends its settlements
  on a connection of its own (:class:`SettleLanes`): one command, without a checkout
  from the client's pool. Dramatiq's consumer instead slept
  until its next timed fetch, up to ``worker_timeout`` per job. The consumer thread
  fetches what the refills leave free at once (a settlement wakes it); only an empty
  queue is polled on a timer (a growing pause up to ``timeout``). Slots are counted
  under one lock, so fetched-and-unsettled messages never exceed the prefetch.
* An idle consumer costs little: an empty queue is polled every :data:`IDLE_POLL_MS`
  at most (a growing pause, as Dramatiq's, up to 1 s: about two fetches a second per
  queue, its own and its delay queue's), and a producer wakes it at once: an enqueue
  publishes the queue's name on :data:`.layout.WAKE_CHANNEL` in the same round trip (a
  retry or a requeue by a settlement in a round trip of its own), and each worker
  process listens (:class:`WakeUps`, one connection, no polling). The sandbox pool's
  queue has no wake-ups (its Redis user has no pub/sub rights): it is only polled.
* A consumer outlives the restarts of its consumer thread (one per queue), so its
  count of held messages stays right after an outage.
* Delayed messages (``send_with_options(delay=...)``, a retry's backoff) are never held
  by a process: the delay queue's consumer moves each due one to its queue in one Lua
  step (:data:`.layout.MOVE_DUE`), ordered by due time in Redis (a due message never
  waits behind a later one), then sleeps until the next is due. Dramatiq's delay
  consumer instead fetched up to a thousand per thread in list order, held their bodies
  in memory until due, and enqueued a copy before acking the original: a process that
  froze past its heartbeat ran them twice, one that was killed between the two did too.
* One clock: a delayed message's ``eta`` and a new message's ``message_timestamp`` are
  written on Redis's clock (:meth:`SettlingRedisBroker.redis_millis`: this host's clock
  plus the offset the last heartbeat's ``TIME`` measured), and due messages are moved by
  Redis's clock. A worker (or producer) whose clock is minutes off neither runs a retry
  early nor holds it back, and the backlog's age (:mod:`.exporter`, also on Redis's
  clock) is right.
* A fetch or settlement whose reply is lost after Redis ran it (a socket timeout, a
  dropped connection) took messages this process never saw, and its retry takes
  others. The Recovery pass requeues them once they have stayed unknown for
  :data:`ORPHAN_AFTER_S` (:meth:`SettlingConsumer.reclaim_orphans`), instead of leaving
  them held until the process stops.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import redis
from dramatiq import Actor, Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.redis import RedisBroker, _RedisConsumer
from dramatiq.common import compute_backoff, current_millis, dq_name
from dramatiq.errors import ConnectionClosed
from dramatiq.middleware import Middleware, MiddlewareError

from . import brokerstate, layout, redisclient, unique
from .holds import HOLD_EPOCH, HoldWatch
from .lanes import SettleLanes
from .messages import dead_letter_body, indexed_id, inspect
from .outage import Outage
from .settlement import (
    ACK,
    REJECT_SIGNAL,
    REQUEUE,
    RESET_SIGNAL,
    THROTTLE_SIGNAL,
    UNKNOWN_ACTOR,
    Settlement,
    SettlingBroker,
    ending,
    mark_lost,
)
from .timing import CLOCK_FRESH_S, ORPHAN_AFTER_S
from .wakeups import WakeUps

logger = logging.getLogger(__name__)
#: Attribute of a MessageProxy: the resets this process had seen when it was fetched.
_RESETS_AT_FETCH = "_resets_at_fetch"
#: Attribute of a MessageProxy: a settlement of it was sent and failed (it may have run).
_SETTLE_TRIED = "_settle_tried"

#: Longest pause (ms) between two fetches of an empty queue (Dramatiq's default timeout);
#: a wake-up (:class:`WakeUps`) or the drain ends it at once.
IDLE_POLL_MS = 1000


class SettlingConsumer(_RedisConsumer):
    """Consumes one queue for a :class:`SettlingRedisBroker` (created by its ``consume``).

    Parameters:
      broker: the broker.
      queue_name: the queue (``q`` or its delay queue ``q.DQ``).
      prefetch: the most messages held at once (fetched and not yet settled).
      timeout: the longest pause (ms) between fetches of an empty queue.
    """

    broker: SettlingRedisBroker

    def __init__(
        self, broker: SettlingRedisBroker, queue_name: str, prefetch: int, timeout: int
    ) -> None:
        super().__init__(broker, queue_name, prefetch, timeout)  # type: ignore[no-untyped-call]
        self.message_cache: list[tuple[str, bytes | None]] = []
        #: The oldest heartbeat epoch (:class:`.holds.HoldWatch`) under which a message of
        #: the cache was fetched: a start checks its hold under it.
        self._cache_epoch = 0
        self.held: set[str] = set()
        #: Slots claimed by a fetch or refill still on its way (see :meth:`_claim`).
        self.claimed = 0
        self._slots = threading.Lock()
        self._slot_freed = threading.Event()
        #: Set by :meth:`wake`: ends the pause after an empty fetch.
        self._woken = threading.Event()
        #: The consumer thread's ``handle_message`` (Dramatiq's ``_ConsumerThread``: a
        #: message onto the work queue, or the delay queue when it has an eta), taken by
        #: :meth:`SettlingRedisBroker.consume` from the thread that calls it; None when
        #: consumed from elsewhere. Handler threads pass their refills on through it.
        self.dispatch: Callable[[MessageProxy], None] | None = None
        self.delayed = queue_name.endswith(layout.DELAY_SUFFIX)
        #: The downstream resources this queue's deliveries hold (none for a delay queue).
        self.gates = () if self.delayed else broker.gates.get(queue_name, ())
        self._fetch_keys = layout.fetch_keys(broker.broker_id, queue_name, self.gates)
        #: What the last fetch or refill said of the messages it left queued.
        self.admission = layout.ADMITTED
        #: Ids held in Redis and not in memory: when each was first seen so.
        self._unknown_since: dict[str, float] = {}

    @property
    def outstanding_message_count(self) -> int:
        return len(self.held) + len(self.message_cache) + self.claimed

    # -- slots (both threads) ----------------------------------------------------------------

    def _claim(self, most: int, releasing: str | None = None) -> int:
        """Claim up to ``most`` free slots for a fetch; 0 once the broker stopped fetching.

        ``releasing``: a held id whose settlement is about to free its slot (the refill
        may take that slot)."""
        with self._slots:
            if releasing is not None:
                self.held.discard(releasing)
            free = int(self.prefetch) - self.outstanding_message_count
            count = max(0, min(most, free)) if self.broker.fetching else 0
            self.claimed += count
            return count

    def _fill(self, claimed: int, fetched: list[tuple[str, bytes | None]], epoch: int = 0) -> None:
        """A fetch that claimed ``claimed`` slots, sent under the heartbeat epoch ``epoch``,
        is back with ``fetched``."""
        with self._slots:
            self.claimed -= claimed
            if fetched:
                cached = self._cache_epoch if self.message_cache else epoch
                self._cache_epoch = min(cached, epoch)
                self.message_cache.extend(fetched)
        self._slot_freed.set()

    def _hand_on(self, claimed: int, fetched: list[tuple[str, bytes | None]], epoch: int) -> None:
        """Pass a refill on from the handler thread that settled (see :attr:`dispatch`): its
        next job is on the work queue without waking the consumer thread, whose wake-up
        would wait for the interpreter lock while the other handlers run. The consumer
        thread takes the refill when there is no dispatch, and is woken when the refill
        left a slot free."""
        dispatch = self.dispatch
        if dispatch is None or not fetched:
            self._fill(claimed, fetched, epoch)
            return
        with self._slots:
            self.claimed -= claimed
            self.held.update(redis_id for redis_id, _ in fetched)
        if len(fetched) < claimed:
            self._slot_freed.set()
        for redis_id, body in fetched:
            message = self._admit(redis_id, body, epoch)
            if message is not None:
                dispatch(message)

    def _no_free_slot(self) -> bool:
        """True when a fetch could take nothing: every slot held, or fetching stopped."""
        return self.outstanding_message_count >= int(self.prefetch) or not self.broker.fetching

    def _next_cached(self) -> tuple[str, bytes | None, int] | None:
        """The first fetched message, now held, and its fetch's epoch; None when none is
        cached."""
        with self._slots:
            if not self.message_cache:
                return None
            redis_id, body = self.message_cache.pop(0)
            self.held.add(redis_id)
            return redis_id, body, self._cache_epoch

    # -- fetching (the consumer thread) ------------------------------------------------------

    def __next__(self) -> MessageProxy | None:
        try:
            if self.delayed:
                self._move_due()
                return None
            while True:
                cached = self._next_cached()
                if cached is not None:
                    self.misses = 0
                    message = self._admit(*cached)
                    if message is not None:
                        return message
                    continue
                if self._no_free_slot():
                    # Every slot is taken: sleep until a delivery is settled, not on a timer
                    # (checked again once the event is cleared: a settlement may have come).
                    self._slot_freed.clear()
                    if self._no_free_slot():
                        self._slot_freed.wait(self.timeout / 1000)
                    return None
                claimed = self._claim(self.prefetch)
                fetched: list[tuple[str, bytes | None]] = []
                self._woken.clear()  # a wake-up from now on (a message enqueued) ends the pause
                epoch = self.broker.holds.epoch  # before the fetch is sent
                try:
                    fetched = self._fetch(claimed) if claimed else []
                finally:
                    self._fill(claimed, fetched, epoch)
                if fetched:
                    continue
                # The queue is empty (or held back: paused, over a budget or a rate): poll it
                # again after a growing pause, up to IDLE_POLL_MS, unless a producer (or the
                # drain) wakes it first; held back, only the drain or the next token ends it.
                self.misses, backoff_ms = compute_backoff(self.misses, max_backoff=IDLE_POLL_MS)
                if self.admission.reason:
                    self._hold_back(self.admission, backoff_ms)
                else:
                    self._woken.wait(backoff_ms / 1000)
                return None
        except redis.RedisError as error:
            raise ConnectionClosed(error) from None

    def _move_due(self) -> None:
        """The delay queue's turn: move what is due to its queue (:data:`.layout.MOVE_DUE`,
        one atomic step: nothing delayed is ever held by this process, so a process that
        freezes or dies holds no delayed message, and a due one never waits behind a later
        one), wake the queue's consumers when it moved some, then wait until the next one
        is due (:data:`IDLE_POLL_MS` at most; an enqueue on the delay queue, a retry, or the
        drain ends the wait). Hands nothing on."""
        wait_s = self.timeout / 1000
        if self.broker.fetching:
            self._woken.clear()
            step = layout.move_due(self.broker.due_script, self.queue_name)
            if step.moved:
                self.broker.wake(layout.canonical(self.queue_name))
                self.broker.publish_wake(layout.canonical(self.queue_name))
            wait_s = step.wait_s(IDLE_POLL_MS / 1000)
        if wait_s > 0:
            self._woken.wait(wait_s)

    def _fetch(self, count: int) -> list[tuple[str, bytes | None]]:
        broker = self.broker
        args = layout.fetch_args(
            count,
            broker.broker_id,
            self.queue_name,
            self.gates,
            broker.lease_ms,
            broker.bound,
            broker.key_limit(self.queue_name),
        )
        raw = self.broker.fetch_script(keys=self._fetch_keys, args=args)
        admission, fetched = layout.taken(raw)
        self.held_back(admission)
        return fetched

    def held_back(self, admission: layout.Admission) -> None:
        """Note what a fetch or refill said of the messages it left queued; signal a throttle
        (:data:`.settlement.THROTTLE_SIGNAL`) so ``jobs_throttled_total`` counts it."""
        self.admission = admission
        if admission.reason in (layout.BUDGET, layout.RATE, layout.KEY):
            queue = layout.canonical(self.queue_name)
            self.broker.emit_after(THROTTLE_SIGNAL, queue, admission.reason, admission.deferred)

    def _hold_back(self, admission: layout.Admission, backoff_ms: int) -> None:
        """Wait before fetching a queue that held its messages back: until the next token
        (a rate), or the growing pause (a budget: a settlement elsewhere frees a slot; a
        pause), up to IDLE_POLL_MS. An enqueue's wake-up does not end it (a busy producer
        would make every held-back consumer fetch for nothing); the drain does."""
        wait_ms = admission.wait_ms if admission.reason == layout.RATE else backoff_ms
        deadline = time.monotonic() + min(max(wait_ms, 1), IDLE_POLL_MS) / 1000
        while self.broker.fetching and (left := deadline - time.monotonic()) > 0:
            self._woken.wait(left)
            self._woken.clear()

    def _admit(self, redis_id: str, body: bytes | None, epoch: int) -> MessageProxy | None:
        """The held message ``redis_id``, fetched under the heartbeat epoch ``epoch``, to hand
        on; None when it was not one (then settled: dropped or dead-lettered, and its slot
        freed)."""
        message = self._check(redis_id, body)
        if message is None:
            self._release(redis_id)
            return None
        # A message moved from the delay queue keeps its eta (the backlog's age counts from
        # it); on its queue it runs now: Dramatiq's consumer thread would hold a message with
        # an eta and enqueue a copy of it.
        message.options.pop("eta", None)
        proxy = MessageProxy(message)
        setattr(proxy, _RESETS_AT_FETCH, self.broker.epoch.resets)
        setattr(proxy, HOLD_EPOCH, epoch)
        return proxy

    def _check(self, redis_id: str, body: bytes | None) -> Message[Any] | None:
        """The message, or None when it was malformed (then dead-lettered)."""
        if body is None:
            # Queued without a body (deleted meanwhile): nothing to run; stop holding it.
            self.broker.settle(self.queue_name, redis_id, ACK)
            logger.warning(
                "dropped a queued id without a body",
                extra={"queue": layout.canonical(self.queue_name), "redis_id": redis_id},
            )
            return None
        limit = self.broker.max_message_bytes
        if limit is not None and len(body) > limit:
            # Sent past the producers' check (bare Dramatiq, raw Redis): not parsed (a copy
            # as big again), dead-lettered as it is stored.
            reason = f"message of {len(body):,} bytes is over MAX_MESSAGE_BYTES ({limit:,})"
            self.broker.settle(self.queue_name, redis_id, Settlement("dead_letter"))
            self.broker.rejected(self.queue_name, redis_id, None, _actor_in(body), reason)
            return None
        problem, message, fields = inspect(body, self.queue_name, redis_id, self.broker.actors)
        if problem is None:
            return message
        reason = f"malformed message: {problem}"
        stored = dead_letter_body(body, self.queue_name, reason, message, fields)
        message_id = indexed_id(fields)
        self.broker.settle(self.queue_name, redis_id, Settlement("dead_letter", stored), message_id)
        known = fields if isinstance(fields, dict) else {}
        self.broker.rejected(
            self.queue_name,
            redis_id,
            message_id or None,
            _str_or_none(known.get("actor_name")),
            reason,
        )
        return None

    @property
    def acks_key(self) -> str:
        """This worker's acks set of the queue (what it holds in Redis)."""
        return layout.acks_key(self.broker.broker_id, self.queue_name)

    def reclaim_orphans(self, now: float, held_in_redis: Iterable[Any] | None = None) -> int:
        """Requeue the messages this worker holds in Redis but nowhere in memory; return how
        many. A fetch or settlement whose reply was lost after Redis ran it (a socket
        timeout, a dropped connection) took messages that nobody here knows of, and the
        retried call took others: without this they would wait in the acks set until this
        process stops. An id is requeued once it was unknown in every look for
        :data:`ORPHAN_AFTER_S` (``now``: ``time.monotonic()``); the requeue is the
        settlement's, so an id settled meanwhile is left alone.

        Parameters:
          held_in_redis: the members of this worker's acks set of the queue, when the
            caller read them (:meth:`SettlingRedisBroker.reclaim_orphans` reads every
            queue's in one call, :data:`.layout.MEMBERS`); None: read here.
        """
        if held_in_redis is None:
            held_in_redis = self.broker.client.smembers(self.acks_key)
        in_redis = {layout.text(raw) for raw in held_in_redis}
        with self._slots:
            known = self.held.union(redis_id for redis_id, _ in self.message_cache)
        self._unknown_since = {
            redis_id: self._unknown_since.get(redis_id, now) for redis_id in in_redis - known
        }
        due = [i for i, since in self._unknown_since.items() if now - since >= ORPHAN_AFTER_S]
        for redis_id in due:
            self.broker.settle(self.queue_name, redis_id, REQUEUE)
            del self._unknown_since[redis_id]
        if due:
            logger.warning(
                "requeued messages held in Redis but lost by this process",
                extra={"queue": layout.canonical(self.queue_name), "requeued": len(due)},
            )
        return len(due)

    # -- settling (worker threads) -------------------------------------------------------------

    def ack(self, message: MessageProxy) -> None:
        self._settle(message, ending(message, failed=False))

    def nack(self, message: MessageProxy) -> None:
        self._settle(message, ending(message, failed=True))

    def _settle(self, message: MessageProxy, settlement: Settlement) -> None:
        """Store ``settlement`` and refill the slot it frees in the same call."""
        redis_id = message.options[layout.REDIS_MESSAGE_ID]
        fetched_here = redis_id in self.held
        refill = self._claim(1, releasing=redis_id)
        epoch = self.broker.holds.epoch  # before the refill is sent
        try:
            settled, fetched, admission = self.broker.settle_and_take(
                self.queue_name,
                redis_id,
                settlement,
                refill,
                message.message_id,
                message.options.get(layout.UNIQUE_LOCK, ""),
            )
        except redis.RedisError as error:
            # Still held: Dramatiq retries the settlement until Redis answers; in the drain,
            # it is left held for recovery (the drain ends in its window).
            with self._slots:
                self.held.add(redis_id)
            self._fill(refill, [])
            setattr(message, _SETTLE_TRIED, True)
            if not self.broker.fetching:
                logger.warning(
                    "drain: could not settle a delivery, Redis does not answer; it stays held "
                    "and is recovered after WORKER_HEARTBEAT_TIMEOUT_MS (it may run again)",
                    extra={
                        "event": "settle_left_for_recovery",
                        "queue": layout.canonical(self.queue_name),
                        "job_id": message.message_id,
                        "error": f"{type(error).__name__}: {error}",
                    },
                )
                return
            raise ConnectionClosed(error) from None
        except BaseException:
            self._fill(refill, [])
            raise
        resent = self.broker.lanes.resent() or getattr(message, _SETTLE_TRIED, False)
        self.broker.epoch.ended(self.queue_name, redis_id)
        if not settled:
            self._not_held(message, resent, fetched_here)
        if refill:
            self.held_back(admission)
        self._hand_on(refill, fetched, epoch)
        if settlement.sent is not None:
            self.broker.emit_after("enqueue", settlement.sent, settlement.delay)

    def _not_held(self, message: MessageProxy, resent: bool, fetched_here: bool) -> None:
        """The settlement found ``message`` no longer held: mark it lost (the Metrics
        middleware counts ``jobs_lost_total`` and logs it, never as its outcome), unless an
        earlier attempt whose reply was lost stored it (``resent``, and no reset since).
        One this consumer never fetched (or settled already; ``fetched_here`` false: a
        caller's mistake, e.g. a bare ``Message`` nacked) is not a lost job: logged, as is."""
        if not fetched_here:
            logger.warning(
                "settled a message this worker does not hold: it never fetched it here, or "
                "settled it already; nothing was stored",
                extra={
                    "job_id": message.message_id,
                    "queue": layout.canonical(self.queue_name),
                    "redis_id": message.options[layout.REDIS_MESSAGE_ID],
                },
            )
            return
        epoch = self.broker.epoch
        try:  # a reset not seen yet is seen now, before the message is judged
            epoch.check([layout.namespace_of(self.queue_name)])
        except redis.RedisError as error:
            logger.warning("cannot read the broker epoch now: %s", error)
        if epoch.resets > getattr(message, _RESETS_AT_FETCH, epoch.resets):
            mark_lost(message, "Redis lost its data (broker reset) while this worker held it")
        elif not resent:
            mark_lost(
                message,
                "no longer held: another worker recovered it (this worker's heartbeat was "
                "older than WORKER_HEARTBEAT_TIMEOUT_MS); it runs again there",
            )

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        redis_ids = [message.options[layout.REDIS_MESSAGE_ID] for message in messages]
        try:
            for redis_id in redis_ids:
                self.broker.settle(self.queue_name, redis_id, REQUEUE)
                self._release(redis_id)
        except redis.RedisError as error:
            raise ConnectionClosed(error) from None

    def wake(self) -> None:
        """Wake the consumer thread if it waits for a free slot or pauses on an empty queue."""
        self._woken.set()
        self._slot_freed.set()

    def _release(self, redis_id: str) -> None:
        """``redis_id`` is no longer held: wake the consumer thread to fill its slot now."""
        with self._slots:
            self.held.discard(redis_id)
        self._slot_freed.set()


class SettlingRedisBroker(RedisBroker, SettlingBroker):
    """A :class:`~dramatiq.brokers.redis.RedisBroker` whose consumers settle deliveries
    atomically and never strand a malformed message (see the module docstring).

    Takes RedisBroker's parameters, ``max_message_bytes`` (``MAX_MESSAGE_BYTES``: a
    bigger body is dead-lettered without being parsed; None: no limit) and ``outage`` (the
    :class:`.outage.Outage` of ``REDIS_URL``). ``consume``
    returns one consumer per queue for the life of the broker, so a consumer thread that
    restarts keeps its count of held messages.
    """

    def __init__(
        self,
        max_message_bytes: int | None = None,
        state_dir: Path | None = None,
        outage: Outage | None = None,
        gates: dict[str, tuple[layout.Gate, ...]] | None = None,
        lease_ms: int = 0,
        priority_bound: int = layout.DEFAULT_PRIORITY_BOUND,
        **parameters: Any,
    ) -> None:
        super().__init__(**parameters)  # type: ignore[no-untyped-call]
        #: An actor may name its messages' default priority, and a field of its typed
        #: arguments as their fairness key, with a limit in flight per key
        #: (:mod:`.layout.queuelanes`).
        self.actor_options |= {
            layout.ACTOR_PRIORITY_OPTION,
            layout.ACTOR_KEY_OPTION,
            layout.ACTOR_KEY_LIMIT_OPTION,
        }
        self._key_limits: dict[str, int] = {}
        #: A waiting job is passed over by at most this many jobs of higher priority lanes.
        self.bound = priority_bound
        #: Says when Redis stops and starts answering (:mod:`.outage`; the recovery pass and
        #: the consumer threads report to it).
        self.outage = outage or Outage("")
        #: Queue -> the downstream resources its deliveries hold (:mod:`.layout.flow`); a
        #: queue not named is not gated (its pool uses none). None: none (a producer).
        self.gates = dict(gates or {})
        #: How long a downstream slot stays taken when nothing frees it (ms).
        self.lease_ms = lease_ms
        #: A fetched body bigger than this is dead-lettered unread (None: no limit).
        self.max_message_bytes = max_message_bytes
        #: Notices that Redis lost its data (``state_dir``: where readiness reads it).
        self.epoch = brokerstate.BrokerEpoch(
            self.client, self.held_deliveries, self._on_reset, state_dir
        )
        #: The gaps of this process's heartbeats: whether a fetched message is surely held.
        self.holds = HoldWatch(self.heartbeat_timeout)
        self.fetch_script = self.client.register_script(layout.FETCH)
        self.enqueue_script = self.client.register_script(layout.ENQUEUE)
        self.settle_script = self.client.register_script(layout.SETTLE)
        self.due_script = self.client.register_script(layout.MOVE_DUE)
        self.members_script = self.client.register_script(layout.MEMBERS)
        self.lanes = SettleLanes(self.client)
        #: False once :meth:`stop_fetching` was called: consumers and refills take nothing.
        self.fetching = True
        self._hooked: dict[str, list[Middleware]] = {}
        self._hooked_stack: list[Middleware] | None = None
        self._hooked_size = 0
        self._consumers: dict[str, SettlingConsumer] = {}
        self._consumers_lock = threading.Lock()
        #: Redis's clock minus this host's, ms, as of the last heartbeat (:meth:`keep_time`)
        #: or ``TIME`` read by :meth:`redis_millis`.
        self.clock_offset_ms = 0
        #: ``time.monotonic()`` when the offset was last measured (None: never).
        self._clock_measured: float | None = None
        self._wake_ups: WakeUps | None = None

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> SettlingConsumer:
        with self._consumers_lock:
            consumer = self._consumers.get(queue_name)
            if consumer is None:
                consumer = SettlingConsumer(self, queue_name, prefetch, timeout)
                self._consumers[queue_name] = consumer
            if self._wake_ups is None and layout.namespace_of(queue_name) == layout.NAMESPACE:
                # A process that consumes listens for wake-ups (not the sandbox's: no rights).
                self._wake_ups = WakeUps(self)
                self._wake_ups.start()
            consumer.prefetch, consumer.timeout = prefetch, timeout
            consumer.dispatch = getattr(threading.current_thread(), "handle_message", None)
            return consumer

    # -- signals: only to the middleware that handle them ---------------------------------

    def emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None:
        """Dramatiq's ``emit_before``, calling only the middleware that define the hook (a
        dozen middleware and a few signals per job: most calls were the base no-op)."""
        hook = "before_" + signal
        self._emit(hook, self._handling(hook), args, kwargs, reraise=(MiddlewareError,))

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        """Dramatiq's ``emit_after`` (bottom-up), calling only the middleware that define it."""
        hook = "after_" + signal
        self._emit(hook, reversed(self._handling(hook)), args, kwargs, reraise=())

    def _emit(
        self,
        hook: str,
        middleware: Iterable[Middleware],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reraise: tuple[type[Exception], ...],
    ) -> None:
        """Call ``hook`` of each of ``middleware``; a failure is logged (as Dramatiq does),
        except the ``reraise`` kinds."""
        for each in middleware:
            try:
                getattr(each, hook)(self, *args, **kwargs)
            except reraise:
                raise
            except Exception:
                self.logger.critical("Unexpected failure in %s of %r.", hook, each, exc_info=True)

    def _handling(self, hook: str) -> list[Middleware]:
        """The middleware, in order, whose class or instance defines ``hook`` (kept per hook
        until the stack changes: another list, or a longer or shorter one, as
        ``add_middleware`` makes it)."""
        stack = self.middleware
        if self._hooked_stack is not stack or self._hooked_size != len(stack):
            self._hooked, self._hooked_stack, self._hooked_size = {}, stack, len(stack)
        found = self._hooked.get(hook)
        if found is None:
            base = getattr(Middleware, hook, None)
            found = self._hooked[hook] = [
                m
                for m in stack
                if hook in vars(m) or getattr(type(m), hook, None) not in (None, base)
            ]
        return found

    def flush(self, queue_name: str) -> None:
        """Dramatiq's flush (the queue, its delay queue and their dead letters), the delay
        queue's due set (:func:`.layout.due_key`) and the queue's other lanes."""
        super().flush(queue_name)
        lanes = layout.waiting_keys(layout.canonical(queue_name))
        self.client.delete(layout.due_key(queue_name), *lanes)

    def stop_fetching(self) -> None:
        """Take no more messages (the drain): consumers and refills fetch nothing from now on."""
        self.fetching = False
        for consumer in list(self._consumers.values()):
            consumer.wake()

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Dramatiq's enqueue; a Redis that refuses it for being full raises
        :class:`.brokerstate.BrokerFull`, one line naming the actor and the fix; one that
        does not answer, :class:`.brokerstate.EnqueueUncertain` (it may have been enqueued:
        a resend of the same message stores it at most once)."""
        try:
            sent = self._enqueue(message, delay)
        except redis.ResponseError as error:
            if brokerstate.is_oom(error):
                what = f"message for actor {message.actor_name!r}"
                raise brokerstate.full_error(what, error) from None
            raise
        except (redis.ConnectionError, redis.TimeoutError) as error:
            raise brokerstate.uncertain_error(message, error) from None
        return sent

    def _enqueue(self, message: Message[Any], delay: int | None) -> Message[Any]:
        """Dramatiq 2's ``RedisBroker.enqueue``, on Redis's clock (:meth:`redis_millis`): the
        ``eta`` of a delayed message, and the ``message_timestamp`` of a new one (not yet
        enqueued: no redis id; one moved from the delay queue keeps its own), from which
        the backlog's age is counted. A new one is stored once per message id
        (:data:`.layout.ENQUEUE`): a resend after an uncertain send stores nothing. A new
        unique job (:mod:`.unique`) is stored only while no equal job holds its lock, else
        :class:`.unique.DuplicateJob` is raised (a debounce may replace the pending one)."""
        new = layout.REDIS_MESSAGE_ID not in message.options
        lock = None
        if new:  # a unique job (:mod:`.unique`) takes its lock in the same call
            message, lock = unique.lock_for(self.actors.get(message.actor_name), message, delay)
        message = self.prepare_enqueue(message, delay)
        stored = self._store(message, once=new, lock=lock)
        if stored.action == layout.DEDUPE_SKIPPED:
            key = message.options[layout.UNIQUE_LOCK]
            raise unique.DuplicateJob(message.actor_name, key, stored.holder)
        if stored.stored:
            self.emit_after("enqueue", message, delay)
        return message

    def declare_actor(self, actor: Actor[Any, Any]) -> None:
        """Dramatiq's; an actor whose ``priority_lane`` is not a priority, or whose
        ``fair_key`` is not a field of its typed arguments, is refused (one line,
        :class:`.layout.PriorityError`, ``ValueError``)."""
        layout.priority_of({}, actor.options.get(layout.ACTOR_PRIORITY_OPTION))
        layout.check_fair_key(
            actor.actor_name,
            actor.options.get(layout.ACTOR_KEY_OPTION),
            actor.options.get(layout.ACTOR_KEY_LIMIT_OPTION),
            getattr(getattr(actor, "model", None), "model_fields", None),
        )
        super().declare_actor(actor)
        self._key_limits.clear()

    def key_limit(self, queue: str) -> int:
        """Deliveries of one fairness key of ``queue`` in flight at most: the lowest
        ``fair_key_limit`` of its actors (0: none)."""
        found = self._key_limits.get(queue)
        if found is None:
            limits = [
                int(actor.options[layout.ACTOR_KEY_LIMIT_OPTION])
                for actor in list(self.actors.values())
                if actor.queue_name == queue and actor.options.get(layout.ACTOR_KEY_LIMIT_OPTION)
            ]
            found = self._key_limits[queue] = min(limits, default=0)
        return found

    def prepare_enqueue(self, message: Message[Any], delay: int | None = None) -> Message[Any]:
        """``message`` as :meth:`enqueue` stores it (its redis id, its timestamp, its delay
        queue and ``eta``, its priority: its own or its actor's ``priority_lane``; one that
        is not a priority raises :class:`.layout.PriorityError`, nothing stored),
        ``before_enqueue`` emitted: what a script that enqueues it atomically with other
        writes stores (then emits ``after_enqueue``)."""
        now = self.redis_millis()
        options: dict[str, Any] = {layout.REDIS_MESSAGE_ID: str(uuid.uuid4())}
        actor = self.actors.get(message.actor_name)
        default = None if actor is None else actor.options.get(layout.ACTOR_PRIORITY_OPTION)
        priority = layout.priority_of(message.options, default)
        if priority != layout.DEFAULT_PRIORITY:
            options[layout.PRIORITY_OPTION] = priority
        changes: dict[str, Any] = {}
        if layout.REDIS_MESSAGE_ID not in message.options:
            changes["message_timestamp"] = now
        if delay is not None:
            options["eta"] = now + delay
            changes["queue_name"] = dq_name(message.queue_name)
        message = message.copy(options=options, **changes)
        self.emit_before("enqueue", message, delay)
        return message

    def held_deliveries(self) -> set[tuple[str, str]]:
        """Every delivery this process holds now (fetched, not settled): (queue, redis id)."""
        with self._consumers_lock:
            consumers = list(self._consumers.values())
        held: set[tuple[str, str]] = set()
        for consumer in consumers:
            with consumer._slots:
                ids = consumer.held.union(redis_id for redis_id, _ in consumer.message_cache)
            held.update((consumer.queue_name, redis_id) for redis_id in ids)
        return held

    def observe_epochs(self, epochs: dict[str, Any]) -> None:
        """:meth:`.brokerstate.BrokerEpoch.observe` each namespace's epoch token."""
        for namespace, value in epochs.items():
            self.epoch.observe(namespace, value)

    def _on_reset(self, cause: str) -> None:
        self.emit_after(RESET_SIGNAL, cause)

    def keep_time(self, redis_ms: int) -> None:
        """Redis's clock read just now (a heartbeat's reply): Dramatiq's dispatch script, which
        writes this worker's heartbeat with the timestamp it is given (an enqueue from a
        handler, a delayed message moved to its queue), is given Redis's time, not a skewed
        host's, which would make this worker look dead (or alive for ever) to the others."""
        self.clock_offset_ms = redis_ms - layout.now_ms()
        self._clock_measured = time.monotonic()

    def redis_millis(self) -> int:
        """Redis's clock now (ms since the epoch): this host's plus the offset measured at
        the last heartbeat; a process without heartbeats (a producer), or whose last one is
        older than :data:`CLOCK_FRESH_S`, reads ``TIME`` first (one round trip, at most
        once per :data:`CLOCK_FRESH_S`). Never raises: while Redis does not answer, the
        last offset measured stands (this host's clock when none was)."""
        measured = self._clock_measured
        if measured is None or time.monotonic() - measured > CLOCK_FRESH_S:
            try:
                self.keep_time(layout.redis_now_ms(self.client))
            except redis.RedisError as error:
                self._clock_measured = time.monotonic()  # tried again in CLOCK_FRESH_S
                logger.warning("cannot read Redis's clock now, the last offset stands: %s", error)
        return current_millis() + self.clock_offset_ms

    def host_millis(self, redis_ms: float) -> float:
        """``redis_ms`` (an instant on Redis's clock) on this host's clock."""
        self.redis_millis()  # the offset, measured within CLOCK_FRESH_S
        return redis_ms - self.clock_offset_ms

    def _dispatch(self, command: str) -> Callable[..., Any]:
        """Dramatiq's dispatch script (enqueue, qsize, purge), run on the namespace of the
        queue it is called for (:func:`.layout.namespace_of`) instead of the broker's one:
        a message for the sandbox's queue, and the heartbeat the script writes, land in the
        sandbox namespace whoever sends it. The arguments are Dramatiq 2's
        ``RedisBroker._dispatch``'s."""
        dispatch = self.scripts["dispatch"]

        def do_dispatch(queue_name: str, *args: Any) -> Any:
            arguments = self._dispatch_arguments(command, queue_name, args)
            return dispatch(args=arguments, keys=[layout.namespace_of(queue_name)])

        return do_dispatch

    def _dispatch_arguments(self, command: str, queue_name: str, args: Sequence[Any]) -> list[Any]:
        """The ARGV of Dramatiq's dispatch script for ``command`` on ``queue_name``."""
        return [
            command,
            self.redis_millis(),
            queue_name,
            self.broker_id,
            self.heartbeat_timeout,
            self.dead_message_ttl,
            self._should_do_maintenance(command),
            self._max_unpack_size(),  # type: ignore[no-untyped-call]
            *args,
        ]

    def _store(
        self, message: Message[Any], once: bool = False, lock: layout.UniqueLock | None = None
    ) -> layout.Stored:
        """Store ``message`` (prepared by :meth:`prepare_enqueue`), note its place in the
        message index (:func:`.layout.message_index_key`) and wake the idle consumers of its
        queue (not the sandbox's: its Redis user may not use pub/sub, its consumers poll), in
        one step (:data:`.layout.ENQUEUE`); ``once``: only when its message id was not sent
        in the last :data:`.layout.SENT_TTL_MS`; ``lock``: a unique job's, taken with it."""
        return layout.enqueue_message(
            self.enqueue_script,
            message.queue_name,
            message.options[layout.REDIS_MESSAGE_ID],
            message.encode(),
            message.message_id,
            once,
            layout.stored_priority(message.options),
            str(message.options.get(layout.FAIRNESS_KEY_OPTION) or ""),
            int(message.message_timestamp),
            lock,
        )

    def wake(self, queue: str) -> None:
        """A message was enqueued on ``queue`` (named on a wake channel): wake its consumer."""
        consumer = self._consumers.get(queue)
        if consumer is not None:
            consumer.wake()

    def settle(
        self, queue: str, redis_id: str, settlement: Settlement, message_id: str = ""
    ) -> bool:
        """Store ``settlement`` of the delivery ``redis_id`` held on ``queue``; False when
        this worker no longer held it (someone else recovered it). ``message_id`` (default:
        none) keeps the message index, as :meth:`settle_and_take`."""
        settled, _, _ = self.settle_and_take(queue, redis_id, settlement, 0, message_id)
        return settled

    def reclaim_orphans(self, now: float) -> int:
        """:meth:`SettlingConsumer.reclaim_orphans` on every queue this worker consumes."""
        with self._consumers_lock:
            consumers = list(self._consumers.values())
        keys = [consumer.acks_key for consumer in consumers]  # one call for every queue
        held = layout.members_of(self.members_script(keys=keys)) if keys else []
        return sum(
            consumer.reclaim_orphans(now, members)
            for consumer, members in zip(consumers, held, strict=True)
        )

    def still_holds(self, deliveries: list[tuple[str, str]]) -> list[bool]:
        """For each (queue, redis id) of ``deliveries``: is it in this worker's acks set?
        One round trip."""
        pipe = self.client.pipeline(transaction=False)
        for queue, redis_id in deliveries:
            pipe.sismember(layout.acks_key(self.broker_id, queue), redis_id)
        return [bool(held) for held in pipe.execute()] if deliveries else []

    def settle_and_take(
        self,
        queue: str,
        redis_id: str,
        settlement: Settlement,
        take: int,
        message_id: str = "",
        lock: str = "",
    ) -> tuple[bool, list[tuple[str, bytes | None]], layout.Admission]:
        """:meth:`settle` (which frees the delivery's downstream slots), then take up to
        ``take`` messages off ``queue`` into this worker's acks set as flow control admits
        (:mod:`.layout.flow`), in one call: (settled, [(redis id, body or None), ...], what
        it said of those it left queued). ``message_id`` (default: none) keeps the message
        index (:func:`.layout.message_index_key`); ``lock``: a unique job's, freed by an ack
        or a dead letter (:mod:`.layout.unique`)."""
        gates = () if queue.endswith(layout.DELAY_SUFFIX) else self.gates.get(queue, ())
        target = settlement.target_queue or queue
        raw = self.lanes.call(
            self.settle_script,
            layout.settle_keys(self.broker_id, queue, target, gates),
            layout.settle_args(
                (settlement.kind, redis_id, settlement.body, settlement.target_id),
                self.broker_id,
                take,
                message_id,
                queue,
                gates,
                self.lease_ms,
                self.bound,
                self.key_limit(queue),
                lock,
            ),
        )
        if raw[0] and settlement.kind in ("retry", "requeue"):
            self.publish_wake(settlement.target_queue or queue)
        admission, fetched = layout.taken(raw, head=1)
        return bool(raw[0]), fetched, admission

    def publish_wake(self, queue: str) -> None:
        """Wake the idle consumers of ``queue`` (a message was stored on it outside an
        enqueue: a retry, a requeue); best effort: without it they poll."""
        if layout.namespace_of(queue) != layout.NAMESPACE:
            return  # the sandbox's queue: its Redis user may not publish
        with contextlib.suppress(redis.RedisError):
            self.client.publish(layout.WAKE_CHANNEL, queue)

    def bound_timeouts(self, seconds: float) -> None:
        """No Redis call of this broker (its client's, its lanes') waits longer than
        ``seconds`` from now on (:func:`.redisclient.bound_timeouts`): the drain's bound."""
        redisclient.bound_timeouts(self.client, seconds, self.lanes.connections())

    def close(self) -> None:
        """Stop listening for wake-ups; disconnect the settlement lanes (:class:`SettleLanes`); a
        reset still unresolved is no longer this process's (its readiness notice goes)."""
        if self._wake_ups is not None:
            self._wake_ups.stop()
        self.epoch.close()
        self.lanes.close()
        super().close()

    def rejected(
        self,
        queue: str,
        redis_id: str,
        job_id: str | None,
        actor: str | None,
        reason: str,
    ) -> None:
        """Signal (:data:`.settlement.REJECT_SIGNAL`, for the middleware that count it) and
        log a malformed message that was dead-lettered without running."""
        label = actor if actor is not None and actor in self.actors else UNKNOWN_ACTOR
        self.emit_after(REJECT_SIGNAL, layout.canonical(queue), label, reason=reason)
        logger.warning(
            "job dead_letter",
            extra={
                "event": "job_end",
                "job_id": job_id or "-",
                "redis_id": redis_id,
                "queue": layout.canonical(queue),
                "actor": actor or "-",
                "outcome": "dead_letter",
                "reason": reason,
            },
        )


_HEAD_BYTES = 4096
_ACTOR_NAME = re.compile(rb'"actor_name"\s*:\s*"([^"\\]{1,200})"')


def _actor_in(body: bytes) -> str | None:
    """The ``actor_name`` in the first bytes of a body too big to parse, if it is there."""
    found = _ACTOR_NAME.search(body[:_HEAD_BYTES])
    return found.group(1).decode("utf-8", "replace") if found else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
