"""Redis key names: Dramatiq's and ours, each built by one function here.

The one module that spells a Redis key (``tests/test_architecture.py`` fails on a key
spelled anywhere else). Dramatiq's own layout (``dramatiq/brokers/redis/dispatch.lua``),
for a queue ``q`` and a worker (broker) id ``w``:

* ``dramatiq:q``: list of redis message ids ready to run (the list KEDA watches);
* ``dramatiq:q.msgs``: hash redis message id -> encoded message;
* ``dramatiq:q.DQ`` and ``dramatiq:q.DQ.msgs``: the delay queue (retries with
  backoff, ``delay=``), the same shape; producers (ours and bare Dramatiq's) append to it;
* ``dramatiq:q.XQ`` (zset id -> time of death, ms) and ``dramatiq:q.XQ.msgs``:
  dead letters, for ``q`` and its delay queue alike (there is no ``q.DQ.XQ``);
* ``dramatiq:__acks__.w.q``: set of ids ``w`` fetched and has not acked yet
  (one per queue and delay queue);
* ``dramatiq:__heartbeats__``: zset worker id -> last heartbeat, ms.

Ours beside them: ``dramatiq:q.DQ.due`` (:func:`due_key`), the delay queue's messages
ordered by when each is due (a zset id -> eta, ms): the worker moves each id off the
delay list into it, then each due one to ``q`` (:data:`.delayed.MOVE_DUE`), so a due
message never waits behind a later one and no worker holds a delayed one;
``dramatiq:__epoch__``, the namespace's epoch token (a reset is seen
when it is gone or replaced, :mod:`..brokerstate`), ``dramatiq:__probe__``, the
short-lived key readiness writes to learn that Redis takes writes, the wake-up channel,
the idempotency keys and leases, the scheduler's leader lock, and each schedule's state
hash and run lock, and each queue's last ``capacity`` result.

The sandbox pool's queue (:data:`SANDBOX_QUEUE`, customer code) has the same layout under
a namespace of its own, :data:`SANDBOX_NAMESPACE` (``dramatiq-sandbox:untrusted``, its
acks sets, its own ``dramatiq-sandbox:__heartbeats__``, ...): :func:`namespace_of` picks
the namespace of every key of a queue, so the sandbox pool's keys and any other pool's
are disjoint, and its Redis ACL user (``~dramatiq-sandbox:*``, rendered by worker_infra)
can neither forge nor remove another pool's heartbeat, acks, delayed or dead messages.

worker_infra spells the names KEDA and the alerts read (a queue's ready list, the delay
suffix, the namespace glob of the sandbox's ACL user) in its ``keys.py``; the template's
``tests/test_infra_keys.py`` checks them against this module, which imports nothing of
its package so that test can load it on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

#: Dramatiq's key prefix of every queue but the sandbox's.
NAMESPACE: Final = "dramatiq"
#: The sandbox pool's queue (untrusted code; ``actors/sandbox.py``). Only a pool with
#: ``sandbox = true`` serves it, and such a pool serves nothing else (pools.toml checks).
SANDBOX_QUEUE: Final = "untrusted"
#: The key prefix of :data:`SANDBOX_QUEUE`: disjoint from :data:`NAMESPACE`'s keys.
SANDBOX_NAMESPACE: Final = "dramatiq-sandbox"
#: Suffix of a queue's delay queue (``dramatiq.common.dq_name``).
DELAY_SUFFIX: Final = ".DQ"
#: Suffix of a queue's dead letters (``dramatiq.common.xq_name``).
DEAD_SUFFIX: Final = ".XQ"
#: Suffix of a delay queue's due-ordered zset (ours, :func:`due_key`).
DUE_SUFFIX: Final = ".due"
#: Suffix of the hash that holds a list's message bodies.
BODIES_SUFFIX: Final = ".msgs"
#: Worker heartbeats of the default namespace: zset broker id -> ms since the epoch.
HEARTBEATS: Final = f"{NAMESPACE}:__heartbeats__"
#: Prefix of the idempotency keys (ours): "done", or the token of the delivery running it.
IDEMPOTENCY_PREFIX: Final = "idempotency:"
#: Prefix of the idempotency leases (ours): the token of the delivery running the side effect.
IDEMPOTENCY_LEASE_PREFIX: Final = "idempotency-lease:"
#: How long readiness's write probe (:func:`probe_key`) lives, ms.
PROBE_TTL_MS: Final = 10_000


# -- names ------------------------------------------------------------------------------


def canonical(queue: str) -> str:
    """``q`` for the delay queue ``q.DQ`` (and for ``q``): the name metrics and pools use."""
    return queue.removesuffix(DELAY_SUFFIX)


def delay_queue(queue: str) -> str:
    """``q.DQ`` for ``q`` (and for ``q.DQ``)."""
    return canonical(queue) + DELAY_SUFFIX


def with_delay_queues(queues: Iterable[str]) -> list[str]:
    """``[q, q.DQ, ...]``: every queue a worker serving ``queues`` fetches from."""
    return [name for queue in queues for name in (queue, delay_queue(queue))]


def namespace_of(queue: str) -> str:
    """The key prefix of ``queue`` (or of its delay queue): :data:`SANDBOX_NAMESPACE` for
    :data:`SANDBOX_QUEUE`, else :data:`NAMESPACE`."""
    return SANDBOX_NAMESPACE if canonical(queue) == SANDBOX_QUEUE else NAMESPACE


def namespaces_of(queues: Iterable[str]) -> list[str]:
    """The namespaces of ``queues``, each once, in a stable order."""
    return sorted({namespace_of(queue) for queue in queues})


def heartbeats_key(namespace: str = NAMESPACE) -> str:
    """The heartbeats zset of the workers of ``namespace`` (default: :data:`NAMESPACE`)."""
    return f"{namespace}:__heartbeats__"


def epoch_key(namespace: str = NAMESPACE) -> str:
    """The epoch token of ``namespace`` (ours): written once (``SET NX``), read with every
    heartbeat; gone or replaced means Redis lost its data (:mod:`.brokerstate`)."""
    return f"{namespace}:__epoch__"


def process_key(broker_id: str, namespace: str = NAMESPACE) -> str:
    """What worker ``broker_id`` of ``namespace`` says of itself (ours): a JSON record (pool,
    host, pid, the jobs it runs and since when) written with its heartbeat, living one
    heartbeat timeout; ``status`` and the console read it (:func:`.fleet.read_fleet`)."""
    return f"{namespace}:__process__.{broker_id}"


#: Minutes of activity kept per queue (:func:`activity_key`): the console charts the last hour.
ACTIVITY_MINUTES: Final = 60


def activity_key(queue: str, minute: int) -> str:
    """What ``queue`` did in ``minute`` (Redis's ms // 60,000; ours): a hash of jobs ``done``
    and ``failed`` (retries and dead letters) and the oldest due ``age_ms`` the workers saw,
    kept :data:`ACTIVITY_MINUTES` and a few more: at most that many hashes a queue."""
    return f"{namespace_of(queue)}:__activity__.{queue}.{minute}"


def capacity_key(queue: str) -> str:
    """The last ``capacity`` result measured on ``queue`` (ours): a JSON object, what
    ``capacity --json`` prints and ``measured_at_ms`` (Redis's clock), replaced by the next
    measurement; the console charts it."""
    return f"{namespace_of(queue)}:__capacity__.{queue}"


def probe_key(namespace: str = NAMESPACE) -> str:
    """The key readiness writes (short-lived) to learn whether Redis takes writes."""
    return f"{namespace}:__probe__"


#: The pub/sub channel on which a producer names the queue it just enqueued on (its idle
#: consumers fetch at once instead of at their next poll). Only :data:`NAMESPACE`'s queues
#: have one: the sandbox's Redis user has no pub/sub rights, its consumers poll.
WAKE_CHANNEL: Final = f"{NAMESPACE}:__wake__"


def queue_key(queue: str) -> str:
    """The list of ids ready to run on ``queue`` (a queue or a delay queue)."""
    return f"{namespace_of(queue)}:{queue}"


def bodies_key(queue: str) -> str:
    """The hash of the message bodies of ``queue`` (a queue or a delay queue)."""
    return queue_key(queue) + BODIES_SUFFIX


def due_key(queue: str) -> str:
    """The zset of ``queue``'s delayed messages by due time (ours: id -> eta, ms since the
    epoch on Redis's clock); their bodies stay in the delay queue's hash until each is
    moved to ``queue``."""
    return queue_key(delay_queue(queue)) + DUE_SUFFIX


def acks_key(broker_id: str, queue: str) -> str:
    """The set of ids that worker ``broker_id`` fetched from ``queue`` and has not acked."""
    return f"{namespace_of(queue)}:__acks__.{broker_id}.{queue}"


def acks_pattern(broker_id: str, namespace: str = NAMESPACE) -> str:
    """A SCAN pattern matching every acks set of ``broker_id`` in ``namespace``."""
    return f"{namespace}:__acks__.{broker_id}.*"


def dead_letter_keys(queue: str) -> tuple[str, str]:
    """The zset and the hash of the dead letters of ``queue`` (or of its delay queue)."""
    zset = queue_key(canonical(queue)) + DEAD_SUFFIX
    return zset, zset + BODIES_SUFFIX


def idempotency_key(key: str) -> str:
    """The Redis key that records the side effect ``key`` as done."""
    return IDEMPOTENCY_PREFIX + key


def idempotency_lease_key(key: str) -> str:
    """The Redis key of the lease on the side effect ``key`` (short TTL, renewed)."""
    return IDEMPOTENCY_LEASE_PREFIX + key


@dataclass(frozen=True)
class QueueKeys:
    """Every key of one queue ``q``: ready list and bodies, delay list and bodies, dead
    letters, the delayed messages by due time."""

    ready: str
    ready_bodies: str
    delayed: str
    delayed_bodies: str
    dead: str
    dead_bodies: str
    due: str

    @classmethod
    def of(cls, queue: str) -> QueueKeys:
        name, delayed = canonical(queue), delay_queue(queue)
        dead, dead_bodies = dead_letter_keys(name)
        return cls(
            ready=queue_key(name),
            ready_bodies=bodies_key(name),
            delayed=queue_key(delayed),
            delayed_bodies=bodies_key(delayed),
            dead=dead,
            dead_bodies=dead_bodies,
            due=due_key(name),
        )


# -- schedules (ours; see scheduling/loop.py and middleware/schedule_lock.py) -----------------


def scheduler_leader_key() -> str:
    """The scheduler's leader lock (holder: the leading replica's id; ``SET NX PX``)."""
    return f"{NAMESPACE}:scheduler:leader"


def schedule_state_key(schedule: str) -> str:
    """Hash of one schedule: ``tick`` (handled through, epoch s), ``fired``, ``fired_at``,
    ``success_at``, ``since`` (first seen) and the ``runs:<outcome>`` counts."""
    return f"{NAMESPACE}:schedules:{schedule}"


def schedule_lock_key(schedule: str) -> str:
    """The run lock of ``schedule``: the running message's id, with the run's lease."""
    return f"{NAMESPACE}:schedules:{schedule}:lock"


# -- the job API: results, group completion, cancellation (ours; issue #26) ----------------

#: Prefix of a stored result's key (Dramatiq's Results ``RedisBackend`` namespace, with
#: ``use_namespace_prefix_keys``: each key is ``<namespace>:<queue>:<actor>:<message id>``, a
#: list of one JSON result with a TTL).
RESULTS_NAMESPACE: Final = f"{NAMESPACE}:__results__"


def group_keys(completion_uuid: str) -> tuple[str, str, str]:
    """The keys of one group's completion: Dramatiq's barrier (the group's size, ``SET NX PX``
    by ``group(...).run()``: its key is the bare completion uuid), the set of members that
    completed (message ids) and the callbacks' firing claim."""
    return completion_uuid, f"{completion_uuid}@done", f"{completion_uuid}@fired"


def cancelled_key(namespace: str = NAMESPACE) -> str:
    """The sorted set of cancelled message ids (Dramatiq's ``message_id``) of ``namespace``,
    scored by when each cancellation lapses (Redis time, ms; a later cancellation lapses
    later): a worker skips or interrupts a message it names."""
    return f"{namespace}:__cancelled__"


#: :func:`cancelled_key` of :data:`NAMESPACE`.
CANCELLED: Final = cancelled_key()


def message_index_key(namespace: str = NAMESPACE) -> str:
    """The hash message id -> ``"<bodies key> <redis id>"`` (:func:`message_place`) of the
    latest copy of each message this service stored in ``namespace`` (an enqueue, a retry
    copy), removed when that copy is settled (acked, dead-lettered): a message is found by
    its id in one look-up, never by reading the bodies."""
    return f"{namespace}:__where__"


def sent_key(message_id: str, namespace: str = NAMESPACE) -> str:
    """The marker of a producer's send of ``message_id`` in ``namespace`` (its value the
    redis id of the copy stored), kept :data:`.jobs.SENT_TTL_MS`: a resend of the same
    message id meanwhile stores nothing (:data:`.jobs.ENQUEUE`)."""
    return f"{namespace}:__sent__:{message_id}"


def message_place(queue: str, redis_id: str) -> str:
    """The value :func:`message_index_key` holds for the copy ``redis_id`` on ``queue`` (the
    scripts that keep the index, SETTLE and GROUP_MEMBER_DONE, join the same two parts)."""
    return f"{bodies_key(queue)} {redis_id}"


#: Channel on which a cancellation is announced (the message id), so that a running job
#: is interrupted at once; a worker that (re)subscribes reads :data:`CANCELLED` after.
CANCEL_CHANNEL: Final = f"{NAMESPACE}:__cancel__"


# -- flow control: pause, downstream budgets and rates (ours; issue #42) -----------------


def paused_key(namespace: str = NAMESPACE) -> str:
    """The hash queue -> when it was paused (Redis time, ms) of ``namespace``: FETCH and
    SETTLE take nothing from a queue it names (``pause``/``resume``, :mod:`.flow`)."""
    return f"{namespace}:__paused__"


def gates_key(namespace: str = NAMESPACE) -> str:
    """The hash queue -> the in-flight sets (:func:`downstream_key`, space-separated) its
    deliveries take a slot of, as the last fetch that charged them wrote it: the scripts
    that end a holding without knowing the pools (REQUEUE, DEAD_LETTER, hence recovery of
    a dead worker) free the slots there."""
    return f"{namespace}:__gates__"


def downstream_key(name: str) -> str:
    """The in-flight set of downstream ``name``: zset redis id -> the lease's end (Redis
    time, ms); its size is the budget in use across every pool that uses it."""
    return f"{NAMESPACE}:__downstream__.{name}"


def downstream_rate_key(name: str) -> str:
    """The token bucket of downstream ``name``'s rate: hash ``tokens``, ``at`` (ms)."""
    return f"{NAMESPACE}:__downstream__.{name}.rate"


# -- a queue's lanes: priorities (ours; issue #42) ------------------------------------------

#: The priority lanes of every queue, highest first (a message's ``priority`` option, an
#: actor's ``priority_lane`` option). ``normal``, the default, is Dramatiq's own list
#: (:func:`queue_key`: KEDA's list, where bare Dramatiq producers append); the others sit
#: beside it (:func:`lane_key`). Every lane's bodies are the queue's (:func:`bodies_key`).
PRIORITIES: Final = ("high", "normal", "low")
#: The lane of a message that names none.
DEFAULT_PRIORITY: Final = "normal"


def lane_key(queue: str, priority: str = DEFAULT_PRIORITY) -> str:
    """The list of ids waiting on ``queue`` (a canonical queue) at ``priority``:
    :func:`queue_key` for :data:`DEFAULT_PRIORITY`, ``<queue key>.<priority>`` for the others
    (a queue's name holds no dot: no queue's key is another's lane)."""
    if priority == DEFAULT_PRIORITY:
        return queue_key(queue)
    return f"{queue_key(queue)}.{priority}"


def lane_keys(queue: str) -> tuple[str, ...]:
    """Every list a consumer of ``queue`` takes from, highest priority first: the lanes of
    :data:`PRIORITIES`; a delay queue has one list (:func:`queue_key`), ordered by due time."""
    if queue != canonical(queue):
        return (queue_key(queue),)
    return tuple(lane_key(queue, priority) for priority in PRIORITIES)


def lanes_state_key(queue: str) -> str:
    """The hash of ``queue``'s lanes (priority -> jobs of higher lanes taken since it was
    last taken from, while it had messages waiting): the fetch's starvation bound."""
    return f"{queue_key(canonical(queue))}.lanes"


def fair_keys(queue: str) -> tuple[str, ...]:
    """The keys of ``queue``'s fair lane (per-key fairness, :mod:`.queuelanes`), in the
    scripts' order: the zset of its waiting keyed ids by turn (virtual time), the zset of
    the same ids by when each became due (the backlog's age), the hash id -> key of every
    keyed message waiting or running, the hash key -> its last turn given, the hash key ->
    its deliveries in flight, the lanes hash (:func:`lanes_state_key`), and the zset key ->
    the theoretical time (ms) of its next start under its rate (``fair_key_rate``; only
    while that time is ahead)."""
    base = queue_key(canonical(queue))
    return (
        f"{base}.fair",
        f"{base}.fair.since",
        f"{base}.fair.of",
        f"{base}.fair.last",
        f"{base}.fair.busy",
        lanes_state_key(queue),
        f"{base}.fair.next",
    )


def waiting_keys(queue: str) -> tuple[str, ...]:
    """Every key a script that puts a message back on ``queue`` needs to place it on its
    lane: :func:`lane_keys`, then (not for a delay queue) :func:`fair_keys`."""
    if queue != canonical(queue):
        return lane_keys(queue)
    return (*lane_keys(queue), *fair_keys(queue))


# -- unique jobs (ours; issue #42 item 3, :mod:`.unique`) ----------------------------------


def unique_key(actor: str, key: str, namespace: str = NAMESPACE) -> str:
    """The lock of the unique jobs of ``actor`` whose key is ``key``: the message id of the
    job that holds it, with the lock's TTL; taken by the enqueue that stores the job, freed
    by the settlement that ends it (an ack, a dead letter)."""
    return f"{namespace}:__unique__.{actor}.{key}"


def unique_counts_key(namespace: str = NAMESPACE) -> str:
    """The hash ``"<queue> <action>"`` -> how many sends a unique job's lock turned away
    (``skipped``) or merged into the pending job (``replaced``), counted by the enqueue."""
    return f"{namespace}:__unique_counts__"
