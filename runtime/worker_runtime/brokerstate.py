"""What the service knows of its Redis's data safety: eviction, resets, a full memory.

Faults around the worker lose work silently unless someone looks:

* **Eviction.** A Redis whose ``maxmemory-policy`` is not ``noeviction`` drops keys
  when it is full, a queue's whole bodies hash among them. :func:`check_config` refuses
  to boot on it (exit 78, one line naming the policy and the fix) unless
  ``REDIS_ALLOW_EVICTION=true`` accepts the risk. Where ``CONFIG GET`` is refused (a
  renamed command, an ACL, as managed Redis services do) it reads ``INFO`` instead; where
  that is refused too it says so once and goes on.
* **Persistence**, where the operator asks for it (``REDIS_REQUIRE_PERSISTENCE=true``):
  a Redis with neither AOF nor RDB save points loses every queued message when it
  restarts; :func:`check_config` refuses to boot on it the same way.
* **A reset.** A Redis restarted without persistence, failed over to an empty replica or
  flushed has lost every queue, acks set and heartbeat. Each worker process writes an
  *epoch* key per broker namespace (:func:`.layout.epoch_key`, a random token, ``SET
  NX``) and reads it back with every heartbeat; :class:`BrokerEpoch` sees the key gone
  or replaced and says so once (log event ``broker_reset``, with Redis's ``run_id``
  before and after when ``INFO`` is allowed), counts it (``broker_resets_total``, through
  the broker signal ``after_broker_reset``) and keeps ``/readyz`` not ready while the
  reset is *unresolved*: until every delivery this process held when it saw the reset
  has ended (each settlement finds its message gone and is counted in
  ``jobs_lost_total{queue}``, never as done), at once when it held none, or when the
  process stops. Messages that were only queued are gone with the data: the reset's
  line and counter are all that can be said of them.
* **A full Redis** (``maxmemory`` reached under ``noeviction``) refuses commands that
  may grow memory. The worker's scripts free before they write (a heartbeat removes its
  old entry first; a fetch pops before it adds; a settlement removes the id from the
  acks set first), so fetching, settling, heartbeats and recovery go on; what cannot
  (a producer's enqueue) fails with :class:`BrokerFull`, one line. :func:`full_problem`
  is readiness's check.
* **A send that gets no answer** (a lost connection, a timeout) may have been enqueued all
  the same: it raises :class:`EnqueueUncertain`, and a resend of the same message id is
  stored at most once.

This module imports neither Dramatiq nor the actors; it writes only the readiness
notices of :func:`reset_notices_dir`.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

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


class EnqueueUncertain(redis.ConnectionError, redis.TimeoutError):
    """A send whose outcome is unknown: Redis did not answer (a lost connection, a timeout),
    and the message **may have been enqueued** (the command may have reached Redis, or may
    still, when the path heals). A ``redis.ConnectionError`` and a ``redis.TimeoutError``,
    so callers that handle either handle it.

    A retry is safe when it resends the same message id (:attr:`message`, e.g.
    ``broker.enqueue(message)`` again, or ``producer.enqueue(..., message_id=...)``) within
    :data:`.layout.SENT_TTL_MS`: at most one copy is enqueued (:data:`.layout.ENQUEUE`)."""

    def __init__(self, text: str, message: Any) -> None:
        super().__init__(text)
        #: The message as the caller gave it: resend it (same ``message_id``) to retry.
        self.message = message


def uncertain_error(message: Any, error: BaseException) -> EnqueueUncertain:
    """The :class:`EnqueueUncertain` of ``message`` (a ``dramatiq.Message``) for ``error``."""
    return EnqueueUncertain(
        f"Redis did not answer the enqueue of message {message.message_id} for actor "
        f"{message.actor_name!r} ({type(error).__name__}: {error}); it may have been enqueued: "
        "resend the same message id to retry, at most one copy is enqueued",
        message,
    )


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


def check_config(
    client: redis.Redis, allow_eviction: bool, require_persistence: bool = False
) -> list[str]:
    """The refusal lines for Redis's configuration, one per problem (empty: boot).

    * Eviction: a ``maxmemory-policy`` other than ``noeviction`` is refused unless
      ``allow_eviction`` (then one warning).
    * Persistence, when ``require_persistence``: a Redis with neither AOF
      (``appendonly yes``) nor RDB save points (``save ""``) loses every queued message
      when it restarts; refused.

    Where ``CONFIG GET`` is refused (a renamed command, as managed Redis services do, or
    an ACL), the same facts are read from ``INFO memory`` (``maxmemory_policy``) and
    ``INFO persistence`` (``aof_enabled``; RDB save points are not shown there, so RDB
    counts as persisting once Redis made a snapshot since it started: ``rdb_saves``,
    ``rdb_last_bgsave_time_sec``). Logs one warning when neither can be read (an ACL
    refusing both, or Redis not answering): the worker goes on unchecked.

    Parameters:
      client: a client of the broker.
      allow_eviction: ``REDIS_ALLOW_EVICTION``.
      require_persistence: ``REDIS_REQUIRE_PERSISTENCE`` (default False: not checked).
    """
    checked = "maxmemory-policy" + (" and persistence" if require_persistence else "")
    refused: redis.ResponseError | None = None
    try:
        try:
            policy, persistence = _config_facts(client, require_persistence)
        except redis.ResponseError as error:  # renamed or disabled CONFIG, an ACL (NOPERM)
            refused = error
            policy, persistence = _info_facts(client, require_persistence)
    except redis.ResponseError as error:  # INFO refused too
        logger.warning(
            "cannot check Redis's %s, CONFIG GET and INFO are refused (%s); make sure it is "
            "noeviction%s, or queued messages are lost",
            checked,
            error,
            " and persists (appendonly yes or save points)" if require_persistence else "",
            extra={"event": "redis_config_unchecked"},
        )
        return []
    except redis.RedisError as error:
        logger.warning(
            "cannot check Redis's %s now (%s)",
            checked,
            error,
            extra={"event": "redis_config_unchecked"},
        )
        return []
    refusals = [
        refusal
        for refusal in (_eviction_refusal(policy, allow_eviction), persistence)
        if refusal is not None
    ]
    if refused is not None and not refusals:  # a refusal is the one line: nothing before it
        logger.info(
            "Redis's CONFIG GET is refused (%s); its %s read from INFO",
            refused,
            checked,
            extra={"event": "redis_config_from_info", "policy": policy},
        )
    return refusals


def _config_facts(client: redis.Redis, require_persistence: bool) -> tuple[str, str | None]:
    """Redis's ``maxmemory-policy`` and the persistence refusal (None: none), from CONFIG."""
    config = dict(client.config_get("maxmemory-policy"))
    if require_persistence:  # one name per CONFIG GET: Redis 6 takes no more
        config.update(client.config_get("appendonly"))
        config.update(client.config_get("save"))
    found = {layout.text(name): layout.text(value) for name, value in config.items()}
    persistence = None
    if require_persistence:
        persistence = _persistence_refusal(found.get("appendonly"), found.get("save"))
    return found.get("maxmemory-policy", NO_EVICTION), persistence


def _info_facts(client: redis.Redis, require_persistence: bool) -> tuple[str, str | None]:
    """The same facts as :func:`_config_facts`, from ``INFO`` (where CONFIG is refused)."""
    policy = str(client.info("memory").get("maxmemory_policy", NO_EVICTION))
    persistence = None
    if require_persistence:
        persistence = _info_persistence_refusal(client.info("persistence"))
    return policy, persistence


def _info_persistence_refusal(info: dict[str, Any]) -> str | None:
    """The refusal when ``INFO persistence`` shows neither AOF nor any RDB snapshot since
    Redis started (its save points are not shown there)."""
    if int(info.get("aof_enabled", 0)) or int(info.get("rdb_bgsave_in_progress", 0)):
        return None
    if int(info.get("rdb_saves", 0)) > 0 or int(info.get("rdb_last_bgsave_time_sec", -1)) >= 0:
        return None
    return (
        "REDIS_URL: Redis persists nothing (INFO persistence: aof_enabled 0 and no RDB "
        "snapshot since it started; CONFIG is refused, so save points cannot be read): a "
        "restart loses every queued message; set appendonly yes on that Redis, or "
        "REDIS_REQUIRE_PERSISTENCE=false to accept the loss"
    )


def _eviction_refusal(policy: str, allow_eviction: bool) -> str | None:
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


def _persistence_refusal(appendonly: str | None, save: str | None) -> str | None:
    """The refusal when Redis persists nothing: neither AOF nor an RDB save point (a Redis
    that does not report one of them is taken at its word for the other)."""
    if appendonly is None and save is None:
        return None  # neither reported: nothing to judge
    if appendonly == "yes" or (save or "").strip():
        return None
    return (
        f"REDIS_URL: Redis persists nothing (appendonly {appendonly or 'no'}, save "
        f"{save!r}): a restart loses every queued message; set appendonly yes (or save "
        "points) on that Redis, or REDIS_REQUIRE_PERSISTENCE=false to accept the loss"
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


# -- resets ------------------------------------------------------------------------------


def reset_notices_dir(state_dir: Path) -> Path:
    """Where each worker process keeps its readiness notice of an unresolved reset."""
    return state_dir / "resets"


def read_reset_notices(state_dir: Path, alive: Callable[[int], bool]) -> list[str]:
    """The unresolved resets of this container's live worker processes, one line each."""
    folder = reset_notices_dir(state_dir)
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("*.txt")):
        try:
            pid, text = int(path.stem), path.read_text().strip()
        except (OSError, ValueError):
            continue
        if text and alive(pid):
            found.append(f"worker process {pid}: {text}")
    return found


class BrokerEpoch:
    """Notices that Redis lost its data (see the module docstring).

    Parameters:
      client: the broker's client.
      held: the deliveries this process holds now, as (queue, redis id) pairs.
      on_reset: called once per reset seen, with its reason (the broker emits
        ``after_broker_reset``, which the Metrics middleware counts).
      state_dir: ``WORKER_STATE_DIR``, where the readiness notice is written (None: none).
    """

    def __init__(
        self,
        client: redis.Redis,
        held: Callable[[], set[tuple[str, str]]],
        on_reset: Callable[[str], None],
        state_dir: Path | None = None,
    ) -> None:
        self.client = client
        self.held = held
        self.on_reset = on_reset
        self.notice = None if state_dir is None else reset_notices_dir(state_dir)
        #: Namespace -> the epoch token this process adopted there.
        self.epochs: dict[str, str] = {}
        #: Resets seen by this process.
        self.resets = 0
        #: Deliveries held when the last reset was seen that have not ended yet.
        self.unresolved: set[tuple[str, str]] = set()
        self._reason = ""
        self._run_id: str | None = None
        self._lock = threading.Lock()

    def check(self, namespaces: Iterable[str]) -> None:
        """Read each namespace's epoch now and :meth:`observe` it."""
        for namespace in namespaces:
            self.observe(namespace, self.client.get(layout.epoch_key(namespace)))

    def observe(self, namespace: str, value: Any) -> bool:
        """``value`` is the epoch key of ``namespace`` as read from Redis (None: missing).
        True when it tells of a reset (then said, counted, and a new epoch written)."""
        found = None if value is None else layout.text(value)
        with self._lock:
            known = self.epochs.get(namespace)
            if found is not None and found == known:
                return False
            if known is None and self._run_id is None:
                self._run_id = self._read_run_id()
            if found is None:
                found = self._write_epoch(namespace)
            if found is None:  # not written (Redis full): adopted at a later look
                self.epochs.pop(namespace, None)
            else:
                self.epochs[namespace] = found
            if known is None:
                return False
            self._reset(namespace)
            return True

    def _write_epoch(self, namespace: str) -> str | None:
        """Write a new epoch token for ``namespace`` (unless one appeared meanwhile); the
        token in Redis, or None when it cannot be written now."""
        key, token = layout.epoch_key(namespace), uuid.uuid4().hex
        try:
            if self.client.set(key, token, nx=True):
                return token
            found = self.client.get(key)
        except redis.ResponseError as error:
            logger.warning("cannot write the broker epoch now: %s", error)
            return None
        return None if found is None else layout.text(found)

    def _reset(self, namespace: str) -> None:
        """Say, count and note a reset (the lock is held)."""
        self.resets += 1
        before, after = self._run_id, self._read_run_id()
        self._run_id = after
        if before is not None and after is not None and before != after:
            cause = f"Redis restarted empty (run_id {before} -> {after})"
        elif before is not None and after is not None:
            cause = "the data was deleted without a restart (FLUSHALL, FLUSHDB or eviction)"
        else:
            cause = "its epoch key is gone"
        held = self.held()
        self.unresolved = held
        self._reason = (
            f"broker reset: Redis lost its data ({cause}); {len(held)} deliveries held here "
            "were lost with it and are counted in jobs_lost_total as they end"
        )
        logger.error(
            "Redis lost its data (broker reset): %s; queued messages are gone, %d held "
            "deliveries will be counted lost",
            cause,
            len(held),
            extra={
                "event": "broker_reset",
                "namespace": namespace,
                "cause": cause,
                "held": len(held),
                "run_id_before": before,
                "run_id_after": after,
            },
        )
        self.on_reset(cause)
        self._write_notice()

    def ended(self, queue: str, redis_id: str) -> None:
        """A delivery ended (settled, lost or handed back)."""
        if self.unresolved:
            self.unresolved.discard((queue, redis_id))
            if not self.unresolved:
                self._write_notice()

    def close(self) -> None:
        """The process stops: whatever was unresolved is no longer this process's."""
        self.unresolved = set()
        self._write_notice()

    @property
    def problem(self) -> str | None:
        """Readiness's line while a reset is unresolved, else None."""
        return self._reason if self.unresolved else None

    def _write_notice(self) -> None:
        if self.notice is None:
            return
        path = self.notice / f"{os.getpid()}.txt"
        try:
            if self.unresolved:
                self.notice.mkdir(parents=True, exist_ok=True)
                path.write_text(self._reason + "\n")
            else:
                path.unlink(missing_ok=True)
        except OSError as error:
            logger.warning("cannot write the reset notice for readiness: %s", error)

    def _read_run_id(self) -> str | None:
        """Redis's ``run_id`` (new at each start), or None where ``INFO`` is refused."""
        try:
            info = self.client.info("server")
        except redis.RedisError:
            return None
        run_id = info.get("run_id")
        return None if run_id is None else str(run_id)
