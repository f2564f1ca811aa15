"""Our Redis consumer: nothing fetched is stranded, no delivery ends before its outcome is stored.

(:class:`SettlingRedisBroker`, its broker, lives in :mod:`.redisbroker`.)

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

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import redis
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.redis import _RedisConsumer
from dramatiq.common import compute_backoff
from dramatiq.errors import ConnectionClosed

from . import layout
from .holds import HOLD_EPOCH
from .messages import dead_letter_body, indexed_id, inspect
from .settlement import (
    ACK,
    ADMISSION_SIGNAL,
    LOST_MARK,
    REQUEUE,
    SETTLEMENT_MARK,
    THROTTLE_SIGNAL,
    Settlement,
    ending,
    mark_lost,
)
from .timing import ORPHAN_AFTER_S

if TYPE_CHECKING:
    from .redisbroker import SettlingRedisBroker

logger = logging.getLogger(__name__)
#: Attribute of a MessageProxy: the resets this process had seen when it was fetched.
_RESETS_AT_FETCH = "_resets_at_fetch"
#: Attribute of a MessageProxy: a settlement of it was sent and failed (it may have run).
_SETTLE_TRIED = "_settle_tried"
#: Set on a MessageProxy this process let go of (:meth:`SettlingConsumer.give_up`).
_GIVEN_UP = "_given_up"
#: Why a message let go of is lost here (counted in ``jobs_lost_total``).
NOT_HELD_REASON = (
    "no longer held: another worker recovered it (this worker's heartbeat was older than "
    "WORKER_HEARTBEAT_TIMEOUT_MS); it runs again there"
)


class Delivery(MessageProxy):
    """A fetched message as the handler and the middleware see it: Dramatiq's proxy whose
    own attributes are the message's fields (the same objects: ``options`` is the message's
    dict) and, as class attributes, the unset marks a delivery may carry. Dramatiq's proxy
    reads a field through its ``__getattr__`` (a Python call) and an unset mark through it
    and the message (two exceptions): 46 reads per job in this runtime's stack, a tenth of
    a no-op job's time (``bench/noop_profile.py``)."""

    def __init__(self, message: Message[Any]) -> None:
        super().__init__(message)
        self.__dict__.update(
            queue_name=message.queue_name,
            actor_name=message.actor_name,
            args=message.args,
            kwargs=message.kwargs,
            options=message.options,
            message_id=message.message_id,
            message_timestamp=message.message_timestamp,
        )


for _mark, _unset in (
    (SETTLEMENT_MARK, None),
    (LOST_MARK, None),
    (_SETTLE_TRIED, False),
    (_GIVEN_UP, False),
):
    setattr(Delivery, _mark, _unset)

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
        #: Held ids a fetch took again while this process still held them (see :meth:`_new`).
        self.again: set[str] = set()
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
                self.again.discard(releasing)
            free = int(self.prefetch) - self.outstanding_message_count
            count = max(0, min(most, free)) if self.broker.fetching else 0
            self.claimed += count
            return count

    def _fill(self, claimed: int, fetched: list[tuple[str, bytes | None]], epoch: int = 0) -> None:
        """A fetch that claimed ``claimed`` slots, sent under the heartbeat epoch ``epoch``,
        is back with ``fetched``."""
        with self._slots:
            self.claimed -= claimed
            fetched = self._new(fetched)
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
            fetched = self._new(fetched)
            self.held.update(redis_id for redis_id, _ in fetched)
        if len(fetched) < claimed:
            self._slot_freed.set()
        for redis_id, body in fetched:
            message = self._admit(redis_id, body, epoch)
            if message is not None:
                dispatch(message)

    def _new(self, fetched: list[tuple[str, bytes | None]]) -> list[tuple[str, bytes | None]]:
        """``fetched`` without the messages this process holds in memory already (called
        with the slots' lock held). This worker, frozen past its heartbeat timeout, was
        recovered while no other worker took the requeued messages: it fetched them again
        beside the copies it still held, and its hold check (:data:`.layout.STILL_HELD`),
        which asks whether the id is in its acks set, would pass both. They are one message:
        the copy in memory runs (or goes on running) and settles it once."""
        if self.held.isdisjoint(redis_id for redis_id, _ in fetched) and not self.message_cache:
            return fetched
        known = self.held.union(redis_id for redis_id, _ in self.message_cache)
        again = [redis_id for redis_id, _ in fetched if redis_id in known]
        if not again:
            return fetched
        self.again.update(again)
        logger.warning(
            "fetched again messages this process still holds (it was recovered while frozen "
            "and took the requeued copies): each runs once, here",
            extra={"queue": layout.canonical(self.queue_name), "redis_ids": again},
        )
        return [(redis_id, body) for redis_id, body in fetched if redis_id not in known]

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
            broker.key_rate(self.queue_name),
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
        (a rate, or a key's rate that held back all it could take), or the growing pause
        (a budget: a settlement elsewhere frees a slot; a pause), up to IDLE_POLL_MS. An
        enqueue's wake-up does not end it (a busy producer would make every held-back
        consumer fetch for nothing); the drain does."""
        timed = admission.reason == layout.RATE or (
            admission.reason == layout.KEY and admission.wait_ms
        )
        wait_ms = admission.wait_ms if timed else backoff_ms
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
        eta = message.options.pop("eta", None)
        if self._flow_controlled():
            due_ms = max(message.message_timestamp, eta if isinstance(eta, int | float) else 0)
            waited_s = max(0.0, (self.broker.redis_millis() - due_ms) / 1000)
            queue = layout.canonical(self.queue_name)
            self.broker.emit_after(ADMISSION_SIGNAL, queue, waited_s)
        proxy = Delivery(message)
        setattr(proxy, _RESETS_AT_FETCH, self.broker.epoch.resets)
        setattr(proxy, HOLD_EPOCH, epoch)
        return proxy

    def _flow_controlled(self) -> bool:
        """Whether this queue's fetch may hold a due message back: gated by a downstream, or
        with a per-key limit or rate (then its admissions are timed)."""
        broker = self.broker
        queue = self.queue_name
        return bool(self.gates or broker.key_limit(queue) or broker.key_rate(queue).per_s)

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
        if getattr(message, _GIVEN_UP, False):
            mark_lost(message, NOT_HELD_REASON)
            return
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
            mark_lost(message, NOT_HELD_REASON)

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
            self.again.discard(redis_id)
        self._slot_freed.set()

    def give_up(self, message: MessageProxy) -> bool:
        """Redis said this process no longer holds ``message`` (another worker's recovery
        requeued it while this one was frozen): let it go, unless a fetch has taken it again
        since (:meth:`_new`; then it is held and runs here): True when let go. Decided under
        the lock the fetch's check takes, so one of the two copies runs. A message let go of
        is settled with no Redis call (its id may be held again by a later fetch) and
        counted lost."""
        redis_id = message.options[layout.REDIS_MESSAGE_ID]
        with self._slots:
            if redis_id in self.again:
                return False
            self.held.discard(redis_id)
        setattr(message, _GIVEN_UP, True)
        self._slot_freed.set()
        return True


_HEAD_BYTES = 4096
_ACTOR_NAME = re.compile(rb'"actor_name"\s*:\s*"([^"\\]{1,200})"')


def _actor_in(body: bytes) -> str | None:
    """The ``actor_name`` in the first bytes of a body too big to parse, if it is there."""
    found = _ACTOR_NAME.search(body[:_HEAD_BYTES])
    return found.group(1).decode("utf-8", "replace") if found else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
