"""What the service knows of its Redis's data safety: eviction, a full memory.

Faults around the worker lose work silently unless someone looks:

* **Eviction.** A Redis whose ``maxmemory-policy`` is not ``noeviction`` drops keys
  when it is full, a queue's whole bodies hash among them. :func:`check_eviction_policy`
  refuses to boot on it (exit 78, one line naming the policy and the fix) unless
  ``REDIS_ALLOW_EVICTION=true`` accepts the risk. Where ``CONFIG GET`` is refused (a
  renamed command, an ACL, as managed Redis services do) it says so once and goes on.
* **A full Redis** (``maxmemory`` reached under ``noeviction``) refuses commands that
  may grow memory. The worker's scripts free before they write (a heartbeat removes its
  old entry first; a fetch pops before it adds; a settlement removes the id from the
  acks set first), so fetching, settling, heartbeats and recovery go on; what cannot
  (a producer's enqueue) fails with :class:`BrokerFull`, one line. :func:`full_problem`
  is readiness's check.

This module imports neither Dramatiq nor the actors.
"""

from __future__ import annotations

import logging

import redis

from . import layout

logger = logging.getLogger(__name__)

#: The only ``maxmemory-policy`` under which Redis never drops a key to make room.
NO_EVICTION = "noeviction"
#: The start of the error Redis answers a write with when ``maxmemory`` is reached.
OOM_PREFIX = "OOM"


class BrokerFull(redis.ResponseError):
    """Redis refused a write because it is full (``maxmemory`` reached, ``noeviction``).

    A ``redis.ResponseError``, so callers that handle Redis errors handle it; its message
    is one line naming what was refused and the fix."""


def is_oom(error: BaseException) -> bool:
    """True when ``error`` is Redis's answer to a write while it is full (redis-py's
    ``OutOfMemoryError``, or the reply's ``OOM`` prefix)."""
    return isinstance(error, redis.exceptions.OutOfMemoryError) or (
        isinstance(error, redis.ResponseError) and str(error).startswith(OOM_PREFIX)
    )


def full_error(what: str, error: BaseException) -> BrokerFull:
    """The :class:`BrokerFull` for ``what`` (e.g. ``message for actor 'x'``) refused."""
    return BrokerFull(
        f"Redis is full, {what} refused: {_oom_text(error)} (free memory in Redis or raise "
        "its maxmemory; queued messages are kept)"
    )


def _oom_text(error: BaseException) -> str:
    """Redis's OOM reply as it sent it (redis-py strips the ``OOM`` prefix)."""
    text = str(error)
    return text if text.startswith(OOM_PREFIX) else f"{OOM_PREFIX} {text}"


# -- configuration, checked at boot ------------------------------------------------------


def check_eviction_policy(client: redis.Redis, allow_eviction: bool) -> str | None:
    """The refusal line when Redis may evict keys and ``allow_eviction`` is false; else None.

    Logs one warning when the policy cannot be read (``CONFIG GET`` refused or Redis not
    answering: the worker goes on), and one when an evicting policy is accepted.

    Parameters:
      client: a client of the broker.
      allow_eviction: ``REDIS_ALLOW_EVICTION``.
    """
    try:
        reply = client.config_get("maxmemory-policy")
    except redis.ResponseError as error:  # renamed or disabled CONFIG, an ACL (NOPERM)
        logger.warning(
            "cannot check Redis's maxmemory-policy, CONFIG GET is refused (%s); make sure it "
            "is noeviction, an eviction drops queued messages",
            error,
            extra={"event": "redis_config_unchecked"},
        )
        return None
    except redis.RedisError as error:
        logger.warning(
            "cannot check Redis's maxmemory-policy now (%s)",
            error,
            extra={"event": "redis_config_unchecked"},
        )
        return None
    policy = layout.text(reply.get("maxmemory-policy", NO_EVICTION))
    if policy == NO_EVICTION:
        return None
    if allow_eviction:
        logger.warning(
            "Redis evicts keys (maxmemory-policy %s); REDIS_ALLOW_EVICTION=true accepts that "
            "queued messages are lost when it is full",
            policy,
            extra={"event": "redis_eviction_allowed", "policy": policy},
        )
        return None
    return (
        f"REDIS_URL: Redis's maxmemory-policy is {policy}: it evicts keys when full, queued "
        "messages among them; set maxmemory-policy noeviction on that Redis, or "
        "REDIS_ALLOW_EVICTION=true to accept the loss"
    )


# -- a full Redis ------------------------------------------------------------------------


def full_problem(client: redis.Redis, namespace: str = layout.NAMESPACE) -> str | None:
    """Readiness: why Redis refuses writes for being full, or None.

    Writes one short-lived key of ``namespace`` (:func:`.layout.probe_key`): exact under
    every policy and allowed to every broker user (an ACL limited to the namespace, as
    the sandbox pool's). Other errors are left to the caller's own checks.
    """
    try:
        client.set(layout.probe_key(namespace), "1", px=layout.PROBE_TTL_MS)
    except redis.ResponseError as error:
        if is_oom(error):
            return f"redis: full, writes refused: {_oom_text(error)}"
    return None
