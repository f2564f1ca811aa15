"""The timing relations of the runtime, one owner (standard library only, imports nothing of
the package): the numbers that bound a drain, a recovery and a retry, and the rules that
tie them together. Everything else imports them from here; :func:`relation_problems`
checks the rules (``tests/test_timing.py`` runs it, and shows each rule failing when a
number breaks it).

The rules:

* job timeout < drain window < drain window + kill-after < the pod's grace period
  (:func:`timing_problems`, for the settings, the pool model and worker_infra's guard);
* kill-after >= the consumers' stop + the interrupt grace + a Redis call of the drain: the
  supervisor kills a late worker process only after its own bounded drain ends;
* orphan age > the Redis socket timeout: a take whose reply is still on its way is never
  mistaken for an orphan;
* clock freshness > the heartbeat interval: each heartbeat measures Redis's clock again
  before the measurement is thought stale;
* every 7-day window (a cancellation, an idempotency key) >= the longest retry backoff: a
  retry copy still finds its cancellation and its done key;
* a compose worker's stop grace = its drain window + :data:`COMPOSE_GRACE_MARGIN_S`, a
  margin above kill-after (:func:`compose_grace_s`).
"""

from __future__ import annotations

from typing import Final

#: How long past the drain window (``WORKER_SHUTDOWN_TIMEOUT_MS``) the supervisor kills a
#: worker process that has not exited and recovers its messages at once (past the process's
#: own bound: its consumers' stop, the interrupt grace, the requeue). The pod's grace period
#: must outlast it (:func:`timing_problems`); the infra program hands it to worker_infra.
KILL_AFTER_DRAIN_S: Final = 10.0
#: How long interrupted handlers get to unwind before the process exits without them.
INTERRUPT_GRACE_S: Final = 2.0
#: How long the consumers get to stop fetching (one fetch of ``FETCH_TIMEOUT_MS`` at most,
#: plus the hand-back of their prefetch caches) before the drain goes on without them.
CONSUMER_STOP_S: Final = 2.0
#: The longest any Redis call of the drain waits (to connect or for a reply): a Redis that
#: stopped answering (a blackholed path) costs each drain step this much, not the client's
#: whole socket timeout, so the drain ends in its window and what it could not settle stays
#: held for recovery.
DRAIN_REDIS_TIMEOUT_S: Final = 2.0
#: The socket timeout of a worker's and a producer's Redis client (connect: half of it).
REDIS_SOCKET_TIMEOUT_S: Final = 10
#: How long a message this worker holds in Redis must stay unknown in memory before the
#: consumer requeues it as an orphan: longer than any fetch or settlement can be on its way.
ORPHAN_AFTER_S: Final = 60.0
#: The most seconds between two heartbeats (and recovery passes) of a worker process.
HEARTBEAT_INTERVAL_MAX_S: Final = 5.0
#: How old (s) the measured offset of Redis's clock may be before it is read again.
CLOCK_FRESH_S: Final = 10.0
#: Seven days, in ms: how long a cancellation and an idempotency key are kept.
SEVEN_DAYS_MS: Final = 7 * 86_400_000
#: The longest pause before a retry (Dramatiq's ``max_backoff`` default, which the runtime
#: keeps): the 7-day windows must outlast it.
MAX_BACKOFF_MS: Final = 7 * 86_400_000
#: What a compose worker's ``stop_grace_period`` adds to its pool's drain window.
COMPOSE_GRACE_MARGIN_S: Final = 15


def timing_problems(
    job_timeout_ms: int,
    shutdown_timeout_ms: int,
    grace_s: float | None = None,
    kill_after_s: float = KILL_AFTER_DRAIN_S,
) -> list[str]:
    """The timing rule (DESIGN 2.8), one function for the settings, the pool model and the
    infra's timing guard: ``job timeout < drain window < drain window + kill-after < grace``.

    A running job can finish within the drain window; a process still running past it is
    killed ``kill_after_s`` later and its messages recovered, before the kubelet's SIGKILL
    ends the pod at the end of its grace period.

    Parameters:
      job_timeout_ms: ``WORKER_JOB_TIMEOUT_MS``.
      shutdown_timeout_ms: ``WORKER_SHUTDOWN_TIMEOUT_MS``, the drain window.
      grace_s: the pod's ``terminationGracePeriodSeconds``; None (the default) checks only
        what the service knows (job < drain): the grace period exists only in the infra.
      kill_after_s: the supervisor's kill after the drain window (default
        :data:`KILL_AFTER_DRAIN_S`).

    Returns:
      list[str]: one line per broken leg, naming the numbers; empty when the rule holds.
    """
    problems = []
    if not job_timeout_ms < shutdown_timeout_ms:
        problems.append(
            f"job_timeout_ms ({job_timeout_ms}) must be below "
            f"shutdown_timeout_ms ({shutdown_timeout_ms})"
        )
    if grace_s is not None and not shutdown_timeout_ms + kill_after_s * 1000 < grace_s * 1000:
        problems.append(
            f"grace period {grace_s:g} s must exceed shutdown_timeout_ms ({shutdown_timeout_ms}) "
            f"+ the supervisor's kill after {kill_after_s:g} s = "
            f"{shutdown_timeout_ms / 1000 + kill_after_s:g} s: the kubelet's SIGKILL would come "
            "before the supervisor kills a late process and recovers its messages"
        )
    return problems


def compose_grace_s(shutdown_timeout_ms: int) -> int:
    """A compose worker's ``stop_grace_period`` (s) for a pool's drain window."""
    return -(-shutdown_timeout_ms // 1000) + COMPOSE_GRACE_MARGIN_S


def relation_problems() -> list[str]:
    """One line per broken relation between this module's numbers (see the module's text);
    empty when every one holds. Read at call time, so a changed number is checked."""
    problems = []
    drain_bound = CONSUMER_STOP_S + INTERRUPT_GRACE_S + DRAIN_REDIS_TIMEOUT_S
    if drain_bound > KILL_AFTER_DRAIN_S:
        problems.append(
            f"KILL_AFTER_DRAIN_S ({KILL_AFTER_DRAIN_S:g}) must be at least CONSUMER_STOP_S + "
            f"INTERRUPT_GRACE_S + DRAIN_REDIS_TIMEOUT_S ({drain_bound:g}): the supervisor "
            "would kill a worker process inside its own bounded drain"
        )
    if not ORPHAN_AFTER_S > REDIS_SOCKET_TIMEOUT_S:
        problems.append(
            f"ORPHAN_AFTER_S ({ORPHAN_AFTER_S:g}) must exceed REDIS_SOCKET_TIMEOUT_S "
            f"({REDIS_SOCKET_TIMEOUT_S}): a take still on its way would be requeued as an orphan"
        )
    if not CLOCK_FRESH_S > HEARTBEAT_INTERVAL_MAX_S:
        problems.append(
            f"CLOCK_FRESH_S ({CLOCK_FRESH_S:g}) must exceed HEARTBEAT_INTERVAL_MAX_S "
            f"({HEARTBEAT_INTERVAL_MAX_S:g}): the clock would be read again between heartbeats"
        )
    if SEVEN_DAYS_MS < MAX_BACKOFF_MS:
        problems.append(
            f"the 7-day windows ({SEVEN_DAYS_MS} ms) must be at least MAX_BACKOFF_MS "
            f"({MAX_BACKOFF_MS}): a retry copy would outlive its cancellation and done key"
        )
    if not COMPOSE_GRACE_MARGIN_S > KILL_AFTER_DRAIN_S:
        problems.append(
            f"COMPOSE_GRACE_MARGIN_S ({COMPOSE_GRACE_MARGIN_S}) must exceed KILL_AFTER_DRAIN_S "
            f"({KILL_AFTER_DRAIN_S:g}): docker would kill a pool before its supervisor does"
        )
    return problems
