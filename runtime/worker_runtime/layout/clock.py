"""One clock: Redis's.

Every time our scripts write or compare (heartbeats, dead letters' times, the cutoffs of
recovery and retention, the scheduler's ticks) is Redis's ``TIME``, read inside the Lua
(:data:`CLOCK`) or by :func:`redis_now_ms`, never the host's: a worker whose
clock is minutes off neither judges live workers dead nor is judged dead.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import redis


#: Lua: Redis's clock in ms (``TIME``), and a heartbeat that frees its old entry before it
#: writes the new one (so a full Redis takes it: Redis refuses a script's growing write
#: only when the script has written nothing yet).
CLOCK: Final = """
local function now_ms()
  local t = redis.call('time')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function beat(heartbeats, id, now)
  redis.call('zrem', heartbeats, id)
  redis.call('zadd', heartbeats, now, id)
end
"""


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
