"""The worker's Redis broker: Dramatiq's ``RedisBroker`` on this runtime's Redis layout.

:class:`SettlingRedisBroker` owns the Redis client, the registered scripts of
:mod:`.layout` (FETCH, SETTLE, ENQUEUE and the rest, called through their typed
functions), the settlement of each delivery (:mod:`.settlement`: one Lua call with its ack
and the refill of the freed slot), the clock offset to Redis's ``TIME``, the epoch that
tells a reset Redis, and one :class:`.consumer.SettlingConsumer` per queue it consumes.
Why each differs from Dramatiq's broker is said in :mod:`.consumer`'s docstring.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import redis
from dramatiq import Actor, Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import current_millis, dq_name
from dramatiq.middleware import Middleware, MiddlewareError

from . import brokerstate, layout, redisclient, unique
from .consumer import SettlingConsumer
from .holds import HoldWatch
from .lanes import SettleLanes
from .outage import Outage
from .pools import default_burst, parse_rate
from .settlement import (
    REJECT_SIGNAL,
    RESET_SIGNAL,
    UNKNOWN_ACTOR,
    Settlement,
    SettlingBroker,
)
from .timing import CLOCK_FRESH_S
from .wakeups import WakeUps

logger = logging.getLogger(__name__)


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
        #: arguments as their fairness key, with a limit in flight and a rate of starts
        #: per key (:mod:`.layout.queuelanes`).
        self.actor_options |= {
            layout.ACTOR_PRIORITY_OPTION,
            layout.ACTOR_KEY_OPTION,
            layout.ACTOR_KEY_LIMIT_OPTION,
            layout.ACTOR_KEY_RATE_OPTION,
            layout.ACTOR_KEY_BURST_OPTION,
        }
        self._key_rules: dict[str, tuple[int, layout.KeyRate]] = {}
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

    def give_up(self, message: MessageProxy) -> bool:
        """Let ``message`` go: Redis said this process no longer holds it
        (:meth:`.SettlingConsumer.give_up`); False when a fetch took it again since."""
        consumer = self._consumers.get(message.queue_name)
        return consumer is None or consumer.give_up(message)

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
        """Dramatiq's; an actor whose ``priority_lane`` is not a priority, whose ``fair_key``
        is not a field of its typed arguments, that has both a key and a priority lane
        other than the default, or a ``fair_key_rate`` that is not a rate (or without a
        key), is refused (one line, :class:`.layout.PriorityError`, ``ValueError``)."""
        layout.check_fair_key(
            actor.actor_name,
            actor.options,
            getattr(getattr(actor, "model", None), "model_fields", None),
            layout.priority_of({}, actor.options.get(layout.ACTOR_PRIORITY_OPTION)),
        )
        key_rate_of(actor.actor_name, actor.options)
        super().declare_actor(actor)
        self._key_rules.clear()

    def key_limit(self, queue: str) -> int:
        """Deliveries of one fairness key of ``queue`` in flight at most: the lowest
        ``fair_key_limit`` of its actors (0: none)."""
        return self._keyed(queue)[0]

    def key_rate(self, queue: str) -> layout.KeyRate:
        """How fast one fairness key's deliveries of ``queue`` may start: the lowest
        ``fair_key_rate`` of its actors (with that actor's burst; none without one)."""
        return self._keyed(queue)[1]

    def _keyed(self, queue: str) -> tuple[int, layout.KeyRate]:
        """:meth:`key_limit` and :meth:`key_rate` of ``queue``, read from its actors once
        until the next actor is declared."""
        found = self._key_rules.get(queue)
        if found is None:
            actors = [actor for actor in list(self.actors.values()) if actor.queue_name == queue]
            limits = [
                int(actor.options[layout.ACTOR_KEY_LIMIT_OPTION])
                for actor in actors
                if actor.options.get(layout.ACTOR_KEY_LIMIT_OPTION)
            ]
            rates = [key_rate_of(actor.actor_name, actor.options) for actor in actors]
            rate = min(
                (rate for rate in rates if rate.per_s > 0),
                key=lambda rate: (rate.per_s, rate.burst),
                default=layout.NO_KEY_RATE,
            )
            found = self._key_rules[queue] = (min(limits, default=0), rate)
        return found

    def prepare_enqueue(self, message: Message[Any], delay: int | None = None) -> Message[Any]:
        """``message`` as :meth:`enqueue` stores it (its redis id, its timestamp, its delay
        queue and ``eta``, its priority: its own or its actor's ``priority_lane``; one that
        is not a priority, or any but the default for a keyed job, raises
        :class:`.layout.PriorityError`, nothing stored),
        ``before_enqueue`` emitted: what a script that enqueues it atomically with other
        writes stores (then emits ``after_enqueue``)."""
        now = self.redis_millis()
        options: dict[str, Any] = {layout.REDIS_MESSAGE_ID: str(uuid.uuid4())}
        actor = self.actors.get(message.actor_name)
        default = None if actor is None else actor.options.get(layout.ACTOR_PRIORITY_OPTION)
        priority = layout.priority_of(message.options, default)
        if priority != layout.DEFAULT_PRIORITY:
            if message.options.get(layout.FAIRNESS_KEY_OPTION) is not None:
                layout.check_keyed_priority(message.actor_name, priority)
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
                self.key_rate(queue),
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


def key_rate_of(actor: str, options: dict[str, Any]) -> layout.KeyRate:
    """The per-key rate an actor's ``options`` name (``fair_key_rate``, ``fair_key_burst``:
    default one second's worth), the options :func:`.layout.check_fair_key` accepted;
    ``ValueError`` in one line naming ``actor`` for a rate that does not parse."""
    rate, burst = (
        options.get(layout.ACTOR_KEY_RATE_OPTION),
        options.get(layout.ACTOR_KEY_BURST_OPTION),
    )
    if rate is None:
        return layout.NO_KEY_RATE
    try:
        per_s = parse_rate(str(rate))
    except ValueError as error:
        raise ValueError(f"actor {actor!r}: {layout.ACTOR_KEY_RATE_OPTION} {error}") from None
    return layout.KeyRate(per_s, default_burst(per_s) if burst is None else int(burst))
