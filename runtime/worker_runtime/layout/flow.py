"""Flow control at the fetch: paused queues, downstream budgets and rates (issue #42).

Decided inside the Lua call that takes messages (:data:`.delivery.FETCH`, and the refill
of :data:`.delivery.SETTLE`), so a message that may not run now stays queued: it is never
fetched, rejected and retried, and no attempt is spent on waiting.

* A paused queue (:func:`.keys.paused_key`, ``pause``/``resume``) gives nothing to any
  worker of any pool; it survives every restart (it lives in Redis).
* A queue whose pool ``uses`` a downstream resource is *gated* by it (:class:`Gate`):
  a message is taken only while the resource's in-flight set (:func:`.keys.downstream_key`,
  redis id -> lease end) holds fewer than ``capacity - reserved`` deliveries and its token
  bucket (:func:`.keys.downstream_rate_key`) holds a whole token. Every taken id is added to
  the in-flight set of each gate. The settlement, which knows its queue's gates, removes it
  there; the fetch also records the queue's gates in the gates hash
  (:func:`.keys.gates_key`), where the scripts that end a holding without knowing the
  pools (requeue, dead letter, so recovery of a killed worker) find them
  (:data:`RELEASE`). A lease (the score) frees a slot that nothing freed (a holding
  removed by hand, a config changed mid-flight) after :func:`admission_lease_ms`.

Per delivery of a gated queue this costs a few O(1) or O(log n) commands inside the same
Lua call (in-flight count, add, remove; with a rate, the bucket's read and write); an
ungated queue's fetch checks only the pause. RELEASE touches the in-flight sets named in
the gates hash, keys it is not given in KEYS: right on a standalone Redis and under
Sentinel (this broker's deployments), not on Redis Cluster (Dramatiq's own dispatch
script does the same).

A fetch returns why it took fewer than it asked while messages waited (:class:`Admission`):
``paused``, ``budget`` or ``rate``, how many it left queued, and for a rate the ms until the
next token, so a throttled consumer sleeps instead of polling.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .. import contract
from .keys import (
    NAMESPACE,
    canonical,
    downstream_key,
    downstream_rate_key,
    gates_key,
    namespace_of,
    paused_key,
)

if TYPE_CHECKING:
    import redis

#: Why a fetch left messages queued (``jobs_throttled_total{reason}``; ``paused`` is
#: counted by ``queue_paused`` instead).
PAUSED: Final = "paused"
BUDGET: Final = contract.THROTTLE_BUDGET
RATE: Final = contract.THROTTLE_RATE
#: A fair lane's keyed messages passed over for their key's ``fair_key_limit``
#: (:mod:`.queuelanes`).
KEY: Final = contract.THROTTLE_KEY


@dataclass(frozen=True)
class Gate:
    """A downstream resource a queue's deliveries hold while they run.

    Parameters:
      name: the ``[downstream.<name>]`` table.
      limit: the in-flight budget, ``capacity - reserved`` (environment overrides applied).
      calls_per_s: its rate (0: none).
      burst: tokens the bucket holds at most (0 without a rate).
    """

    name: str
    limit: int
    calls_per_s: float = 0.0
    burst: int = 0

    def redis_keys(self) -> tuple[str, str]:
        return downstream_key(self.name), downstream_rate_key(self.name)

    def redis_args(self) -> tuple[int, str, int]:
        return self.limit, repr(float(self.calls_per_s)), self.burst


def admission_lease_ms(job_timeout_ms: int, heartbeat_timeout_ms: int) -> int:
    """How long a slot stays taken when nothing frees it: a delivery waits for a thread
    behind at most one job, runs at most one job timeout, and a dead holder's messages are
    recovered (which frees it) one heartbeat timeout after it died; twice that, to spare."""
    return 2 * (2 * job_timeout_ms + heartbeat_timeout_ms)


#: Lua: free the slots a delivery of ``queue`` ('' for a delay queue: none) holds, in the
#: in-flight sets the gates hash names for it (see the module docstring). Call it only after
#: removing the id from an acks set returned 1 (the holding ended here, once).
RELEASE: Final = """
local function release(gates, queue, id)
  if queue == '' then return end
  local held = redis.call('hget', gates, queue)
  if held then
    for key in string.gmatch(held, '%S+') do redis.call('zrem', key, id) end
  end
end
"""

#: Lua: ``admission`` decides how many of ``want`` messages (``waiting`` wait) may be
#: taken now: none while ``queue`` is in the paused hash, else as many as every gate allows
#: (gates: KEYS from ``key0`` on, two a gate (in-flight zset, bucket); ARGV from ``arg0``,
#: three a gate: limit, calls per s, burst). Returns allowed, reason, how many it leaves
#: queued, the ms until a token, and each rated gate's tokens now. ``charge`` then records
#: the ids taken (the ``out`` entries from ``first`` on, every other one) in every gate's
#: in-flight set (lease end ``now + lease``) and takes their tokens; given a gates hash (not
#: ''), it records there the queue's in-flight sets. ``queue`` '' (a delay queue) is neither
#: paused nor gated.
ADMIT: Final = """
local function admission(now, waiting, paused, queue, want, key0, arg0)
  local buckets = {}
  if queue == '' or want <= 0 then return want, '', 0, 0, buckets end
  local allowed, reason, wait = want, '', 0
  if redis.call('hexists', paused, queue) == 1 then
    allowed, reason = 0, 'paused'
  else
    for g = 0, (#KEYS - key0 + 1) / 2 - 1 do
      local held, bucket = KEYS[key0 + 2 * g], KEYS[key0 + 2 * g + 1]
      local limit = tonumber(ARGV[arg0 + 3 * g])
      local rate = tonumber(ARGV[arg0 + 3 * g + 1])
      local burst = tonumber(ARGV[arg0 + 3 * g + 2])
      local free = limit - redis.call('zcard', held)
      if free < allowed then  -- leases past their end free their slots
        redis.call('zremrangebyscore', held, '-inf', now)
        free = limit - redis.call('zcard', held)
      end
      free = math.max(0, free)
      if free < allowed then allowed, reason, wait = free, 'budget', 0 end
      if rate > 0 then
        local state = redis.call('hmget', bucket, 'tokens', 'at')
        local tokens, at = tonumber(state[1]), tonumber(state[2])
        if tokens == nil or at == nil then tokens, at = burst, now end
        tokens = math.min(burst, tokens + math.max(0, now - at) * rate / 1000)
        buckets[g] = tokens
        local whole = math.floor(tokens)
        if whole < allowed then
          allowed, reason = whole, 'rate'
          wait = math.ceil((1 - (tokens - whole)) * 1000 / rate)
        end
      end
    end
  end
  if reason == '' then return allowed, '', 0, 0, buckets end
  local left = math.min(want, waiting) - allowed
  if left <= 0 then return allowed, '', 0, 0, buckets end
  return allowed, reason, left, wait, buckets
end
local function charge(now, out, first, gates, queue, lease, key0, buckets)
  if first > #out then return end
  local count = (#KEYS - key0 + 1) / 2
  if count < 1 then return end
  local names, taken = {}, 0
  for g = 0, count - 1 do
    local held = KEYS[key0 + 2 * g]
    names[#names + 1] = held
    taken = 0
    for i = first, #out, 2 do
      redis.call('zadd', held, now + lease, out[i])
      taken = taken + 1
    end
    if buckets[g] ~= nil then
      local left = string.format('%.6f', buckets[g] - taken)
      redis.call('hset', KEYS[key0 + 2 * g + 1], 'tokens', left, 'at', now)
    end
  end
  if gates ~= '' then redis.call('hset', gates, queue, table.concat(names, ' ')) end
end
local function unhold(key0, id)
  for g = key0, #KEYS, 2 do redis.call('zrem', KEYS[g], id) end
end
"""


@dataclass(frozen=True)
class Admission:
    """What a fetch (or a settlement's refill) says of the messages it left queued.

    ``reason``: '' (none left: it took what it asked or the list ran out), :data:`PAUSED`,
    :data:`BUDGET` or :data:`RATE`; ``deferred``: how many it would have taken;
    ``wait_ms``: for a rate, the ms until the next token (0: unknown)."""

    reason: str = ""
    deferred: int = 0
    wait_ms: int = 0

    @classmethod
    def of(cls, raw: Sequence[Any]) -> Admission:
        """From the three fields a fetch returns before its messages."""
        reason = raw[0].decode() if isinstance(raw[0], bytes) else str(raw[0])
        return cls(reason, int(raw[1]), int(raw[2]))


#: An admission that left nothing queued.
ADMITTED: Final = Admission()


def flow_keys(queue: str, gates: Sequence[Gate] = ()) -> tuple[str, ...]:
    """The KEYS a taking script needs for ``queue``'s flow control, after its own: the
    paused hash, the gates hash, then each gate's two keys."""
    namespace = namespace_of(queue)
    return (
        paused_key(namespace),
        gates_key(namespace),
        *(key for gate in gates for key in gate.redis_keys()),
    )


@functools.lru_cache(maxsize=1024)
def flow_args(queue: str, gates: tuple[Gate, ...], lease_ms: int) -> tuple[Any, ...]:
    """The ARGV a taking script needs for ``queue``'s flow control, after its own: the
    queue's name ('' for a delay queue: never paused nor gated), the lease, each gate's.
    Kept once made (every fetch and settlement sends them)."""
    return (gated_name(queue), lease_ms, *(arg for gate in gates for arg in gate.redis_args()))


def gated_name(queue: str) -> str:
    """``queue`` as flow control names it; '' for a delay queue (never paused nor gated)."""
    return "" if queue != canonical(queue) else queue


# -- pause and resume ---------------------------------------------------------------------


def pause(client: redis.Redis, queue: str) -> bool:
    """Pause ``queue`` (a canonical queue name) for every worker; False when it already
    was. The time it was paused is Redis's (ms)."""
    seconds, micros = client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    return bool(client.hsetnx(paused_key(namespace_of(queue)), queue, now))


def resume(client: redis.Redis, queue: str, wake_channel: str | None = None) -> bool:
    """Resume ``queue``; False when it was not paused. ``wake_channel``: announce the queue
    there (its idle consumers fetch at once instead of at their next poll)."""
    resumed = bool(client.hdel(paused_key(namespace_of(queue)), queue))
    if resumed and wake_channel is not None and namespace_of(queue) == NAMESPACE:
        client.publish(wake_channel, queue)
    return resumed


def paused_queues(client: redis.Redis, queues: Sequence[str]) -> dict[str, int]:
    """Each of ``queues`` that is paused -> when it was paused (Redis time, ms); one round
    trip per namespace."""
    found: dict[str, int] = {}
    by_namespace: dict[str, list[str]] = {}
    for queue in queues:
        by_namespace.setdefault(namespace_of(queue), []).append(queue)
    for namespace, names in by_namespace.items():
        values = client.hmget(paused_key(namespace), names)
        found.update({q: int(v) for q, v in zip(names, values, strict=True) if v is not None})
    return found


#: Each downstream's use now, by Redis's clock: KEYS two a resource (in-flight zset, bucket).
#: Returns per resource: deliveries holding a slot (leases not ended), the bucket's tokens
#: and when they were counted (false: no bucket), then Redis's ms last.
IN_USE: Final = """
local t = redis.call('time')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #KEYS, 2 do
  out[#out + 1] = redis.call('zcount', KEYS[i], '(' .. now, '+inf')
  local state = redis.call('hmget', KEYS[i + 1], 'tokens', 'at')
  out[#out + 1] = state[1]
  out[#out + 1] = state[2]
end
out[#out + 1] = now
return out
"""


@dataclass(frozen=True)
class DownstreamUse:
    """A downstream resource as Redis holds it now: ``in_use`` deliveries hold a slot;
    ``tokens`` (None: no bucket yet) were counted at ``tokens_at_ms``."""

    name: str
    in_use: int
    tokens: float | None
    tokens_at_ms: int
    now_ms: int

    def tokens_now(self, calls_per_s: float, burst: int) -> float:
        """The bucket's tokens now, refilled at ``calls_per_s`` up to ``burst``."""
        if self.tokens is None:
            return float(burst)
        refill = max(0, self.now_ms - self.tokens_at_ms) * calls_per_s / 1000
        return min(float(burst), self.tokens + refill)


def downstream_use(client: redis.Redis, names: Sequence[str]) -> list[DownstreamUse]:
    """:class:`DownstreamUse` of each of ``names`` (:data:`IN_USE`, one round trip)."""
    if not names:
        return []
    keys = [key for name in names for key in (downstream_key(name), downstream_rate_key(name))]
    raw: list[Any] = client.eval(IN_USE, len(keys), *keys)
    now = int(raw[-1])
    return [
        DownstreamUse(
            name,
            int(raw[3 * i]),
            None if raw[3 * i + 1] is None else float(raw[3 * i + 1]),
            int(float(raw[3 * i + 2] or 0)),
            now,
        )
        for i, name in enumerate(names)
    ]
