"""The broker's Redis layout: Dramatiq's key names, ours, every Lua script we run, decoding.

The one module that knows how Redis is laid out; recovery, the dead-letter
tooling, the backlog metrics, ``capacity`` and the drain call it instead of
spelling keys. Dramatiq's own layout (``dramatiq/brokers/redis/dispatch.lua``),
for a queue ``q`` and a worker (broker) id ``w``:

* ``dramatiq:q``: list of redis message ids ready to run (the list KEDA watches);
* ``dramatiq:q.msgs``: hash redis message id -> encoded message;
* ``dramatiq:q.DQ`` and ``dramatiq:q.DQ.msgs``: the delay queue (retries with
  backoff, ``delay=``), the same shape;
* ``dramatiq:q.XQ`` (zset id -> time of death, ms) and ``dramatiq:q.XQ.msgs``:
  dead letters, for ``q`` and its delay queue alike (there is no ``q.DQ.XQ``);
* ``dramatiq:__acks__.w.q``: set of ids ``w`` fetched and has not acked yet
  (one per queue and delay queue);
* ``dramatiq:__heartbeats__``: zset worker id -> last heartbeat, ms.

Ours beside them: ``dramatiq:__epoch__``, the namespace's epoch token (a reset is seen
when it is gone or replaced, :mod:`.brokerstate`), and ``dramatiq:__probe__``, the
short-lived key readiness writes to learn that Redis takes writes.

One clock: every time our scripts write or compare (heartbeats, dead letters' times,
the cutoffs of recovery and retention, the scheduler's ticks) is Redis's ``TIME``, read
inside the Lua or by :func:`redis_now_ms`, never the host's: a worker whose clock is
minutes off neither judges live workers dead nor is judged dead. Scripts that may run
while Redis is full (``maxmemory`` reached, ``noeviction``) free before they write: a
heartbeat removes its old entry first, a fetch pops before it adds, a settlement removes
its id from the acks set first (Redis refuses a script's growing write only when the
script has written nothing yet).

The sandbox pool's queue (:data:`SANDBOX_QUEUE`, customer code) has the same layout under
a namespace of its own, :data:`SANDBOX_NAMESPACE` (``dramatiq-sandbox:untrusted``, its
acks sets, its own ``dramatiq-sandbox:__heartbeats__``, ...): :func:`namespace_of` picks
the namespace of every key of a queue, so the sandbox pool's keys and any other pool's
are disjoint, and its Redis ACL user (``~dramatiq-sandbox:*``, rendered by worker_infra)
can neither forge nor remove another pool's heartbeat, acks, delayed or dead messages.

Keys of our own get their builders here too (:func:`idempotency_key`,
:func:`idempotency_lease_key`, the schedules' leader lock, state hashes and run locks).

Each Lua script is a constant stating its KEYS and ARGV; it is called through
the typed function below it, so no caller assembles KEYS. A script that works
on several queues states its record widths as :data:`BACKLOG_KEYS` and
:data:`BACKLOG_FIELDS`; the Lua reads the width from ARGV.

This module imports neither Dramatiq nor redis-py at run time: the CLI stays fast.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import redis

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
    heartbeat timeout; ``status`` and the console read it (:func:`read_fleet`)."""
    return f"{namespace}:__process__.{broker_id}"


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
    """Every key of one queue ``q``: ready list and bodies, delay list and bodies, dead letters."""

    ready: str
    ready_bodies: str
    delayed: str
    delayed_bodies: str
    dead: str
    dead_bodies: str

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
        )


# -- decoding ---------------------------------------------------------------------------


def text(value: Any) -> str:
    """A Redis reply (bytes or str) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def raw_bytes(value: Any) -> bytes | None:
    """A Redis reply (bytes, str or None) as bytes, None kept."""
    return value.encode() if isinstance(value, str) else value


def message_fields(body: Any) -> dict[str, Any] | None:
    """A stored message body as a dict; None when it is missing, not JSON or not an object."""
    if not body:
        return None
    try:
        fields = json.loads(body)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None


#: The fields of a Dramatiq message and the JSON types each must have.
MESSAGE_FIELDS: Final[dict[str, tuple[tuple[type, ...], str]]] = {
    "queue_name": ((str,), "a string"),
    "actor_name": ((str,), "a string"),
    "args": ((list,), "a list"),
    "kwargs": ((dict,), "an object"),
    "options": ((dict,), "an object"),
    "message_id": ((str,), "a string"),
    "message_timestamp": ((int, float), "a number"),
}
#: Message options (the stored body's ``options``) that the middleware pass to each other;
#: the one place their names are spelled.
#: Dramatiq's RedisBroker: the id of the message in Redis (lists, hashes, acks sets).
REDIS_MESSAGE_ID: Final = "redis_message_id"
#: Dramatiq's Retries: failed attempts so far.
RETRIES: Final = "retries"
#: Recovery: deliveries lost to a dead worker process (counted against WORKER_MAX_ATTEMPTS).
CRASHES: Final = "crashes"
#: Ours: why a dead letter died (``dlq list`` shows it).
DEAD_LETTER_REASON: Final = "dead_letter_reason"
#: Ours: how often ``dlq replay`` sent this message again.
REPLAYS: Final = "replays"
#: Ours: the schema version of a typed actor's arguments (:mod:`.typed`).
SCHEMA_VERSION: Final = "schema_version"
#: Counters in a message's options that must be integers when present.
COUNTED_OPTIONS: Final = (RETRIES, CRASHES)


def crashes(options: dict[str, Any]) -> int:
    """Deliveries of a message lost to a dead worker process."""
    return int(options.get(CRASHES, 0))


def deliveries(options: dict[str, Any]) -> int:
    """Deliveries of a message that ended in a failure or a crash."""
    return int(options.get(RETRIES, 0)) + crashes(options)


def malformation(
    body: bytes, queue: str, parse: Callable[[bytes], Any] = json.loads
) -> tuple[str | None, Any]:
    """Why ``body``, fetched from ``queue``, is not a Dramatiq message it can run, or None.

    Returns (problem, parsed JSON or None). Checks the JSON object, each field and
    its type, the counters of its options, and that its ``queue_name`` is ``queue``
    (a message naming another queue would be acked on the wrong one). The Redis id
    and the actor are the caller's to check. ``parse`` reads the JSON (default
    ``json.loads``; it raises ``ValueError`` on a body that is not JSON).
    """
    try:
        fields = parse(body)
    except ValueError as error:
        return f"body is not JSON ({error})", None
    if not isinstance(fields, dict):
        return f"body is a JSON {_json_type(fields)}, must be an object", fields
    for name, (kinds, expected) in MESSAGE_FIELDS.items():
        if name not in fields:
            return f"no {name}", fields
        value = fields[name]
        if not isinstance(value, kinds) or isinstance(value, bool):
            return f"{name} is {_shown(value)}, must be {expected}", fields
    extra = sorted(set(fields) - set(MESSAGE_FIELDS))
    if extra:
        return f"unexpected fields {', '.join(extra)}", fields
    for counter in COUNTED_OPTIONS:
        value = fields["options"].get(counter, 0)
        if not isinstance(value, int) or isinstance(value, bool):
            return f"options.{counter} is {_shown(value)}, must be an integer", fields
    if fields["queue_name"] != queue:
        return f"queue_name {fields['queue_name']!r} is not its queue {queue!r}", fields
    return None, fields


def malformed_record(body: bytes, queue: str, reason: str, fields: Any) -> bytes:
    """What the dead letters keep of a body that is not a Dramatiq message: a record with
    the reason, whatever ``actor_name`` and ``message_id`` could be read, and the body as
    text in ``options.malformed_body``. ``dlq replay`` refuses it (not a message)."""
    known = fields if isinstance(fields, dict) else {}
    record = {
        "queue_name": canonical(queue),
        "actor_name": str(known.get("actor_name") or "-"),
        "message_id": str(known.get("message_id") or "-"),
        "options": {
            DEAD_LETTER_REASON: reason,
            "malformed_body": body.decode("utf-8", "backslashreplace"),
        },
    }
    return json.dumps(record).encode()


def _json_type(value: Any) -> str:
    names = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    return json.dumps(value)[:40]


def now_ms() -> int:
    """Milliseconds since the epoch by this host's clock (Dramatiq's); what workers compare
    uses :func:`redis_now_ms` instead."""
    return int(time.time() * 1000)


def redis_now_ms(client: redis.Redis) -> int:
    """Redis's clock (``TIME``), ms since the epoch: the one clock of every worker."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def redis_now(client: redis.Redis) -> float:
    """Redis's clock (``TIME``), seconds since the epoch."""
    seconds, micros = client.time()
    return int(seconds) + int(micros) / 1_000_000


# -- scripts ----------------------------------------------------------------------------

#: Requeue a held message. Only the caller that removes the id from the acks set moves it.
#: KEYS: acks set, bodies of the queue, the queue.  ARGV: redis id, new body or ''.
REQUEUE: Final = """
if redis.call('srem', KEYS[1], ARGV[1]) == 1 then
  if redis.call('hexists', KEYS[2], ARGV[1]) == 1 then
    if ARGV[2] ~= '' then redis.call('hset', KEYS[2], ARGV[1], ARGV[2]) end
    redis.call('rpush', KEYS[3], ARGV[1])
  end
  return 1
end
return 0
"""

#: Lua: Redis's clock in ms (``TIME``), and a heartbeat that frees its old entry before it
#: writes the new one (so a full Redis takes it: see the module docstring).
_CLOCK: Final = """
local function now_ms()
  local t = redis.call('time')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function beat(heartbeats, id, now)
  redis.call('zrem', heartbeats, id)
  redis.call('zadd', heartbeats, now, id)
end
"""

#: Dead-letter a held message: the same guard, then the zset and bodies, as Dramatiq's nack.
#: KEYS: acks set, bodies of the queue, dead zset, dead bodies.  ARGV: id, body.
DEAD_LETTER: Final = (
    _CLOCK
    + """
if redis.call('srem', KEYS[1], ARGV[1]) == 1 then
  redis.call('zadd', KEYS[3], now_ms(), ARGV[1])
  redis.call('hset', KEYS[4], ARGV[1], ARGV[2])
  redis.call('hdel', KEYS[2], ARGV[1])
  return 1
end
return 0
"""
)

#: Replay a dead letter; the removal from the dead zset is the guard (exactly once).
#: KEYS: dead zset, dead bodies, bodies of the queue, the queue.
#: ARGV: old redis id, new redis id, new body.
REPLAY: Final = """
if redis.call('zrem', KEYS[1], ARGV[1]) == 1 then
  redis.call('hdel', KEYS[2], ARGV[1])
  redis.call('hset', KEYS[3], ARGV[2], ARGV[3])
  redis.call('rpush', KEYS[4], ARGV[2])
  return 1
end
return 0
"""

#: Delete a dead letter, with the same guard.  KEYS: dead zset, dead bodies.  ARGV: redis id.
PURGE: Final = """
if redis.call('zrem', KEYS[1], ARGV[1]) == 1 then
  redis.call('hdel', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

#: Lua: take up to ``count`` ids off the list ``queue`` into the acks set ``acks``, appending
#: each id and its body from ``bodies`` (false: none) to ``out``. FETCH and SETTLE share it.
_TAKE: Final = """
local function take(queue, bodies, acks, count, out)
  for i = 1, count do
    local id = redis.call('lpop', queue)
    if not id then break end
    redis.call('sadd', acks, id)
    out[#out + 1] = id
    out[#out + 1] = redis.call('hget', bodies, id)
  end
  return out
end
"""

#: Fetch up to ARGV[1] messages with their ids (Dramatiq's fetch returns bodies only, so a
#: body that does not decode could not be dead-lettered by id), then heartbeat (after the
#: pops, which free: a full Redis still lets a worker fetch and beat).
#: KEYS: the queue, its bodies, this worker's acks set, heartbeats.
#: ARGV: how many, broker id.  Returns [id1, body1, id2, body2, ...] (false: no body).
FETCH: Final = (
    _TAKE
    + _CLOCK
    + """
local out = take(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[1]), {})
beat(KEYS[4], ARGV[2], now_ms())
return out
"""
)

#: This worker is alive: its heartbeat at Redis's time, and its process record
#: (:func:`process_key`) when ARGV[2] is not empty, kept ARGV[3] ms; returns that time and
#: the namespace's epoch token (false: none), so one call also notices a reset.
#: KEYS: heartbeats, the epoch key, the process record.  ARGV: broker id, record or '',
#: record lifetime ms.  Returns [ms, epoch].
HEARTBEAT: Final = (
    _CLOCK
    + """
local now = now_ms()
beat(KEYS[1], ARGV[1], now)
if ARGV[2] ~= '' then redis.call('set', KEYS[3], ARGV[2], 'PX', ARGV[3]) end
return {now, redis.call('get', KEYS[2])}
"""
)

#: Workers whose heartbeat is older than ARGV[1] ms by Redis's clock.
#: KEYS: heartbeats.  ARGV: timeout ms.  Returns their ids.
STALE_WORKERS: Final = (
    _CLOCK
    + """
return redis.call('zrangebyscore', KEYS[1], 0, now_ms() - tonumber(ARGV[1]))
"""
)

#: Settle a delivery: its ack and its outcome (a retry copy stored, a requeue, a dead
#: letter) in one step, or nothing (the removal from the acks set is the guard); then
#: heartbeat and refill the freed slot: take up to ARGV[7] messages as FETCH does, so a
#: handler's next job costs no round trip of its own.
#: The removal from the acks set comes first (it frees: a full Redis still takes the rest).
#: KEYS: acks set, bodies of the queue, target list, target bodies, dead zset, dead bodies,
#: heartbeats, the queue.  ARGV: kind (ack, retry, requeue, dead_letter), redis id, body
#: (retry copy, dead letter; '' keeps the stored one), target id (retry copy), broker id,
#: how many to take.  Returns [settled (1 or 0), id1, body1, id2, body2, ...].
SETTLE: Final = (
    _TAKE
    + _CLOCK
    + """
local settled = redis.call('srem', KEYS[1], ARGV[2])
local now = now_ms()
if settled == 1 then
  local kind = ARGV[1]
  if kind == 'ack' then
    redis.call('hdel', KEYS[2], ARGV[2])
  elseif kind == 'retry' then
    redis.call('hdel', KEYS[2], ARGV[2])
    redis.call('hset', KEYS[4], ARGV[4], ARGV[3])
    redis.call('rpush', KEYS[3], ARGV[4])
  elseif kind == 'requeue' then
    if redis.call('hexists', KEYS[2], ARGV[2]) == 1 then
      redis.call('rpush', KEYS[3], ARGV[2])
    end
  elseif kind == 'dead_letter' then
    local body = ARGV[3]
    if body == '' then body = redis.call('hget', KEYS[2], ARGV[2]) end
    if body then
      redis.call('zadd', KEYS[5], now, ARGV[2])
      redis.call('hset', KEYS[6], ARGV[2], body)
    end
    redis.call('hdel', KEYS[2], ARGV[2])
  end
end
beat(KEYS[7], ARGV[5], now)
return take(KEYS[8], KEYS[2], KEYS[1], tonumber(ARGV[6]), {settled})
"""
)


def fetch_keys(broker_id: str, queue: str) -> list[str]:
    """The KEYS of :data:`FETCH` for ``broker_id`` fetching from ``queue``."""
    heartbeats = heartbeats_key(namespace_of(queue))
    return [queue_key(queue), bodies_key(queue), acks_key(broker_id, queue), heartbeats]


@functools.lru_cache(maxsize=1024)
def settle_keys(broker_id: str, queue: str, target: str) -> tuple[str, ...]:
    """The KEYS of :data:`SETTLE` for a delivery held on ``queue``; ``target`` is the queue
    of a retry copy or requeue (``queue`` itself for a requeue). Kept once made: every
    delivery is settled with them, and a worker holds a few queues."""
    return (
        acks_key(broker_id, queue),
        bodies_key(queue),
        queue_key(target),
        bodies_key(target),
        *dead_letter_keys(queue),
        heartbeats_key(namespace_of(queue)),
        queue_key(queue),
    )


#: What :data:`BACKLOG` returns per queue, in order (its record width is the length).
BACKLOG_FIELDS: Final = ("depth", "head", "delayed", "delayed_head", "dead_letters")

#: The backlog of several queues in one call (constant work per queue).
#: KEYS: :func:`backlog_keys` of each queue, :data:`BACKLOG_KEYS` keys per queue.
#: ARGV: ids tried at a list's head when one has no body; keys per queue.
#: Returns per queue the :data:`BACKLOG_FIELDS`: llen, head body or false, delay
#: llen, delay head body or false, dead-letter count.
#: The members of every set of KEYS (this worker's acks sets), in one call (the
#: Recovery pass's look for orphans: one round trip, however many queues).
#: Returns per key: its member count, then its members.
MEMBERS: Final = """
local out = {}
for _, key in ipairs(KEYS) do
  local members = redis.call('smembers', key)
  table.insert(out, #members)
  for _, member in ipairs(members) do table.insert(out, member) end
end
return out
"""


def members_of(raw: list[Any]) -> list[list[Any]]:
    """:data:`MEMBERS`' reply, split per key (in KEYS' order)."""
    found: list[list[Any]] = []
    index = 0
    while index < len(raw):
        count = int(raw[index])
        found.append(raw[index + 1 : index + 1 + count])
        index += 1 + count
    return found


BACKLOG: Final = """
local out = {}
local probe = tonumber(ARGV[1])
local width = tonumber(ARGV[2])
local function head(list, bodies)
  local ids = redis.call('lrange', list, 0, probe - 1)
  for _, id in ipairs(ids) do
    local body = redis.call('hget', bodies, id)
    if body then return body end
  end
  return false
end
for i = 1, #KEYS, width do
  table.insert(out, redis.call('llen', KEYS[i]))
  table.insert(out, head(KEYS[i], KEYS[i + 1]))
  table.insert(out, redis.call('llen', KEYS[i + 2]))
  table.insert(out, head(KEYS[i + 2], KEYS[i + 3]))
  table.insert(out, redis.call('zcard', KEYS[i + 4]))
end
return out
"""


def backlog_keys(queue: str) -> tuple[str, ...]:
    """The keys :data:`BACKLOG` reads for ``queue``, in its order."""
    keys = QueueKeys.of(queue)
    return keys.ready, keys.ready_bodies, keys.delayed, keys.delayed_bodies, keys.dead


#: Keys :data:`BACKLOG` takes per queue.
BACKLOG_KEYS: Final = len(backlog_keys("q"))


def requeue_held(
    client: redis.Redis, broker_id: str, queue: str, redis_id: str, body: bytes = b""
) -> bool:
    """Put a message held by ``broker_id`` back at the tail of ``queue``, storing ``body``
    first when given. False when it was no longer held (someone else moved it)."""
    keys = (acks_key(broker_id, queue), bodies_key(queue), queue_key(queue))
    return bool(client.eval(REQUEUE, len(keys), *keys, redis_id, body))


def dead_letter_held(
    client: redis.Redis, broker_id: str, queue: str, redis_id: str, body: bytes
) -> bool:
    """Move a message held by ``broker_id`` to the dead letters of ``queue``, stored as
    ``body``. False when it was no longer held."""
    keys = (acks_key(broker_id, queue), bodies_key(queue), *dead_letter_keys(queue))
    return bool(client.eval(DEAD_LETTER, len(keys), *keys, redis_id, body))


def heartbeat(
    client: redis.Redis, broker_id: str, namespace: str, record: bytes = b"", ttl_ms: int = 0
) -> tuple[int, Any]:
    """:data:`HEARTBEAT` for ``broker_id`` in ``namespace``: (Redis's ms, epoch or None).
    ``record`` (JSON, :func:`process_key`) is stored too, for ``ttl_ms``, unless empty."""
    keys = (heartbeats_key(namespace), epoch_key(namespace), process_key(broker_id, namespace))
    now, epoch = client.eval(HEARTBEAT, len(keys), *keys, broker_id, record, ttl_ms)
    return int(now), epoch


@dataclass(frozen=True)
class FleetMember:
    """One worker (broker id) of a namespace as Redis knows it: its last heartbeat (ms,
    Redis's clock), its process record (decoded JSON, None: none or expired) and how many
    deliveries each of its acks sets holds (queue or delay queue -> count)."""

    namespace: str
    broker_id: str
    beat_ms: int
    record: dict[str, Any] | None
    held: dict[str, int]


def read_fleet(client: redis.Redis, queues: Sequence[str]) -> tuple[int, list[FleetMember]]:
    """Every worker of the namespaces of ``queues``, in two round trips: (Redis's ms, the
    workers by heartbeat, oldest first). Work is one small read per worker and per worker
    and queue (the size of its acks sets), whatever the queues hold."""
    namespaces = namespaces_of(queues)
    pipe = client.pipeline(transaction=False)
    pipe.time()
    for namespace in namespaces:
        pipe.zrange(heartbeats_key(namespace), 0, -1, withscores=True)
    first = pipe.execute()
    seconds, micros = first[0]
    now = int(seconds) * 1000 + int(micros) // 1000
    workers = [
        (namespace, text(broker_id), int(score))
        for namespace, beats in zip(namespaces, first[1:], strict=True)
        for broker_id, score in beats
    ]
    served = {
        namespace: [
            queue for queue in with_delay_queues(queues) if namespace_of(queue) == namespace
        ]
        for namespace in namespaces
    }
    pipe = client.pipeline(transaction=False)
    for namespace, broker_id, _ in workers:
        pipe.get(process_key(broker_id, namespace))
        for queue in served[namespace]:
            pipe.scard(acks_key(broker_id, queue))
    replies = iter(pipe.execute() if workers else [])
    members = []
    for namespace, broker_id, beat_ms in workers:
        record = message_fields(next(replies))
        held = {queue: int(next(replies)) for queue in served[namespace]}
        members.append(FleetMember(namespace, broker_id, beat_ms, record, held))
    return now, members


def stale_workers(client: redis.Redis, namespace: str, timeout_ms: int) -> list[str]:
    """:data:`STALE_WORKERS`: ids of ``namespace``'s workers silent for ``timeout_ms``."""
    raw: list[Any] = client.eval(STALE_WORKERS, 1, heartbeats_key(namespace), timeout_ms)
    return [text(worker) for worker in raw]


def replay_dead_letter(
    client: redis.Redis, queue: str, redis_id: str, new_redis_id: str, body: bytes
) -> bool:
    """Move dead letter ``redis_id`` to the tail of ``queue`` as ``new_redis_id`` with
    ``body``. False when it was already gone."""
    keys = (*dead_letter_keys(queue), bodies_key(queue), queue_key(queue))
    return bool(client.eval(REPLAY, len(keys), *keys, redis_id, new_redis_id, body))


def purge_dead_letter(client: redis.Redis, queue: str, redis_id: str) -> bool:
    """Delete dead letter ``redis_id`` of ``queue``. False when it was already gone."""
    keys = dead_letter_keys(queue)
    return bool(client.eval(PURGE, len(keys), *keys, redis_id))


def replay_dead_letters(
    client: redis.Redis, queue: str, moves: Sequence[tuple[str, str, bytes]]
) -> int:
    """:func:`replay_dead_letter` for each ``(redis id, new redis id, body)`` of ``queue``,
    in one round trip; returns how many moved (the others were already gone)."""
    keys = (*dead_letter_keys(queue), bodies_key(queue), queue_key(queue))
    pipe = client.pipeline(transaction=False)
    for redis_id, new_redis_id, body in moves:
        pipe.eval(REPLAY, len(keys), *keys, redis_id, new_redis_id, body)
    return sum(bool(moved) for moved in pipe.execute()) if moves else 0


def purge_dead_letters(client: redis.Redis, queue: str, redis_ids: Sequence[str]) -> int:
    """:func:`purge_dead_letter` for each of ``redis_ids`` of ``queue``, in one round trip;
    returns how many were deleted."""
    keys = dead_letter_keys(queue)
    pipe = client.pipeline(transaction=False)
    for redis_id in redis_ids:
        pipe.eval(PURGE, len(keys), *keys, redis_id)
    return sum(bool(gone) for gone in pipe.execute()) if redis_ids else 0


def read_backlog_records(
    client: redis.Redis, queues: Sequence[str], head_probe: int
) -> list[dict[str, Any]]:
    """One :data:`BACKLOG` call; per queue a dict of the :data:`BACKLOG_FIELDS` (raw replies)."""
    if not queues:
        return []
    keys = [key for queue in queues for key in backlog_keys(queue)]
    raw: list[Any] = client.eval(BACKLOG, len(keys), *keys, head_probe, BACKLOG_KEYS)
    width = len(BACKLOG_FIELDS)
    return [
        dict(zip(BACKLOG_FIELDS, raw[start : start + width], strict=True))
        for start in range(0, len(raw), width)
    ]


# -- schedules (ours; see scheduler.py and middleware/schedule_lock.py) -----------------


def scheduler_leader_key() -> str:
    """The scheduler's leader lock (holder: the leading replica's id; ``SET NX PX``)."""
    return f"{NAMESPACE}:scheduler:leader"


#: What a schedule's ticks are counted as (its state hash's ``runs:<outcome>`` fields, which
#: the scripts below and :func:`read_states` spell).
SCHEDULE_OUTCOMES: Final = ("fired", "caught_up", "missed", "skipped_overlap")


def schedule_state_key(schedule: str) -> str:
    """Hash of one schedule: ``tick`` (handled through, epoch s), ``fired``, ``fired_at``,
    ``success_at``, ``since`` (first seen) and the ``runs:<outcome>`` counts."""
    return f"{NAMESPACE}:schedules:{schedule}"


def schedule_lock_key(schedule: str) -> str:
    """The run lock of ``schedule``: the running message's id, with the run's lease."""
    return f"{NAMESPACE}:schedules:{schedule}:lock"


#: Extend a lock held by ARGV[1].  KEYS: the lock.  ARGV: holder, lease ms.  1 when held.
RENEW_LOCK: Final = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""

#: Delete a lock held by ARGV[1].  KEYS: the lock.  ARGV: holder.  1 when it was held.
RELEASE_LOCK: Final = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""

#: Claim a schedule's tick and enqueue its message, atomically: only while ARGV[1] holds
#: the leader lock, only when the tick is newer than the last handled one, and only when no
#: run holds the run lock (then the tick counts as ``skipped_overlap``).
#: KEYS: leader lock, state hash, run lock, the queue, its bodies.
#: ARGV: leader id, tick, outcome (``fired`` | ``caught_up``), redis id, body, now (s).
#: Returns the outcome, ``skipped_overlap``, ``done`` (claimed before) or ``not_leader``.
FIRE_TICK: Final = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 'not_leader' end
local last = tonumber(redis.call('hget', KEYS[2], 'tick'))
if last and tonumber(ARGV[2]) <= last then return 'done' end
redis.call('hset', KEYS[2], 'tick', ARGV[2])
if redis.call('exists', KEYS[3]) == 1 then
  redis.call('hincrby', KEYS[2], 'runs:skipped_overlap', 1)
  return 'skipped_overlap'
end
redis.call('hset', KEYS[5], ARGV[4], ARGV[5])
redis.call('rpush', KEYS[4], ARGV[4])
redis.call('hincrby', KEYS[2], 'runs:' .. ARGV[3], 1)
redis.call('hset', KEYS[2], 'fired', ARGV[2], 'fired_at', ARGV[6])
return ARGV[3]
"""

#: Count ticks as missed and mark them handled, with FIRE_TICK's leader and order checks.
#: KEYS: leader lock, state hash.  ARGV: leader id, handled through (tick), count.
#: Returns 1 when counted, 0 when handled before, -1 when not the leader.
MISS_TICKS: Final = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return -1 end
local last = tonumber(redis.call('hget', KEYS[2], 'tick'))
if last and tonumber(ARGV[2]) <= last then return 0 end
redis.call('hset', KEYS[2], 'tick', ARGV[2])
redis.call('hincrby', KEYS[2], 'runs:missed', ARGV[3])
return 1
"""

#: Take a run lock for ARGV[1], or keep it when ARGV[1] holds it (a redelivery after a
#: crash); else count the overlap.  KEYS: run lock, state hash.  ARGV: message id, lease ms.
#: Returns 1 when taken, 0 when another run holds it.
ACQUIRE_RUN: Final = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if holder then
  redis.call('hincrby', KEYS[2], 'runs:skipped_overlap', 1)
  return 0
end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

#: End a run: record its success time (Redis's clock, s) when ARGV[2] is '1', release the lock
#: if held.  KEYS: run lock, state hash.  ARGV: message id, '1' (succeeded) or ''.
END_RUN: Final = """
if ARGV[2] == '1' then
  local t = redis.call('time')
  redis.call('hset', KEYS[2], 'success_at', tonumber(t[1]) + tonumber(t[2]) / 1000000)
end
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def renew_lock(client: redis.Redis, key: str, holder: str, lease_ms: int) -> bool:
    """Extend lock ``key`` by ``lease_ms`` if ``holder`` holds it; False when it does not."""
    return bool(client.eval(RENEW_LOCK, 1, key, holder, lease_ms))


def release_lock(client: redis.Redis, key: str, holder: str) -> bool:
    """Delete lock ``key`` if ``holder`` holds it."""
    return bool(client.eval(RELEASE_LOCK, 1, key, holder))


#: The value of an idempotency done key (:func:`idempotency_key`) once its side effect is done.
IDEMPOTENCY_DONE: Final = b"done"

#: Take the lease on an idempotent side effect unless it is done (:data:`IDEMPOTENCY_DONE`).
#: KEYS: its done key (:func:`idempotency_key`), its lease (:func:`idempotency_lease_key`).
#: ARGV: token, lease ms, keep s.  The done key then holds the token (a takeover rewrites
#: it); renew and release the lease with :func:`renew_lock` and :func:`release_lock`.
#: Returns 1 (taken), 0 (already done) or -1 (another delivery holds the lease).
ACQUIRE_IDEMPOTENCY: Final = """
if redis.call('get', KEYS[1]) == 'done' then return 0 end
if redis.call('set', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[3])
  return 1
end
return -1
"""


def acquire_idempotency(
    client: redis.Redis, key: str, token: str, lease_ms: int, keep_s: int
) -> int:
    """:data:`ACQUIRE_IDEMPOTENCY` for the side effect ``key``: 1 taken, 0 done, -1 held."""
    keys = (idempotency_key(key), idempotency_lease_key(key))
    return int(client.eval(ACQUIRE_IDEMPOTENCY, len(keys), *keys, token, lease_ms, keep_s))


def fire_tick(
    client: redis.Redis,
    leader: str,
    schedule: str,
    queue: str,
    tick: int,
    outcome: str,
    redis_id: str,
    body: bytes,
    now: float,
) -> str:
    """:data:`FIRE_TICK` for ``schedule``'s ``tick`` onto ``queue`` at ``now`` (Redis's clock,
    s: the ``fired_at`` it records); returns its verdict."""
    keys = (
        scheduler_leader_key(),
        schedule_state_key(schedule),
        schedule_lock_key(schedule),
        queue_key(queue),
        bodies_key(queue),
    )
    args = (leader, tick, outcome, redis_id, body, now)
    return text(client.eval(FIRE_TICK, len(keys), *keys, *args))


def miss_ticks(client: redis.Redis, leader: str, schedule: str, through: int, count: int) -> int:
    """:data:`MISS_TICKS`: 1 counted, 0 handled before, -1 not the leader."""
    keys = (scheduler_leader_key(), schedule_state_key(schedule))
    return int(client.eval(MISS_TICKS, len(keys), *keys, leader, through, count))


def acquire_run(client: redis.Redis, schedule: str, message_id: str, lease_ms: int) -> bool:
    """:data:`ACQUIRE_RUN`: True when the run of ``message_id`` may start."""
    keys = (schedule_lock_key(schedule), schedule_state_key(schedule))
    return bool(client.eval(ACQUIRE_RUN, len(keys), *keys, message_id, lease_ms))


def end_run(client: redis.Redis, schedule: str, message_id: str, succeeded: bool) -> None:
    """:data:`END_RUN`: record a success, release the run lock."""
    keys = (schedule_lock_key(schedule), schedule_state_key(schedule))
    client.eval(END_RUN, len(keys), *keys, message_id, "1" if succeeded else "")


# -- the schedule store: every field of the state hash is read and written here ----------------


def handled_tick(client: redis.Redis, schedule: str, now: float) -> int | None:
    """The tick ``schedule`` is handled through (epoch s); None at its first sight, which
    records ``now`` as both its ``since`` and its handled tick (ticks from now on, none from
    the past)."""
    key = schedule_state_key(schedule)
    raw = client.hget(key, "tick")
    if raw is None:
        client.hsetnx(key, "since", math.floor(now))
        client.hsetnx(key, "tick", math.floor(now))
        return None
    return int(raw)


@dataclass(frozen=True)
class ScheduleState:
    """What Redis knows of one schedule (its state hash, :func:`schedule_state_key`, and
    the holder of its run lock)."""

    tick: int | None
    fired: int | None
    fired_at: float | None
    success_at: float | None
    since: int | None
    runs: dict[str, int]
    running: str | None


def read_states(client: redis.Redis, names: Iterable[str]) -> dict[str, ScheduleState]:
    """The Redis state of each schedule, with one round trip."""
    names = list(names)
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(schedule_state_key(name))
        pipe.get(schedule_lock_key(name))
    replies = pipe.execute()
    states = {}
    for index, name in enumerate(names):
        raw = {k.decode(): v.decode() for k, v in replies[2 * index].items()}
        holder = replies[2 * index + 1]

        def number(field: str, raw: dict[str, str] = raw) -> float | None:
            return float(raw[field]) if field in raw else None

        tick, fired, since = number("tick"), number("fired"), number("since")
        states[name] = ScheduleState(
            tick=None if tick is None else int(tick),
            fired=None if fired is None else int(fired),
            fired_at=number("fired_at"),
            success_at=number("success_at"),
            since=None if since is None else int(since),
            runs={o: int(raw.get(f"runs:{o}", 0)) for o in SCHEDULE_OUTCOMES},
            running=holder.decode() if holder else None,
        )
    return states


# -- the job API: results, group completion (ours, on Dramatiq's keys; see issue #26) -------

#: Prefix of a stored result's key (Dramatiq's Results ``RedisBackend`` namespace, with
#: ``use_namespace_prefix_keys``: each key is ``<namespace>:<queue>:<actor>:<message id>``, a
#: list of one JSON result with a TTL).
RESULTS_NAMESPACE: Final = f"{NAMESPACE}:__results__"


def group_keys(completion_uuid: str) -> tuple[str, str, str]:
    """The keys of one group's completion: Dramatiq's barrier (the group's size, ``SET NX PX``
    by ``group(...).run()``: its key is the bare completion uuid), the set of members that
    completed (message ids) and the callbacks' firing claim."""
    return completion_uuid, f"{completion_uuid}@done", f"{completion_uuid}@fired"


#: Count a group member as completed, once per member, and claim the firing of the
#: group's callbacks when it is the last one: a member delivered twice (a crash before its
#: ack, a duplicate) is counted once, and the callbacks are claimed once.
#: KEYS: :func:`group_keys`.  ARGV: the member's message id, the keys' TTL ms.
#: Returns 1 when this call completed the group and claimed the callbacks, else 0.
GROUP_MEMBER_DONE: Final = """
local parties = tonumber(redis.call('get', KEYS[1]) or '0')
redis.call('sadd', KEYS[2], ARGV[1])
redis.call('pexpire', KEYS[2], ARGV[2])
if parties > 0 and redis.call('scard', KEYS[2]) >= parties then
  if redis.call('set', KEYS[3], '1', 'NX', 'PX', ARGV[2]) then return 1 end
end
return 0
"""


def group_member_done(client: redis.Redis, completion_uuid: str, member: str, ttl_ms: int) -> bool:
    """:data:`GROUP_MEMBER_DONE`: True when ``member`` completed the group and this caller
    must enqueue its callbacks."""
    return bool(client.eval(GROUP_MEMBER_DONE, 3, *group_keys(completion_uuid), member, ttl_ms))


def release_group_callbacks(client: redis.Redis, completion_uuid: str) -> None:
    """Give up the claim of :func:`group_member_done` (the callbacks could not be enqueued:
    the member's next delivery claims them again)."""
    client.delete(group_keys(completion_uuid)[2])


# -- cancellation (ours: producer.cancel, middleware/cancellation.py) ---------------------

#: Sorted set of cancelled message ids (Dramatiq's ``message_id``), scored by when the
#: cancellation lapses (Redis time, ms): a worker skips or interrupts a message it names.
CANCELLED: Final = f"{NAMESPACE}:__cancelled__"
#: Channel on which a cancellation is announced (the message id), so that a running job
#: is interrupted at once; a worker that (re)subscribes reads :data:`CANCELLED` after.
CANCEL_CHANNEL: Final = f"{NAMESPACE}:__cancel__"
#: How long a cancellation holds (7 days): a message delayed longer runs after all.
CANCEL_TTL_MS: Final = 7 * 86_400_000

#: Record a cancellation and announce it; drop the lapsed ones.
#: KEYS: :data:`CANCELLED`.  ARGV: message id, TTL ms, channel.
CANCEL: Final = (
    _CLOCK
    + """
local now = now_ms()
redis.call('zremrangebyscore', KEYS[1], '-inf', now)
redis.call('zadd', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('publish', ARGV[3], ARGV[1])
return 1
"""
)


def record_cancel(client: redis.Redis, message_id: str) -> None:
    """:data:`CANCEL` ``message_id`` for :data:`CANCEL_TTL_MS`."""
    client.eval(CANCEL, 1, CANCELLED, message_id, CANCEL_TTL_MS, CANCEL_CHANNEL)


def cancelled_ids(client: redis.Redis) -> dict[str, int]:
    """Every cancellation in force: message id -> when it lapses (Redis time, ms)."""
    now = redis_now_ms(client)
    found: Any = client.zrangebyscore(CANCELLED, now, "+inf", withscores=True)
    return {text(member): int(score) for member, score in found}


def holds_message(client: redis.Redis, queue: str, message_id: str) -> bool:
    """Whether ``queue``'s bodies (waiting or held by a worker; a delay queue's too) include
    the message ``message_id``: an HSCAN of the bodies in pages, so Redis is never blocked
    (one round trip per 1,000 bodies), matching the id as Dramatiq encodes it."""
    needle = f'"message_id":"{message_id}"'.encode()
    bodies = client.hscan_iter(bodies_key(queue), count=1000)
    return any(needle in (raw_bytes(body) or b"") for _, body in bodies)
