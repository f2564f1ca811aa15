"""A queue's lanes (issue #42): where its waiting ids sit, and how one Lua call takes them.

A queue ``q`` has one lane per priority (:data:`.keys.PRIORITIES`, highest first):
``normal`` is Dramatiq's own list ``dramatiq:q`` (KEDA's list, where a bare Dramatiq
producer appends), ``high`` and ``low`` lists beside it (:func:`.keys.lane_key`); and a
*fair lane* (:func:`.keys.fair_keys`) where the messages of a keyed actor wait (an actor
naming a field of its typed arguments, ``fair_key="tenant_id"``: the value is the
message's key). The bodies stay in the queue's one hash, so acks sets, settlement, the
message index and the dead letters do not know lanes; only the scripts that put an id on a
queue, and the fetch that takes one, do (:data:`LANES`):

* the fetch (FETCH, and SETTLE's refill) takes from the highest lane with messages
  waiting, except that a lane passed over by ``bound`` jobs of higher lanes while it had
  messages waiting is taken from next (lowest such lane first): a waiting job waits for at
  most ``bound`` jobs of higher priority (the *starvation bound*, the pool's
  ``priority_bound``, ``WORKER_PRIORITY_BOUND``). The passes are counted in the queue's
  lanes hash (:func:`.keys.lanes_state_key`), written only while two lanes hold messages;
* keyed messages are of the ``normal`` priority; the fair lane takes every other normal
  turn from the plain list while both hold messages, and within it the keys take turns
  (start-time fair queueing: a key's next message gets the turn after the later of its
  previous one and the last turn taken), so a key with 20,000 waiting delays another key's
  job by one job of it per slot, not by its backlog; a key with ``fair_key_limit``
  deliveries in flight, or whose starts came at its ``fair_key_rate`` (with its
  ``fair_key_burst``; GCRA, a key's next start's theoretical time kept while it is ahead
  of now), is passed over (``jobs_throttled_total{reason="key"}``), the fetch looking at
  the first :data:`FAIR_SCAN` keyed messages in line;
* an enqueue names the lane (:func:`stored_priority`, the key); recovery's requeue, a
  settlement's requeue or retry, a dead letter's replay and the move of a due delayed
  message read it from the stored body inside Redis (``route``), so a message goes back
  to its own lane whoever moves it.

Cost per fetch call: while only Dramatiq's list is in use, one ``EXISTS`` (of the other
lanes, the fair lane and the lanes hash) and one ``LLEN``; else one ``LLEN`` a list and one
``ZCARD`` (the fair lane); with two lanes
busy or keyed messages waiting, one ``HMGET`` of the lanes hash and its writes, and for each
keyed message taken a few O(log n) commands (a settlement that takes nothing reads no
lane); every settlement one ``HGET`` (its key, if any). A group's callbacks wait on their
priority's list, unkeyed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .keys import DEFAULT_PRIORITY, PRIORITIES

#: The message option naming a message's lane (one of :data:`.keys.PRIORITIES`).
PRIORITY_OPTION: Final = "priority"
#: The actor option giving its messages' default lane (Dramatiq's own ``priority`` actor
#: argument is an int that only orders the messages one worker already holds).
ACTOR_PRIORITY_OPTION: Final = "priority_lane"
#: The message option holding a keyed message's fairness key (set at the send from the
#: field its typed actor names, :data:`ACTOR_KEY_OPTION`).
FAIRNESS_KEY_OPTION: Final = "fairness_key"
#: The actor option naming the field of its typed arguments that is its messages' key.
ACTOR_KEY_OPTION: Final = "fair_key"
#: The actor option bounding a key's deliveries in flight on its queue (default: none).
ACTOR_KEY_LIMIT_OPTION: Final = "fair_key_limit"
#: The actor option bounding how fast a key's deliveries start on its queue, a rate such as
#: ``"5/s"`` or ``"300/min"`` (default: none), and how many may start at once after a quiet
#: spell (``fair_key_burst``, default one second's worth, at least 1).
ACTOR_KEY_RATE_OPTION: Final = "fair_key_rate"
ACTOR_KEY_BURST_OPTION: Final = "fair_key_burst"
#: Keyed messages at the head of a fair lane one fetch looks at for a key under its limit.
FAIR_SCAN: Final = 100


@dataclass(frozen=True)
class KeyRate:
    """How fast the deliveries of one key of a queue may start: ``per_s`` a second (0: no
    limit), ``burst`` at once after a quiet spell (:data:`ACTOR_KEY_RATE_OPTION`)."""

    per_s: float = 0.0
    burst: int = 0

    def redis_args(self) -> tuple[str, int]:
        return repr(float(self.per_s)), self.burst


#: No per-key rate.
NO_KEY_RATE: Final = KeyRate()


class PriorityError(ValueError):
    """A priority that is not one of :data:`.keys.PRIORITIES` (one line, nothing stored)."""


def priority_of(options: Mapping[str, Any], default: str | None = None) -> str:
    """The lane of a message with ``options`` (``default``: its actor's, when the message
    names none); raises :class:`PriorityError` naming the value and the choices."""
    value = options.get(PRIORITY_OPTION, default)
    if value is None:
        return DEFAULT_PRIORITY
    if value not in PRIORITIES:
        raise PriorityError(
            f"priority {value!r} is not one of {', '.join(PRIORITIES)} "
            f"(the message option {PRIORITY_OPTION!r} or the actor option "
            f"{ACTOR_PRIORITY_OPTION!r})"
        )
    return str(value)


#: The actor options that only a keyed actor (``fair_key``) may have.
KEYED_OPTIONS: Final = (ACTOR_KEY_LIMIT_OPTION, ACTOR_KEY_RATE_OPTION, ACTOR_KEY_BURST_OPTION)


def check_fair_key(
    actor: str,
    options: Mapping[str, Any],
    fields: Mapping[str, Any] | None,
    priority: str = DEFAULT_PRIORITY,
) -> None:
    """Refuse (``ValueError``, one line naming the actor) an actor's ``options`` whose
    ``fair_key`` is not a field of its typed arguments (``fields``; None: not a typed actor),
    with a ``fair_key_limit``, ``fair_key_rate`` or ``fair_key_burst`` without a key, a limit
    or burst that is not a count >= 1, a burst without a rate, and a key on an actor whose
    ``priority_lane`` (``priority``) is not the default: keys take turns on the default lane
    only (:func:`check_keyed_priority`). The rate's own text is the broker's to parse."""
    field = options.get(ACTOR_KEY_OPTION)
    if field is None:
        for option in KEYED_OPTIONS:
            if options.get(option) is not None:
                raise ValueError(f"actor {actor!r}: {option} without {ACTOR_KEY_OPTION}")
        return
    check_keyed_priority(actor, priority)
    if fields is None:
        raise ValueError(
            f"actor {actor!r}: {ACTOR_KEY_OPTION} names a field of typed arguments "
            "(worker_runtime.typed.actor); this actor is not typed"
        )
    if field not in fields:
        raise ValueError(
            f"actor {actor!r}: {ACTOR_KEY_OPTION} {field!r} is not a field of its arguments "
            f"({', '.join(fields)})"
        )
    for option in (ACTOR_KEY_LIMIT_OPTION, ACTOR_KEY_BURST_OPTION):
        count = options.get(option)
        if count is not None and (
            not isinstance(count, int) or isinstance(count, bool) or count < 1
        ):
            raise ValueError(f"actor {actor!r}: {option} {count!r} is not a count >= 1")
    if (
        options.get(ACTOR_KEY_BURST_OPTION) is not None
        and options.get(ACTOR_KEY_RATE_OPTION) is None
    ):
        raise ValueError(
            f"actor {actor!r}: {ACTOR_KEY_BURST_OPTION} without {ACTOR_KEY_RATE_OPTION}"
        )


def check_keyed_priority(actor: str, priority: str) -> None:
    """Refuse (:class:`PriorityError`, one line) a keyed job (``fair_key``) of a priority
    other than the default: keys take turns, and keep their ``fair_key_limit``, on the
    fair lane beside the default one; a high or low lane would run it with neither."""
    if priority != DEFAULT_PRIORITY:
        raise PriorityError(
            f"actor {actor!r}: its jobs are keyed ({ACTOR_KEY_OPTION}) and keys take turns on "
            f"the {DEFAULT_PRIORITY!r} lane only; priority {priority!r} would drop the key's "
            "turn and limit (send it without one, or from an actor without a key)"
        )


def stored_priority(options: Mapping[str, Any]) -> str:
    """The lane of a stored message with ``options``: its priority, or the default lane when
    it names none or one that is not a priority (a bare producer's), as :data:`LANES`' ``route``
    routes it inside Redis."""
    value = options.get(PRIORITY_OPTION)
    return str(value) if value in PRIORITIES else DEFAULT_PRIORITY


def _lua_table() -> str:
    return "{" + ", ".join(f"{name} = {i + 1}" for i, name in enumerate(PRIORITIES)) + "}"


#: Lua shared by every script that puts an id on a queue or takes one off (see the module
#: docstring). A queue's *lanes block* is KEYS from ``first``: its lists (highest first),
#: then its fair lane's keys (:func:`.keys.fair_keys`, the lanes hash sixth); a delay queue's
#: block is its one list (``count`` 1).
#: ``route(body)``: a stored body's lane (1..), fairness key (false: none) and due ms
#: (false: unknown). ``put(first, count, id, body, now)``: the id onto its lane (a keyed
#: message of the default lane onto the fair lane, at its key's next turn). ``unfair``: a
#: keyed delivery ended (its key's count in flight less one). ``waiting``: the lists'
#: lengths, the fair lane's, their sum (none read when ``want`` is 0). ``take``: up to
#: ``want`` ids into the acks set (ids and bodies appended to ``out``), a key's starts within
#: ``rate`` a second (0: none) and ``burst``; returns how many keyed messages it passed over
#: for their key's limit or rate, and the ms until the first of those a rate holds may start
#: (0: none).
LANES: Final = (
    f"local LANE_INDEX = {_lua_table()}\n"
    f"local LANE_DEFAULT = {PRIORITIES.index(DEFAULT_PRIORITY) + 1}\n"
    f"local LANE_COUNT = {len(PRIORITIES)}\n"
    "local LANE_NAMES = {" + ", ".join(f"'{name}'" for name in PRIORITIES) + "}\n"
    f"local FAIR_SCAN = {FAIR_SCAN}\n"
    f"local PRIORITY_OPTION, KEY_OPTION = '{PRIORITY_OPTION}', '{FAIRNESS_KEY_OPTION}'\n"
    + """
local function route(body)
  local lane, key, due = LANE_DEFAULT, false, false
  if not body then return lane, key, due end
  local ok, fields = pcall(cjson.decode, body)
  if not ok or type(fields) ~= 'table' then return lane, key, due end
  local options = fields['options']
  local sent = fields['message_timestamp']
  if type(sent) == 'number' then due = sent end
  if type(options) == 'table' then
    lane = LANE_INDEX[options[PRIORITY_OPTION]] or LANE_DEFAULT
    if type(options[KEY_OPTION]) == 'string' then key = options[KEY_OPTION] end
    local eta = options['eta']
    if type(eta) == 'number' and (not due or eta > due) then due = eta end
  end
  return lane, key, due
end
local function fair_put(f, id, key, due)
  local turn = tonumber(redis.call('hget', KEYS[f + 5], 'vt') or '0')
  local last = tonumber(redis.call('hget', KEYS[f + 3], key) or '0')
  local score = math.max(turn, last) + 1
  redis.call('hset', KEYS[f + 3], key, score)
  redis.call('zadd', KEYS[f], score, id)
  redis.call('zadd', KEYS[f + 1], due, id)
  redis.call('hset', KEYS[f + 2], id, key)
end
local function put(first, count, id, body, now)
  if count == 1 then
    redis.call('rpush', KEYS[first], id)
    return
  end
  local lane, key, due = route(body)
  if key and lane == LANE_DEFAULT then
    fair_put(first + LANE_COUNT, id, key, due or now)
  else
    redis.call('rpush', KEYS[first + lane - 1], id)
  end
end
local function unfair(first, count, id)
  if count == 1 then return end
  local f = first + LANE_COUNT
  local key = redis.call('hget', KEYS[f + 2], id)
  if key then
    redis.call('hdel', KEYS[f + 2], id)
    if redis.call('hincrby', KEYS[f + 4], key, -1) <= 0 then
      redis.call('hdel', KEYS[f + 4], key)
    end
  end
end
local function waiting(first, count, want)
  local len, total, fair = {}, 0, 0
  if want <= 0 then return len, fair, total end
  if count > LANE_COUNT then
    -- the plain case (only Dramatiq's list in use): one EXISTS of the other lanes, the fair
    -- lane and the lanes hash (empty ones do not exist) says so, then one LLEN; len.plain
    -- tells take that no lane state is kept
    local others = {KEYS[first + LANE_COUNT], KEYS[first + LANE_COUNT + 5]}
    for i = 1, LANE_COUNT do
      if i ~= LANE_DEFAULT then others[#others + 1] = KEYS[first + i - 1] end
    end
    if redis.call('exists', unpack(others)) == 0 then
      for i = 1, LANE_COUNT do len[i] = 0 end
      len[LANE_DEFAULT] = redis.call('llen', KEYS[first + LANE_DEFAULT - 1])
      len.plain = true
      return len, 0, len[LANE_DEFAULT]
    end
  end
  for i = 1, math.min(count, LANE_COUNT) do
    len[i] = redis.call('llen', KEYS[first + i - 1])
    total = total + len[i]
  end
  if count > LANE_COUNT then
    fair = redis.call('zcard', KEYS[first + LANE_COUNT])
    total = total + fair
  end
  return len, fair, total
end
local function pop(list, bodies, acks, out)
  local id = redis.call('lpop', list)
  if not id then return false end
  redis.call('sadd', acks, id)
  out[#out + 1] = id
  out[#out + 1] = redis.call('hget', bodies, id)
  return true
end
local function take(first, count, len, fair, bound, limit, bodies, acks, want, out, rate, burst,
    now)
  if want <= 0 then return 0, 0 end
  local lanes = math.min(count, LANE_COUNT)
  local busy, only = 0, 0
  for i = 1, lanes do
    if len[i] > 0 then busy, only = busy + 1, i end
  end
  if busy + fair == 0 then return 0, 0 end
  if fair == 0 and busy == 1 then
    for _ = 1, want do
      if not pop(KEYS[first + only - 1], bodies, acks, out) then break end
    end
    if lanes > 1 and not len.plain then
      redis.call('hdel', KEYS[first + LANE_COUNT + 5], LANE_NAMES[only])
    end
    return 0, 0
  end
  local f = first + LANE_COUNT
  local state = KEYS[f + 5]
  local saved = redis.call('hmget', state, 'vt', 'turn', unpack(LANE_NAMES))
  local vt, turn = tonumber(saved[1]) or 0, tonumber(saved[2]) or 0
  local passed = {}
  for i = 1, LANE_COUNT do passed[i] = tonumber(saved[i + 2]) or 0 end
  local keyed, open = fair > 0, fair > 0
  local window, at, counts, skipped = nil, 1, {}, 0
  -- a key's rate: GCRA, its next start's theoretical time (ms) in the zset KEYS[f + 6]; a
  -- key may start while that time is at most (burst - 1) intervals ahead of now; one whose
  -- time has passed is as good as absent (pruned here)
  local interval, ahead, tats, wait = 0, 0, {}, 0
  if rate > 0 and fair > 0 then
    interval, ahead = 1000 / rate, (burst - 1) * 1000 / rate
    redis.call('zremrangebyscore', KEYS[f + 6], '-inf', now)
  end
  local function fair_next()
    if not window then window = redis.call('zrange', KEYS[f], 0, FAIR_SCAN - 1, 'WITHSCORES') end
    while at < #window do
      local id, score = window[at], tonumber(window[at + 1])
      at = at + 2
      local key = redis.call('hget', KEYS[f + 2], id)
      if not key then
        redis.call('zrem', KEYS[f], id)
        redis.call('zrem', KEYS[f + 1], id)
        fair = fair - 1
      else
        if counts[key] == nil then
          counts[key] = tonumber(redis.call('hget', KEYS[f + 4], key) or '0')
        end
        local early = 0
        if interval > 0 then
          if tats[key] == nil then
            tats[key] = tonumber(redis.call('zscore', KEYS[f + 6], key) or '0')
          end
          early = tats[key] - ahead - now
        end
        if limit > 0 and counts[key] >= limit then
          skipped = skipped + 1
        elseif early > 0 then
          skipped = skipped + 1
          if wait == 0 or early < wait then wait = math.ceil(early) end
        else
          redis.call('zrem', KEYS[f], id)
          redis.call('zrem', KEYS[f + 1], id)
          fair = fair - 1
          counts[key] = counts[key] + 1
          redis.call('hincrby', KEYS[f + 4], key, 1)
          if interval > 0 then
            tats[key] = math.max(tats[key], now) + interval
            redis.call('zadd', KEYS[f + 6], tats[key], key)
          end
          if score > vt then vt = score end
          if tonumber(redis.call('hget', KEYS[f + 3], key) or '-1') == score then
            redis.call('hdel', KEYS[f + 3], key)
          end
          redis.call('sadd', acks, id)
          out[#out + 1] = id
          out[#out + 1] = redis.call('hget', bodies, id)
          return true
        end
      end
    end
    open = false
    return false
  end
  local function size(i)
    if i == LANE_DEFAULT and open then return len[i] + fair end
    return len[i]
  end
  local taken = 0
  while taken < want do
    local pick = nil
    for i = LANE_COUNT, 2, -1 do
      if size(i) > 0 and passed[i] >= bound then pick = i break end
    end
    if not pick then
      for i = 1, LANE_COUNT do
        if size(i) > 0 then pick = i break end
      end
    end
    if not pick then break end
    local took
    if pick == LANE_DEFAULT and open and fair > 0 and (len[pick] == 0 or turn == 1) then
      took = fair_next()
      if took then turn = 0 end
    else
      took = pop(KEYS[first + pick - 1], bodies, acks, out)
      len[pick] = len[pick] - 1
      if pick == LANE_DEFAULT then turn = 1 end
    end
    if took then
      taken = taken + 1
      for i = pick + 1, LANE_COUNT do
        if size(i) > 0 then passed[i] = passed[i] + 1 end
      end
      passed[pick] = 0
    end
  end
  for i = 1, LANE_COUNT do
    if passed[i] > 0 then
      redis.call('hset', state, LANE_NAMES[i], passed[i])
    else
      redis.call('hdel', state, LANE_NAMES[i])
    end
  end
  if keyed then redis.call('hset', state, 'vt', vt, 'turn', turn) end
  return skipped, wait
end
"""
)
