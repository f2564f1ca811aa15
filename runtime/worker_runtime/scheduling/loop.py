"""The scheduler's leader loop (the ``scheduler`` command): fires the schedules of pools.toml,
one leader at a time.

Several replicas may run. One holds the leader lock (``SET NX PX``, renewed every third
of ``SCHEDULER_LEADER_TTL_MS``); the others try to take it every quarter of the TTL, so
they take over within TTL + TTL/4 when the leader dies. SIGTERM lets the leader finish
its round and release the lock, so a follower takes over at once.

A tick is enqueued at most once, even with two leaders (one paused past its lease): the
leader claims a tick and enqueues its message in one Lua script that also checks it
still holds the leader lock and that the schedule's last handled tick (kept in Redis,
so a restart resumes) is older. The message id is derived from schedule and tick.

Each round, per schedule, the due ticks are those after the last handled one. A tick
at most ``grace`` late (the leader TTL plus one second, so a handover loses nothing) is on
time (outcome ``fired``):

* ``missed = "skip"``: only the latest due tick fires, if it is on time; the others are
  counted ``missed`` (after downtime: the ticks of the downtime);
* ``missed = "catch_up"``: the latest ``catch_up_limit`` due ticks are enqueued oldest
  first, those not on time as ``caught_up``; older ones are counted ``missed``;
* a tick whose previous run still holds the run lock is not enqueued:
  ``skipped_overlap`` (the worker's :class:`.middleware.ScheduleLock` checks again when a
  run starts, for runs that were queued behind one another).

Time is Redis's (``TIME`` at the start of each round), never the host's: a replica whose
clock is minutes off neither fires ticks early nor counts ticks ``missed`` that were not,
and a handover between replicas with different clocks loses no tick. The leader lease is
Redis's ``PX`` expiry, renewed on this host's monotonic clock.

Counts, last fired tick and last success live in Redis (one hash per schedule); the
exporter publishes them on ``METRICS_PORT`` (:class:`ScheduleCollector`) beside /livez
and /readyz, like the worker's. It also publishes the backlog of every pool of pools.toml
(:class:`.exporter.BacklogCollector`, each series labelled with its pool): the
scheduler never scales to zero, so a pool's backlog, its alerts and its scaler's age
trigger hold while the pool has no pod. It runs without schedules too, for that.
Liveness: the main loop ticks a progress board.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import redis
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import Field, ValidationError

from .. import contract, redisclient
from ..boards import (
    DEFAULT_STALLED_AFTER_S,
    ProgressBoard,
    StateDirError,
    default_state_dir,
    progress_dir,
)
from ..exitcodes import EX_OK
from ..layout import (
    REDIS_MESSAGE_ID,
    SCHEDULE_OUTCOMES,
    fire_tick,
    handled_tick,
    miss_ticks,
    read_states,
    redis_now,
    release_lock,
    renew_lock,
    scheduler_leader_key,
)
from ..service import current
from ..settings import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    DEFAULT_METRICS_PORT,
    LogFormat,
    LogLevel,
    MetricsPort,
    RedisSettings,
    ServiceName,
    StalledAfterS,
    WorkerSettings,
    config_errors,
    refuse,
)
from ..stopsignals import StopSignals
from . import schedules as sched
from .schedules import Schedule

if TYPE_CHECKING:
    import dramatiq
    from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)
OUTCOMES = SCHEDULE_OUTCOMES


class SchedulerSettings(RedisSettings):
    """The scheduler's environment (no ``WORKER_POOL``: it serves no pool; the actors'
    broker is then a producer's, :mod:`.producer`).

    Parameters (env variables): ``REDIS_URL`` (the worker's rule), ``METRICS_PORT`` (9191),
    ``SCHEDULER_LEADER_TTL_MS`` (10000: a dead leader is replaced within it),
    ``WORKER_STATE_DIR`` and ``HEALTH_STALLED_AFTER_S`` (liveness, as for the worker),
    ``OTEL_SERVICE_NAME``, ``LOG_LEVEL``, ``LOG_FORMAT`` (json or console).
    """

    metrics_port: MetricsPort = DEFAULT_METRICS_PORT
    scheduler_leader_ttl_ms: Annotated[
        int,
        Field(ge=contract.SCHEDULER_LEADER_TTL_MIN_MS, le=contract.SCHEDULER_LEADER_TTL_MAX_MS),
    ] = contract.SCHEDULER_LEADER_TTL_MS
    worker_state_dir: Path = Field(default_factory=default_state_dir)
    health_stalled_after_s: StalledAfterS = DEFAULT_STALLED_AFTER_S
    otel_service_name: ServiceName = Field(default_factory=lambda: current().project)
    log_level: LogLevel = DEFAULT_LOG_LEVEL
    log_format: LogFormat = DEFAULT_LOG_FORMAT

    @property
    def uses_database(self) -> bool:
        """The scheduler holds no database connection (readiness asks Redis only)."""
        return False

    @property
    def ttl_s(self) -> float:
        return self.scheduler_leader_ttl_ms / 1000

    @property
    def grace_s(self) -> float:
        """How late a tick may fire and still count as on time: a handover's worst case."""
        return self.ttl_s + 1.0


def load_scheduler_settings() -> SchedulerSettings:
    """Validated scheduler settings, or exit 78 with one line per bad variable."""
    try:
        return SchedulerSettings()
    except ValidationError as error:
        refuse(config_errors(error))


def downstream_limits() -> dict[str, int]:
    """Every downstream of pools.toml -> its run-time budget, with this environment's
    overrides (exit 78 on a bad one, as for a worker)."""
    from ..pools import PoolsFileError, effective_downstreams
    from ..settings import pools

    try:
        resources = effective_downstreams(pools(), os.environ)
    except PoolsFileError as error:
        refuse(config_errors(error))
    return {name: resource.budget for name, resource in resources.items()}


def load_schedules() -> dict[str, Schedule]:
    """The schedules of pools.toml (exit 78 when the file is bad)."""
    from ..settings import pools

    return dict(pools().schedules)


@dataclass(frozen=True)
class Target:
    """Where a schedule's messages go: its actor's name and queue."""

    actor: str
    queue: str


def check_actors(schedules: Mapping[str, Schedule]) -> dict[str, Target]:
    """Import the actors, which refuses to boot (exit 78) when a schedule cannot run
    (``actors.check_queues``); return where each schedule's messages go."""
    from ..actors import load

    broker = load()  # declares every actor, checks the schedules
    return {
        name: Target(s.actor, broker.actors[s.actor].queue_name) for name, s in schedules.items()
    }


class Scheduler:
    """Fires due schedules while it holds the leader lock; waits for it otherwise.

    Parameters:
      settings: the scheduler's settings.
      schedules: the schedules of pools.toml, validated.
      targets: schedule -> its actor and queue (:func:`check_actors`).
      broker: Dramatiq broker whose enqueue hooks run around each enqueue (None: none).
      client: Redis client (default: one for ``REDIS_URL``).
      pools: queue -> pool of every pool's queue, whose backlog the exporter publishes
        (default: none).
    """

    def __init__(
        self,
        settings: SchedulerSettings,
        schedules: Mapping[str, Schedule],
        targets: Mapping[str, Target],
        broker: dramatiq.Broker | None = None,
        client: redis.Redis | None = None,
        pools: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.pools = dict(pools or {})
        self.schedules = dict(schedules)
        self.targets = dict(targets)
        self.broker = broker
        self.client = client or redisclient.connect(
            settings.redis_url.get_secret_value(), socket_timeout=5, socket_connect_timeout=2
        )
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.signals = StopSignals()
        self.leading = False
        self._renewed = 0.0

    # -- process -------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; exit code 0 after a clean stop (78 when Redis or the
        Sentinels refuse ``REDIS_URL``'s credentials: :func:`.redisclient.credentials_problem`)."""
        refused = redisclient.credentials_problem(
            self.settings.redis_url.get_secret_value(), self.client
        )
        if refused is not None:
            refuse([refused])
        self.signals.install()
        folder = progress_dir(self.settings.worker_state_dir)
        shutil.rmtree(folder, ignore_errors=True)  # boards of a previous run are stale
        try:
            board = ProgressBoard(self.settings.worker_state_dir, 1, self.me)
        except StateDirError as error:
            refuse([str(error)])
        from ..exporter import Exporter

        registry = CollectorRegistry()
        registry.register(ScheduleCollector(self))
        if self.pools:
            from ..exporter import BacklogCollector, FlowCollector

            registry.register(BacklogCollector(self.client, list(self.pools), self.pools))
            # The downstream budgets are shared by every pool: seen here at zero pods too,
            # like the backlog (the dashboard takes the max over exporters).
            registry.register(FlowCollector(self.client, [], downstream_limits()))
        try:
            exporter = Exporter(cast(WorkerSettings, self.settings), registry)
        except OSError as error:
            board.close()
            refuse([f"METRICS_PORT={self.settings.metrics_port}: cannot listen: {error.strerror}"])
        threading.Thread(target=exporter.serve_forever, name="exporter", daemon=True).start()
        logger.info(
            "scheduler started",
            extra={
                "event": "start",
                "version": current().version,
                "project": current().project,
                "scheduler": self.me,
                "schedules": sorted(self.schedules),
                "config": {
                    "SCHEDULER_LEADER_TTL_MS": self.settings.scheduler_leader_ttl_ms,
                    "METRICS_PORT": self.settings.metrics_port,
                },
            },
        )
        while not self.signals.requested:
            board.tick()
            try:
                wait = self.step(redis_now(self.client))
            except redis.RedisError as error:
                logger.warning("redis error: %s", error, extra={"event": "redis_error"})
                wait = min(1.0, self.settings.ttl_s / 4)
                if self.leading and time.monotonic() - self._renewed > self.settings.ttl_s:
                    self._step_down("leader lock not renewed within its TTL")
            self.signals.wait(wait)
        if self.leading:
            try:
                release_lock(self.client, scheduler_leader_key(), self.me)
            except redis.RedisError as error:
                logger.warning("could not release the leader lock: %s", error)
            self.leading = False
        exporter.shutdown()
        board.close()
        logger.info("scheduler stopped", extra={"event": "stop", "scheduler": self.me})
        return EX_OK

    # -- leadership ----------------------------------------------------------------------------

    def step(self, now: float) -> float:
        """One round at ``now`` (Redis's clock, s: every replica judges ticks by the same
        clock, whatever its host's says): keep or seek the lead, fire what is due; return
        seconds to wait."""
        began = time.monotonic()
        ttl_ms = self.settings.scheduler_leader_ttl_ms
        renew_every = self.settings.ttl_s / 3
        if self.leading:
            if time.monotonic() - self._renewed >= renew_every:
                if renew_lock(self.client, scheduler_leader_key(), self.me, ttl_ms):
                    self._renewed = time.monotonic()
                else:
                    self._step_down("the leader lock is held by another scheduler")
        elif self.client.set(scheduler_leader_key(), self.me, nx=True, px=ttl_ms):
            self.leading, self._renewed = True, time.monotonic()
            logger.info("leading", extra={"event": "leading", "scheduler": self.me})
        if not self.leading:
            return max(0.05, self.settings.ttl_s / 4)
        for name in self.schedules:
            self.fire_due(name, now)
        until_next = min(
            (next(s.ticks_after(now)) for s in self.schedules.values()), default=math.inf
        )
        until_renew = self._renewed + renew_every - time.monotonic()
        elapsed = time.monotonic() - began
        return max(0.005, min(until_next - now - elapsed, until_renew))

    def _step_down(self, why: str) -> None:
        self.leading = False
        logger.warning("no longer leading: %s", why, extra={"event": "step_down"})

    # -- firing --------------------------------------------------------------------------------

    def fire_due(self, name: str, now: float) -> list[tuple[int, str]]:
        """Handle the due ticks of schedule ``name``; return (tick, outcome) of each fired."""
        schedule = self.schedules[name]
        last = handled_tick(self.client, name, now)
        if last is None:  # first sight of this schedule: ticks from now on, none from the past
            return []
        latest = schedule.latest_tick(now)
        if latest <= last:
            return []
        on_time = now - self.settings.grace_s
        if schedule.missed == "catch_up":
            fire = schedule.ticks_before(now, last, schedule.catch_up_limit)
        else:
            fire = [latest] if latest >= on_time else []
        through = fire[0] - 1 if fire else latest
        missed = schedule.count_ticks(last, through + 1)
        if missed and miss_ticks(self.client, self.me, name, through, missed) == 1:
            logger.warning(
                "schedule %s: %d missed tick(s)",
                name,
                missed,
                extra={
                    "event": "schedule_missed",
                    "schedule": name,
                    "missed": missed,
                    "policy": schedule.missed,
                    "through": sched.utc_iso(through),
                },
            )
        done = []
        for tick in fire:
            kind = "fired" if tick >= on_time else "caught_up"
            outcome = self._enqueue(name, schedule, tick, kind, now)
            if outcome == "not_leader":
                self._step_down("the leader lock was lost while firing")
                break
            if outcome != "done":
                done.append((tick, outcome))
        return done

    def _enqueue(self, name: str, schedule: Schedule, tick: int, outcome: str, now: float) -> str:
        import dramatiq

        target = self.targets[name]
        message_id = sched.tick_message_id(name, tick)
        message: dramatiq.Message[Any] = dramatiq.Message(
            queue_name=target.queue,
            actor_name=target.actor,
            args=tuple(schedule.args),
            kwargs=dict(schedule.kwargs),
            options={
                sched.OPTION_SCHEDULE: name,
                sched.OPTION_TICK: tick,
                sched.OPTION_LEASE_MS: schedule.lease_ms,
                REDIS_MESSAGE_ID: message_id,
            },
            message_id=message_id,
            message_timestamp=int(now * 1000),
        )
        if self.broker is not None:
            self.broker.emit_before("enqueue", message, None)
        result = fire_tick(
            self.client,
            self.me,
            name,
            target.queue,
            tick,
            outcome,
            message_id,
            message.encode(),
            now,
        )
        if result in ("fired", "caught_up") and self.broker is not None:
            self.broker.emit_after("enqueue", message, None)
        if result in ("fired", "caught_up", "skipped_overlap"):
            logger.log(
                logging.WARNING if result == "skipped_overlap" else logging.INFO,
                "schedule %s: %s",
                name,
                result,
                extra={
                    "event": "schedule_" + result,
                    "schedule": name,
                    "tick": sched.utc_iso(tick),
                    "job_id": message_id,
                    "actor": target.actor,
                    "queue": target.queue,
                },
            )
        return result


class ScheduleCollector(Collector):
    """The schedules' series, read from Redis at each scrape (every replica shows the same
    values but ``scheduler_leader``; aggregate with ``max``):

    ``schedule_runs_total{schedule,outcome}``: ticks by outcome (fired, caught_up, missed,
    skipped_overlap; the worker adds the overlaps it finds when a run starts).
    ``schedule_last_success_timestamp_seconds{schedule}``: when a run last succeeded (0: never).
    ``schedule_due_timestamp_seconds{schedule}``: the latest tick at least ``max_runtime_s``
    old: a run that started at or after it should have succeeded by now (absent before the
    first such tick). Late when it exceeds the last success.
    ``scheduler_leader``: 1 on the replica that leads, else 0.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterable[Metric]:
        leader = GaugeMetricFamily(
            contract.SCHEDULER_LEADER, "1 on the scheduler replica that leads."
        )
        leader.add_metric([], 1.0 if self.scheduler.leading else 0.0)
        try:
            states = read_states(self.scheduler.client, self.scheduler.schedules)
            now = redis_now(self.scheduler.client)
        except redis.RedisError:
            return [leader]
        runs = CounterMetricFamily(
            contract.SCHEDULE_RUNS,
            "Ticks of each schedule, by outcome.",
            labels=["schedule", "outcome"],
        )
        success = GaugeMetricFamily(
            contract.SCHEDULE_LAST_SUCCESS,
            "When a run of the schedule last succeeded (0: never).",
            labels=["schedule"],
        )
        due = GaugeMetricFamily(
            contract.SCHEDULE_DUE,
            "The latest tick whose run should have succeeded by now (max_runtime_s ago).",
            labels=["schedule"],
        )
        for name, state in states.items():
            for outcome in OUTCOMES:
                runs.add_metric([name, outcome], state.runs[outcome])
            success.add_metric([name], state.success_at or 0.0)
            schedule = self.scheduler.schedules[name]
            tick = schedule.latest_tick(now - schedule.max_runtime_s)
            if state.since is not None and tick >= state.since:
                due.add_metric([name], float(tick))
        return [runs, success, due, leader]
