"""``promtool test rules`` cases for the rules of :mod:`.alerts`, per pool, from the pools.

Pure functions, no Pulumi: :func:`rule_tests` is what the baked ``make alerts`` writes to
``ops/alerts.test.yaml`` and ``make alerts-check`` runs with ``promtool test rules``.

The input series carry the labels the Prometheus Operator gives a PodMonitor's targets
(:mod:`.monitoring`): ``job="<namespace>/<project>-workers"``, ``namespace``, ``pod``,
``container``, ``endpoint``, ``instance`` and the pool label from ``podTargetLabels``; the
scheduler's copies of the backlog carry the pool label themselves. Every case lists every
alert of the service with the alerts expected at its evaluation time (most often none),
so a rule that fires for the wrong pool, the wrong service or not at all fails it.

Cases, for each pool (its neighbour: the next pool of the file):

- ``wedged``: a backlog over its age target and no job finished, beside a busy neighbour;
- ``saturated``: every handler busy and the backlog growing, beside an idle neighbour
  (no alert: more replicas are the answer, not a fetch bottleneck);
- ``starved``: handlers idle while the backlog grows (the fetch bottleneck);
- ``zero pods``: no pod of the pool, ready and overdue delayed messages (seen through the
  scheduler's copy), unserved;
- ``unserved``: pods up but none serving the pool's queues while work waits;
- ``failing``: failures, new dead letters, an OOM kill, a saturated database pool;
- ``broker faults``: a Redis reset seen by its workers, settlements that lost their
  message, a full Redis (its backlog copies read ``broker_full`` 1);

and for the service: another service's broken pools in another namespace (the same
project, queue and schedule names: nothing of it reaches this service's alerts); a late
schedule beside another service's healthy one; every scheduler gone; followers only
while another service's scheduler leads; nothing scraped at all.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from worker_runtime import contract

from .alerts import WORKER_CONTAINER, alert_groups, pool_series
from .args import PoolSpec
from .keys import delay_queue
from .monitoring import POOL_SERIES_LABEL, scrape_job

#: When each case is evaluated; its series run from 0 to :data:`SPAN_M` minutes, one a minute.
EVAL_M = 25
SPAN_M = 30
#: Namespace of the other service (the same project and pool names).
OTHER_NAMESPACE = "elsewhere"
#: A schedule name when the pools file has none (the rules do not depend on the names).
SOME_SCHEDULE = "some_schedule"

Series = dict[str, Any]
Alert = dict[str, Any]


def _selector(name: str, labels: Mapping[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def constant(value: float) -> str:
    """promtool's notation for a series holding ``value`` over the span."""
    return f"{_number(value)}x{SPAN_M}"


def growing(start: float, per_minute: float) -> str:
    """A series growing by ``per_minute`` each minute."""
    return f"{_number(start)}+{_number(per_minute)}x{SPAN_M}"


@dataclass
class PoolState:
    """What one pool shows during a case.

    Parameters:
      pods: worker pods scraped (0: the pool is at zero).
      inflight: handlers busy per pod (``None``: all of them).
      done_per_minute: successful jobs per minute per pod and queue.
      failed_per_minute: failed jobs per minute per pod and queue.
      depth, depth_per_minute: ready messages per queue, and their growth.
      age_s: age of the next due message per queue.
      overdue_s, delayed: how overdue the delay list's head is; delayed messages.
      dead_per_minute: new dead letters per minute per queue.
      oom: the first pod was OOM-killed (and restarted at minute 20).
      db_saturated: every database connection of the first pod is in use.
      resets_per_minute: broker resets seen per minute per pod.
      lost_per_minute: settlements that found their message gone, per minute per pod and queue.
      time_limits_per_minute: jobs ended by their time limit, per minute per pod and queue.
      broker_full: Redis refuses writes for being full (``broker_full`` 1).
      throttled_per_minute: messages a fetch left queued for a downstream budget, per
        minute per pod and queue.
      throttled_reason: the ``reason`` of those (``budget``; ``key``: a key's limit).
      unserved: work waits on each queue and no live process serves it (``queue_unserved``
        1, ``queue_consumers`` 0).
    """

    pods: int = 2
    inflight: int | None = 0
    done_per_minute: float = 0
    failed_per_minute: float = 0
    depth: float = 0
    depth_per_minute: float = 0
    age_s: float = 0
    overdue_s: float = 0
    delayed: float = 0
    dead_per_minute: float = 0
    oom: bool = False
    db_saturated: bool = False
    resets_per_minute: float = 0
    lost_per_minute: float = 0
    time_limits_per_minute: float = 0
    broker_full: bool = False
    throttled_per_minute: float = 0
    throttled_reason: str = contract.THROTTLE_BUDGET
    unserved: bool = False


@dataclass
class ServiceState:
    """One service's state during a case: its pools, schedulers and schedules."""

    namespace: str
    pools: dict[str, PoolState] = field(default_factory=dict)
    schedulers: int = 2
    leader: bool = True
    scraped: bool = True
    late: bool = False
    success_after_due: bool = False
    sandbox_namespace: str | None = None


class _Builder:
    """The input series of one case."""

    def __init__(
        self,
        project: str,
        pools: Sequence[PoolSpec],
        database: bool,
        schedules: Sequence[str],
    ) -> None:
        self.project = project
        self.pools = pools
        self.database = database
        self.schedules = list(schedules) or [SOME_SCHEDULE]
        self.series: list[Series] = []

    def add(self, name: str, labels: Mapping[str, str], values: str) -> None:
        self.series.append({"series": _selector(name, labels), "values": values})

    def target(self, namespace: str, pod: str, container: str, n: int) -> dict[str, str]:
        return {
            "namespace": namespace,
            "job": scrape_job(namespace, self.project),
            "pod": pod,
            "container": container,
            "endpoint": "metrics",
            "instance": f"10.0.{n // 250}.{n % 250 + 1}:{contract.METRICS_PORT}",
        }

    def service(self, state: ServiceState) -> None:
        if not state.scraped:
            return
        sandbox = state.sandbox_namespace or f"{state.namespace}-sandbox"
        n = 0
        for index, pool in enumerate(self.pools):
            pstate = state.pools.get(pool.name, PoolState())
            series = pool_series(pool, self.project, state.namespace, sandbox)
            for pod_index in range(pstate.pods):
                n += 1
                pod = f"{self.project}-{pool.slug}-5d8f7c9b{index % 10}-pod{pod_index:02d}"
                labels = {
                    **self.target(series.namespace, pod, WORKER_CONTAINER, n),
                    POOL_SERIES_LABEL: pool.slug,
                }
                self.worker(pool, pstate, labels, first=pod_index == 0)
                self.backlog(pool, pstate, labels)
        for index in range(state.schedulers):
            n += 1
            pod = f"{self.project}-scheduler-7c9b5d8f4-sch{index:02d}"
            labels = self.target(state.namespace, pod, "scheduler", n)
            self.add("up", labels, constant(1))
            leads = state.leader and index == 0
            self.add(contract.SCHEDULER_LEADER, labels, constant(1 if leads else 0))
            for schedule in self.schedules:
                due, success = 1_800_000_000, 1_800_003_600
                if state.late:
                    due, success = 1_800_086_400, 1_800_003_600
                if state.success_after_due:
                    due, success = 1_800_086_400, 1_800_090_000
                self.add(
                    contract.SCHEDULE_DUE,
                    {**labels, "schedule": schedule},
                    constant(due),
                )
                self.add(
                    contract.SCHEDULE_LAST_SUCCESS,
                    {**labels, "schedule": schedule},
                    constant(success),
                )
            for pool in self.pools:
                pstate = state.pools.get(pool.name, PoolState())
                self.backlog(pool, pstate, {**labels, POOL_SERIES_LABEL: pool.slug})

    def worker(self, pool: PoolSpec, s: PoolState, labels: dict[str, str], first: bool) -> None:
        slots = pool.processes * pool.concurrency
        self.add("up", labels, constant(1))
        self.add(contract.CONCURRENCY, labels, constant(slots))
        self.add(
            contract.INFLIGHT_JOBS, labels, constant(slots if s.inflight is None else s.inflight)
        )
        for queue in pool.queues:
            actor = {"queue": queue, "actor": f"handle_{queue}"}
            self.add(
                contract.JOBS_PROCESSED,
                {**labels, **actor, "outcome": contract.SUCCESS},
                growing(100, s.done_per_minute),
            )
            self.add(
                contract.JOBS_PROCESSED,
                {**labels, **actor, "outcome": contract.FAILURE},
                growing(5, s.failed_per_minute),
            )
            self.add(contract.JOBS_LOST, {**labels, "queue": queue}, growing(0, s.lost_per_minute))
            self.add(
                contract.JOBS_TIME_LIMIT_EXCEEDED,
                {**labels, **actor},
                growing(0, s.time_limits_per_minute),
            )
            self.add(
                contract.JOBS_THROTTLED,
                {**labels, "queue": queue, "reason": s.throttled_reason},
                growing(0, s.throttled_per_minute),
            )
        self.add(contract.BROKER_RESETS, labels, growing(0, s.resets_per_minute))
        # The kernel killed a worker process of the first pod at minute 20 (the container
        # lived on: its supervisor replaced the process).
        self.add(
            contract.OOM_KILLS, labels, f"0x20 1x{SPAN_M - 20}" if first and s.oom else constant(0)
        )
        if self.database:
            size = pool.processes * pool.db_pool_size
            self.add(contract.DB_POOL_SIZE, labels, constant(size))
            self.add(
                contract.DB_POOL_IN_USE, labels, constant(size if s.db_saturated and first else 0)
            )
        if first and s.oom:
            ksm = {
                "namespace": labels["namespace"],
                "pod": labels["pod"],
                "container": WORKER_CONTAINER,
                "job": "kube-state-metrics",
                "instance": "10.9.9.9:8080",
            }
            self.add(
                "kube_pod_container_status_last_terminated_reason",
                {**ksm, "reason": "OOMKilled"},
                constant(1),
            )
            self.add("kube_pod_container_status_restarts_total", ksm, f"0x20 1x{SPAN_M - 20}")

    def backlog(self, pool: PoolSpec, s: PoolState, labels: dict[str, str]) -> None:
        for queue in pool.queues:
            q, dq = {**labels, "queue": queue}, {**labels, "queue": delay_queue(queue)}
            self.add(contract.QUEUE_DEPTH, q, growing(s.depth, s.depth_per_minute))
            self.add(contract.QUEUE_DEPTH, dq, constant(s.delayed))
            self.add(contract.QUEUE_OLDEST_MESSAGE, q, constant(s.age_s))
            self.add(contract.QUEUE_OLDEST_MESSAGE, dq, constant(s.overdue_s))
            self.add(contract.QUEUE_DEAD_LETTERS, q, growing(3, s.dead_per_minute))
            self.add(contract.QUEUE_UNSERVED, q, constant(1 if s.unserved else 0))
            self.add(contract.QUEUE_CONSUMERS, q, constant(0 if s.unserved else s.pods))
        self.add(contract.BROKER_FULL, labels, constant(1 if s.broker_full else 0))


# -- what Prometheus makes of an alert's templates ---------------------------------------------

_TEMPLATE = re.compile(r"\{\{\s*(.*?)\s*\}\}")


def _go_float(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e21:
        return str(int(value))
    return repr(value)


def humanize_duration(value: float) -> str:
    """Prometheus's ``humanizeDuration`` for values of at least one second."""
    if abs(value) < 1:
        raise ValueError(f"humanize_duration({value}): the cases use whole seconds")
    sign = "-" if value < 0 else ""
    v = abs(value)
    days, hours, minutes = int(v) // 86400, int(v) // 3600 % 24, int(v) // 60 % 60
    seconds = f"{math.fmod(v, 60):.4g}"
    if days:
        return f"{sign}{days}d {hours}h {minutes}m {seconds}s"
    if hours:
        return f"{sign}{hours}h {minutes}m {seconds}s"
    if minutes:
        return f"{sign}{minutes}m {seconds}s"
    return f"{sign}{seconds}s"


def humanize_timestamp(value: float) -> str:
    """Prometheus's ``humanizeTimestamp`` (Go's time.Time in UTC) for whole seconds."""
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S +0000 UTC")


def expand(text: str, labels: Mapping[str, str], value: float) -> str:
    """An annotation as Prometheus expands it (the few forms the rules use)."""

    def one(match: re.Match[str]) -> str:
        expr = match.group(1)
        if expr.startswith("$labels."):
            return labels.get(expr.removeprefix("$labels."), "")
        forms: dict[str, Callable[[float], str]] = {
            "$value": _go_float,
            "$value | humanizeDuration": humanize_duration,
            "$value | humanizeTimestamp": humanize_timestamp,
        }
        if expr not in forms:
            raise ValueError(f"template {{{{ {expr} }}}}: not known to ruletests.expand")
        return forms[expr](value)

    return _TEMPLATE.sub(one, text)


# -- the cases --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """An alert a case expects: its rule, the labels of its series and its value."""

    alert: str
    series: dict[str, str]
    value: float
    pool: str | None = None
    queue: str | None = None


class RuleTests:
    """Builds the cases of :func:`rule_tests`."""

    def __init__(
        self,
        project: str,
        pools: Sequence[PoolSpec],
        *,
        database: bool,
        namespace: str,
        sandbox_namespace: str | None,
        schedules: Sequence[str],
    ) -> None:
        self.project, self.pools, self.database = project, list(pools), database
        self.namespace, self.sandbox_namespace = namespace, sandbox_namespace
        self.schedules = list(schedules) or [SOME_SCHEDULE]
        self.groups = alert_groups(
            project,
            pools,
            database=database,
            namespace=namespace,
            sandbox_namespace=sandbox_namespace,
        )
        self.rules: dict[tuple[str, str | None, str | None], dict[str, Any]] = {}
        for group in self.groups:
            for rule in group["rules"]:
                key = (rule["alert"], rule["labels"].get("pool"), rule["labels"].get("queue"))
                self.rules[key] = rule
        self.alertnames = sorted({key[0] for key in self.rules})

    def series_of(self, pool: PoolSpec) -> Any:
        sandbox = self.sandbox_namespace or f"{self.namespace}-sandbox"
        return pool_series(pool, self.project, self.namespace, sandbox)

    def case(
        self,
        name: str,
        ours: ServiceState,
        expected: list[Expected],
        other: ServiceState | None = None,
    ) -> dict[str, Any]:
        builder = _Builder(self.project, self.pools, self.database, self.schedules)
        builder.service(dataclasses.replace(ours, sandbox_namespace=self.sandbox_namespace))
        if other is not None:
            builder.service(other)
        tests = []
        for alertname in self.alertnames:
            alerts = []
            for item in (e for e in expected if e.alert == alertname):
                rule = self.rules[(item.alert, item.pool, item.queue)]
                labels = {**item.series, **rule["labels"]}
                annotations = {
                    k: expand(v, item.series, item.value) for k, v in rule["annotations"].items()
                }
                alerts.append({"exp_labels": labels, "exp_annotations": annotations})
            alerts.sort(key=lambda a: sorted(a["exp_labels"].items()))
            tests.append({"eval_time": f"{EVAL_M}m", "alertname": alertname, "exp_alerts": alerts})
        return {
            "name": name,
            "interval": "1m",
            "input_series": builder.series,
            "alert_rule_test": tests,
        }

    # expected alerts of one pool

    def by_pool(self, pool: PoolSpec, **more: str) -> dict[str, str]:
        s = self.series_of(pool)
        ns = s.namespace if more.pop("own", "") else (s.service_namespace or s.namespace)
        return {"namespace": ns, POOL_SERIES_LABEL: pool.slug, **more}

    def unserved(self, pool: PoolSpec) -> list[Expected]:
        return [
            Expected("WorkerQueueUnserved", self.by_pool(pool, queue=q), 1, pool.slug, q)
            for q in pool.queues
        ]

    def age(self, pool: PoolSpec, age_s: float) -> list[Expected]:
        return [
            Expected("WorkerBacklogAgeOverSLO", self.by_pool(pool, queue=q), age_s, pool.slug, q)
            for q in pool.queues
        ]

    def unobserved(self, ns: str, pool: PoolSpec) -> Expected:
        """``WorkerBacklogUnobserved`` of ``pool``'s first queue, in namespace ``ns``."""
        labels = {
            "namespace": ns,
            "job": scrape_job(ns, self.project),
            POOL_SERIES_LABEL: pool.slug,
            "queue": pool.queues[0],
        }
        return Expected("WorkerBacklogUnobserved", labels, 1, pool.slug)

    def pool_cases(self, pool: PoolSpec, neighbour: PoolSpec | None) -> list[dict[str, Any]]:
        ns = self.namespace
        over = pool.backlog_age_target_s + 600
        own = {"own": "1"}
        cases = []
        busy = PoolState(inflight=None, done_per_minute=60, depth=10)
        idle = PoolState()
        wedged = ServiceState(
            ns,
            {
                pool.name: PoolState(inflight=None, depth=50, age_s=over),
                **({neighbour.name: busy} if neighbour else {}),
            },
        )
        cases.append(
            self.case(
                f"{pool.name}: wedged (a backlog, no job done) beside a busy neighbour",
                wedged,
                [
                    *self.age(pool, over),
                    Expected("WorkerNoProgress", self.by_pool(pool, **own), 0, pool.slug),
                ],
            )
        )
        saturated = ServiceState(
            ns,
            {
                pool.name: PoolState(
                    pods=1, inflight=None, done_per_minute=30, depth=10, depth_per_minute=5
                ),
                **({neighbour.name: idle} if neighbour else {}),
            },
        )
        cases.append(
            self.case(
                f"{pool.name}: saturated, the backlog growing, beside an idle neighbour",
                saturated,
                [],
            )
        )
        starved = ServiceState(
            ns,
            {pool.name: PoolState(inflight=0, done_per_minute=1, depth=10, depth_per_minute=5)},
        )
        cases.append(
            self.case(
                f"{pool.name}: handlers idle while the backlog grows",
                starved,
                [Expected("WorkerFetchBottleneck", self.by_pool(pool, **own), 0, pool.slug)],
            )
        )
        depth = 5
        zero = ServiceState(
            ns,
            {
                pool.name: PoolState(
                    pods=0, depth=depth, age_s=over, overdue_s=600, delayed=2, unserved=True
                )
            },
        )
        cases.append(
            self.case(
                f"{pool.name}: zero pods, ready and overdue delayed messages",
                zero,
                [
                    *self.age(pool, over),
                    *(
                        Expected(
                            "WorkerDelayedMessagesOverdue",
                            self.by_pool(pool, queue=delay_queue(q)),
                            600,
                            pool.slug,
                        )
                        for q in pool.queues
                    ),
                    Expected(
                        "WorkerPoolHasNoWorker",
                        {POOL_SERIES_LABEL: pool.slug},
                        depth,
                        pool.slug,
                    ),
                    *self.unserved(pool),
                ],
            )
        )
        cases.append(
            self.case(
                f"{pool.name}: pods up, none serving its queues (unserved), beside a busy "
                "neighbour",
                ServiceState(
                    ns,
                    {
                        pool.name: PoolState(depth=depth, unserved=True),
                        **({neighbour.name: busy} if neighbour else {}),
                    },
                ),
                [
                    *self.unserved(pool),
                    Expected("WorkerNoProgress", self.by_pool(pool, **own), 0, pool.slug),
                ],
            )
        )
        failing_state = PoolState(
            done_per_minute=10,
            failed_per_minute=10,
            time_limits_per_minute=1,
            dead_per_minute=1,
            oom=True,
            db_saturated=True,
        )
        first_pod = f"{self.project}-{pool.slug}-5d8f7c9b{self.pools.index(pool) % 10}-pod00"
        s = self.series_of(pool)
        failing = [
            *(
                Expected("WorkerFailureRateHigh", self.by_pool(pool, queue=q, **own), 0, pool.slug)
                for q in pool.queues
            ),
            *(
                Expected("WorkerDeadLettersGrowing", self.by_pool(pool, queue=q), 0, pool.slug)
                for q in pool.queues
            ),
            *(
                Expected(
                    "WorkerTimeLimitExceeded",
                    self.by_pool(pool, queue=q, actor=f"handle_{q}", **own),
                    failing_state.pods * 10,  # the rule's increase(...[10m])
                    pool.slug,
                )
                for q in pool.queues
            ),
            Expected(
                "WorkerOOMKilled",
                {"namespace": s.namespace, "pod": first_pod, "container": WORKER_CONTAINER},
                1,
                pool.slug,
            ),
            Expected(
                "WorkerProcessOOMKilled", self.by_pool(pool, pod=first_pod, **own), 1, pool.slug
            ),
        ]
        if self.database and pool.db_pool_size > 0:
            failing.append(
                Expected(
                    "WorkerDbPoolSaturated",
                    self.by_pool(pool, pod=first_pod, **own),
                    0,
                    pool.slug,
                )
            )
        cases.append(
            self.case(
                f"{pool.name}: failing jobs, dead letters, an OOM kill, a full database pool",
                ServiceState(ns, {pool.name: failing_state}),
                failing,
            )
        )
        faults = PoolState(resets_per_minute=1, lost_per_minute=1, broker_full=True)
        window_m = 10  # the rules' increase(...[10m])
        cases.append(
            self.case(
                f"{pool.name}: Redis reset (jobs lost) and full",
                ServiceState(ns, {pool.name: faults}),
                [
                    Expected(
                        "WorkerBrokerReset",
                        self.by_pool(pool, **own),
                        faults.pods * window_m,
                        pool.slug,
                    ),
                    *(
                        Expected(
                            "WorkerJobsLost",
                            self.by_pool(pool, queue=q, **own),
                            faults.pods * window_m,
                            pool.slug,
                        )
                        for q in pool.queues
                    ),
                    Expected("WorkerBrokerFull", self.by_pool(pool), 1, pool.slug),
                ],
            )
        )
        if pool.uses:
            throttled = PoolState(
                inflight=None, done_per_minute=30, depth=10, age_s=over, throttled_per_minute=60
            )
            cases.append(
                self.case(
                    f"{pool.name}: the downstream budget holds the backlog past its target",
                    ServiceState(ns, {pool.name: throttled}),
                    [
                        *self.age(pool, over),
                        *(
                            Expected(
                                "WorkerThrottledByDownstream",
                                self.by_pool(pool, queue=q, **own),
                                throttled.pods * throttled.throttled_per_minute / 60,
                                pool.slug,
                            )
                            for q in pool.queues
                        ),
                    ],
                )
            )
            keyed = PoolState(
                inflight=None,
                done_per_minute=30,
                depth=10,
                age_s=over,
                throttled_per_minute=60,
                throttled_reason=contract.THROTTLE_KEY,
            )
            cases.append(
                self.case(
                    f"{pool.name}: a key's limit (not the downstream) holds the backlog",
                    ServiceState(ns, {pool.name: keyed}),
                    [*self.age(pool, over)],
                )
            )
        return cases

    def service_cases(self) -> list[dict[str, Any]]:
        ns = self.namespace
        over = 100_000
        broken = PoolState(
            inflight=0,
            failed_per_minute=10,
            depth=500,
            depth_per_minute=10,
            age_s=over,
            overdue_s=over,
            delayed=10,
            dead_per_minute=3,
            oom=True,
            db_saturated=True,
            resets_per_minute=1,
            lost_per_minute=1,
            time_limits_per_minute=1,
            broker_full=True,
            unserved=True,
        )
        other = ServiceState(
            OTHER_NAMESPACE, {p.name: broken for p in self.pools}, leader=False, late=True
        )
        cases = [
            self.case(
                "another service's broken pools in another namespace; this one healthy",
                ServiceState(ns),
                [],
                other=other,
            )
        ]
        late = [
            Expected("ScheduleLate", {"namespace": ns, "schedule": s}, 1_800_086_400)
            for s in self.schedules
        ]
        cases.append(
            self.case(
                "a late schedule beside another service's healthy one",
                ServiceState(ns, late=True),
                late,
                other=ServiceState(OTHER_NAMESPACE, success_after_due=True),
            )
        )
        no_leader = Expected("SchedulerNoLeader", {}, 1)
        sandboxed = [self.unobserved(ns, p) for p in self.pools if p.sandbox]
        cases.append(
            self.case(
                "every scheduler gone (the sandbox pool's backlog is unseen with them)",
                ServiceState(ns, schedulers=0),
                [no_leader, *sandboxed],
                other=ServiceState(OTHER_NAMESPACE),
            )
        )
        cases.append(
            self.case(
                "only followers, while another service's scheduler leads",
                ServiceState(ns, leader=False),
                [no_leader],
                other=ServiceState(OTHER_NAMESPACE),
            )
        )
        unseen = [self.unobserved(ns, p) for p in self.pools]
        cases.append(
            self.case(
                "nothing of this service scraped (its PodMonitor not selected)",
                ServiceState(ns, scraped=False),
                [no_leader, *unseen],
                other=ServiceState(OTHER_NAMESPACE),
            )
        )
        return cases


def rule_tests(
    project: str,
    pools: Sequence[PoolSpec],
    *,
    database: bool,
    namespace: str,
    sandbox_namespace: str | None = None,
    schedules: Sequence[str] = (),
    rule_file: str = "alerts.yaml",
) -> dict[str, Any]:
    """A ``promtool test rules`` file for :func:`.alerts.alert_groups` of these arguments.

    Parameters:
      project, pools, database, namespace, sandbox_namespace: as for ``alert_groups``.
      schedules: the schedule names of pools.toml (the schedule cases use them).
      rule_file: the rule file, relative to the test file (default ``alerts.yaml``).
    """
    builder = RuleTests(
        project,
        pools,
        database=database,
        namespace=namespace,
        sandbox_namespace=sandbox_namespace,
        schedules=schedules,
    )
    cases = []
    for index, pool in enumerate(pools):
        neighbour = pools[(index + 1) % len(pools)] if len(pools) > 1 else None
        cases += builder.pool_cases(pool, neighbour)
    cases += builder.service_cases()
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": cases}
