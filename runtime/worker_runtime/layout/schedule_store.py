"""The schedule store: the scheduler's scripts and every field of a schedule's state hash
(:func:`..keys.schedule_state_key`), read and written here only."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .keys import (
    bodies_key,
    queue_key,
    schedule_lock_key,
    schedule_state_key,
    scheduler_leader_key,
)
from .schema import text

if TYPE_CHECKING:
    import redis

#: What a schedule's ticks are counted as (its state hash's ``runs:<outcome>`` fields, which
#: the scripts below and :func:`read_states` spell).
SCHEDULE_OUTCOMES: Final = ("fired", "caught_up", "missed", "skipped_overlap")


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
