"""Prometheus alert rules of a service, derived from its pools (pools.toml).

Pure functions, no Pulumi: :func:`alert_groups` is what :class:`~.service.WorkerService`
renders as a ``PrometheusRule`` and what the baked ``make alerts`` writes to
``ops/alerts.yaml``; :mod:`.ruletests` writes the ``promtool test rules`` cases that prove
each rule, per pool. How to read each alert: docs/operations.md of the template.

Label scheme (:mod:`.monitoring`): one PodMonitor per namespace scrapes every pod of the
service, so ``job`` (``<namespace>/<project>-workers``) names the service and
``worker_template_pool`` the pool. Every rule is generated per pool (or for the service),
selects its series by ``namespace``, ``job`` and pool, aggregates ``by`` them, and carries
the static labels ``service``, ``namespace`` and ``pool``: nothing of another pool or
another service reaches it, and every alert says whose it is.

The backlog (``queue_*``) is exported by the scheduler, which never scales to zero (and
by the pool's own pods, with the same values: combined with ``max``, never summed), so
the backlog alerts hold at zero pods. Where absence is the failure, absence alerts: no
worker of a pool that has a backlog, no backlog series at all, no scheduler that leads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker_runtime import contract

from .args import PoolSpec
from .keys import DELAY_SUFFIX
from .monitoring import POOL_SERIES_LABEL, PoolSeries, queues_regex, scrape_job

Rule = dict[str, Any]

#: How long a backlog may stay over its target before the alert fires.
BACKLOG_FOR = "10m"
#: How long a due delayed message may wait before its alert fires (seconds overdue).
DELAYED_OVERDUE_S = 300
#: How long a pool may have a backlog and no worker (KEDA wakes a pool in a polling
#: interval plus a pod start) before it pages.
NO_WORKER_FOR = "10m"
#: How long a queue may hold work that no live process serves (``queue_unserved``) before
#: it pages: longer than a reload, a rollout or a pod's restart takes.
UNSERVED_FOR = "5m"
#: Container name of every worker pod (see :mod:`.pool`).
WORKER_CONTAINER = "worker"
#: Metrics of kube-state-metrics the OOM alert reads (not exported by the service).
KUBE_STATE_METRICS = (
    "kube_pod_container_status_last_terminated_reason",
    "kube_pod_container_status_restarts_total",
)
#: The pool's identity in every aggregation (the namespace of its series, its pool label).
BY_POOL = f"namespace, {POOL_SERIES_LABEL}"


def _labels(project: str, namespace: str, pool: str | None, **more: str) -> dict[str, str]:
    labels = {"service": project, "namespace": namespace}
    if pool is not None:
        labels["pool"] = pool
    return {**labels, **more}


def pool_series(pool: PoolSpec, project: str, namespace: str, sandbox_namespace: str) -> PoolSeries:
    """The series of ``pool`` (its pods in the sandbox namespace for the sandbox pool)."""
    return PoolSeries(
        project,
        pool.slug,
        sandbox_namespace if pool.sandbox else namespace,
        service_namespace=namespace,
    )


def backlog_age_rule(pool: PoolSpec, series: PoolSeries, queue: str) -> Rule:
    """The age alert of one queue, at its pool's ``backlog_age_target_s``."""
    target = pool.backlog_age_target_s
    selector = series.backlog(f'queue="{queue}"')
    return {
        "alert": "WorkerBacklogAgeOverSLO",
        "expr": (
            f"max by ({BY_POOL}, queue) ({contract.QUEUE_OLDEST_MESSAGE}{{{selector}}}) > {target}"
        ),
        "for": BACKLOG_FOR,
        "labels": _labels(
            series.project,
            series.namespace,
            series.pool,
            severity="page",
            queue=queue,
            slo_seconds=str(target),
        ),
        "annotations": {
            "summary": f"{series.project}/{series.pool}: queue {queue}'s next due message "
            "waited {{ $value | humanizeDuration }}",
            "description": (
                f"Over pool {pool.name}'s backlog_age_target_s ({target} s, pools.toml) for "
                f"{BACKLOG_FOR}: scaling is capped (max_replicas, downstream capacity) or the "
                f"workers are not fetching. Compare {contract.INFLIGHT_JOBS} with {contract.CONCURRENCY}."
            ),
        },
    }


#: The window over which a pool counts as throttled (``jobs_throttled_total`` rising).
THROTTLED_WINDOW = "5m"
#: The throttles of a downstream resource (a key's limit, ``reason="key"``, is the
#: service's own choice: no alert).
DOWNSTREAM_REASONS = f'reason=~"{contract.THROTTLE_BUDGET}|{contract.THROTTLE_RATE}"'


def throttled_rule(pool: PoolSpec, series: PoolSeries) -> Rule:
    """A queue of a pool that ``uses`` a downstream resource waits past the pool's
    ``backlog_age_target_s`` while its fetches are held back for the resource's budget or
    rate (``jobs_throttled_total`` rising): the budget, not the replicas, is the
    bottleneck, and scaling up would not help."""
    target = pool.backlog_age_target_s
    ready = series.backlog(f'queue=~"{queues_regex(pool.queues)}"')
    on = f"on ({POOL_SERIES_LABEL}, queue)"
    return {
        "alert": "WorkerThrottledByDownstream",
        "expr": (
            f"sum by ({BY_POOL}, queue) "
            f"(rate({contract.JOBS_THROTTLED}{{{series.workers()},{DOWNSTREAM_REASONS}}}"
            f"[{THROTTLED_WINDOW}])) > 0\n"
            f"and {on} max by ({POOL_SERIES_LABEL}, queue) "
            f"({contract.QUEUE_OLDEST_MESSAGE}{{{ready}}}) > {target}"
        ),
        "for": BACKLOG_FOR,
        "labels": _labels(
            series.project,
            series.namespace,
            series.pool,
            severity="ticket",
            slo_seconds=str(target),
        ),
        "annotations": {
            "summary": f"{series.project}/{series.pool}: queue {{{{ $labels.queue }}}} waits "
            "for a downstream budget",
            "description": (
                f"Its next due message waited past pool {pool.name}'s backlog_age_target_s "
                f"({target} s) while fetches were held back for the budget or rate of a "
                f"downstream resource it uses ({contract.JOBS_THROTTLED} by reason): scaling up would "
                "not help. Raise the resource's capacity/rate (pools.toml, "
                "DOWNSTREAM_<NAME>_*) if it allows, or accept the wait; `status` shows the "
                "budgets in use."
            ),
        },
    }


def unserved_rule(pool: PoolSpec, series: PoolSeries, queue: str, project: str) -> Rule:
    """One queue has waiting or due delayed work and no live process serves it
    (``queue_unserved``: what ``status --check`` says), for :data:`UNSERVED_FOR`: the pods
    of its pool are up but serve other queues (``WORKER_QUEUES``), are frozen, or are gone."""
    selector = series.backlog(f'queue="{queue}"')
    return {
        "alert": "WorkerQueueUnserved",
        "expr": f"max by ({BY_POOL}, queue) ({contract.QUEUE_UNSERVED}{{{selector}}}) == 1",
        "for": UNSERVED_FOR,
        "labels": _labels(
            series.project, series.namespace, series.pool, severity="page", queue=queue
        ),
        "annotations": {
            "summary": f"{series.project}/{series.pool}: queue {queue} has work and no live "
            "worker process serves it",
            "description": (
                f"{contract.QUEUE_UNSERVED}: messages wait on {queue} (pool {pool.name}) and no process "
                "with a fresh heartbeat serves it. Run `"
                f"{project} status --check`: are the pool's pods up (WorkerPoolHasNoWorker), "
                "do they serve the queue (WORKER_QUEUES), are they frozen (stale)?"
            ),
        },
    }


def pool_backlog_rules(pool: PoolSpec, series: PoolSeries, project: str) -> list[Rule]:
    """The pool's backlog alerts: each queue's age and whether a live process serves it,
    overdue delayed messages, dead letters, and a backlog that no worker serves (read from
    the scheduler's copy at zero pods)."""
    rules = [backlog_age_rule(pool, series, queue) for queue in pool.queues]
    if pool.uses:
        rules.append(throttled_rule(pool, series))
    rules += [unserved_rule(pool, series, queue, project) for queue in pool.queues]
    delayed = series.backlog(f'queue=~"{queues_regex(pool.queues, DELAY_SUFFIX)}"')
    ready = series.backlog(f'queue=~"{queues_regex(pool.queues)}"')
    head = series.backlog(f'queue="{pool.queues[0]}"')
    here = (series.project, series.namespace, series.pool)
    rules.append(
        {
            "alert": "WorkerDelayedMessagesOverdue",
            "expr": (
                f"max by ({BY_POOL}, queue) ({contract.QUEUE_OLDEST_MESSAGE}{{{delayed}}}) "
                f"> {DELAYED_OVERDUE_S}"
            ),
            "for": BACKLOG_FOR,
            "labels": _labels(*here, severity="ticket"),
            "annotations": {
                "summary": f"{series.project}/{series.pool}: delay queue "
                "{{ $labels.queue }} holds messages due {{ $value | humanizeDuration }} ago",
                "description": "No worker of the pool fetches its delay queue: are its "
                "workers running (WorkerPoolHasNoWorker), and does the scaler see the "
                "overdue age (the age trigger)?",
            },
        }
    )
    rules.append(
        {
            "alert": "WorkerPoolHasNoWorker",
            "expr": (
                f"max by ({POOL_SERIES_LABEL}) ({contract.QUEUE_DEPTH}{{{ready}}}) > 0\n"
                f"unless on ({POOL_SERIES_LABEL}) "
                f"count by ({POOL_SERIES_LABEL}) (up{{{series.workers()}}} == 1)"
            ),
            "for": NO_WORKER_FOR,
            "labels": _labels(*here, severity="page"),
            "annotations": {
                "summary": f"{series.project}/{series.pool}: {{{{ $value }}}} messages "
                "wait and no worker of the pool is up",
                "description": "Every pod of the pool is gone or unscrapable: check the "
                "Deployment, the ScaledObject (kubectl describe scaledobject) and the pods' "
                "events (image, quota, scheduling). See docs/operations.md.",
            },
        }
    )
    rules.append(
        {
            "alert": "WorkerBacklogUnobserved",
            "expr": f"absent({contract.QUEUE_DEPTH}{{{head}}})",
            "for": "5m",
            "labels": _labels(*here, severity="ticket"),
            "annotations": {
                "summary": f"{series.project}/{series.pool}: Prometheus holds no backlog "
                "series of the pool",
                "description": "Neither the scheduler nor a worker of the pool is scraped "
                "(PodMonitor not selected: monitoringLabels; scheduler down; Redis "
                "unreachable from it): the pool's alerts and its Prometheus scaling "
                "triggers are blind. See docs/operations.md.",
            },
        }
    )
    rules.append(
        {
            "alert": "WorkerDeadLettersGrowing",
            "expr": (
                f"max by ({BY_POOL}, queue) (delta({contract.QUEUE_DEAD_LETTERS}{{{ready}}}[15m])) > 0"
            ),
            "labels": _labels(*here, severity="ticket"),
            "annotations": {
                "summary": f"{series.project}/{series.pool}: queue {{{{ $labels.queue }}}} "
                "has new dead letters (15m)",
                "description": "Messages that used up WORKER_MAX_ATTEMPTS (failures or crashes). "
                f"Inspect with `{project} dlq list`, fix, then `dlq replay`.",
            },
        }
    )
    return rules


def oom_rule(series: PoolSeries) -> Rule:
    """A worker container of the pool was OOM-killed and restarted within 30 minutes.

    kube-state-metrics names the pod, not its pool: the pool's pods are
    ``<project>-<pool>-<replicaset hash>-<5 characters>``.
    """
    pod = f"{series.project}-{series.pool}-[a-z0-9]{{1,10}}-[a-z0-9]{{5}}"
    where = f'namespace="{series.namespace}", pod=~"{pod}", container="{WORKER_CONTAINER}"'
    return {
        "alert": "WorkerOOMKilled",
        "expr": (
            "max by (namespace, pod, container) "
            f'(kube_pod_container_status_last_terminated_reason{{{where}, reason="OOMKilled"}}) '
            "== 1\nand on (namespace, pod, container) "
            f"increase(kube_pod_container_status_restarts_total{{{where}}}[30m]) > 0"
        ),
        "labels": _labels(series.project, series.namespace, series.pool, severity="ticket"),
        "annotations": {
            "summary": "{{ $labels.pod }}: the worker container was OOM-killed and restarted",
            "description": "Peak memory exceeded the pool's memory limit: its messages were "
            "recovered (a crash counts as an attempt). Raise memory or handler_memory in "
            "pools.toml, or lower concurrency; see docs/operations.md.",
        },
    }


def pool_worker_rules(series: PoolSeries, database: bool) -> list[Rule]:
    """Fetch bottleneck, DB pool saturation (``database``), no progress, failure rate, OOM
    kills, and the broker's faults (:func:`pool_broker_rules`)."""
    w = series.workers
    failed = w(f'outcome=~"{contract.RETRY}|{contract.FAILURE}|{contract.DEAD_LETTER}"')
    ready = series.backlog(f'queue!~"{queues_regex([".+"], DELAY_SUFFIX)}"')  # no delay queue
    here = (series.project, series.namespace, series.pool)
    on = f"on ({POOL_SERIES_LABEL})"
    rules: list[Rule] = [
        {
            "alert": "WorkerFetchBottleneck",
            "expr": (
                f"sum by ({BY_POOL}) ({contract.INFLIGHT_JOBS}{{{w()}}})\n"
                f"< 0.8 * sum by ({BY_POOL}) ({contract.CONCURRENCY}{{{w()}}})\n"
                f"and {on} max by ({POOL_SERIES_LABEL}) ({contract.QUEUE_DEPTH}{{{ready}}}) > 0\n"
                f"and {on} max by ({POOL_SERIES_LABEL}) (deriv({contract.QUEUE_DEPTH}{{{ready}}}[10m])) > 0"
            ),
            "for": "10m",
            "labels": _labels(*here, severity="ticket"),
            "annotations": {
                "summary": f"{series.project}/{series.pool}: handlers idle while the backlog grows",
                "description": f"{contract.INFLIGHT_JOBS} stays below {contract.CONCURRENCY} with "
                f"a growing {contract.QUEUE_DEPTH}: a fetch bottleneck (Redis latency, prefetch, a consumer "
                "thread that died). See docs/operations.md.",
            },
        }
    ]
    if database:
        rules.append(
            {
                "alert": "WorkerDbPoolSaturated",
                "expr": (
                    f"sum by ({BY_POOL}, pod) ({contract.DB_POOL_IN_USE}{{{w()}}})\n"
                    f">= sum by ({BY_POOL}, pod) ({contract.DB_POOL_SIZE}{{{w()}}})\n"
                    f"and on ({BY_POOL}, pod) sum by ({BY_POOL}, pod) ({contract.DB_POOL_SIZE}{{{w()}}}) > 0"
                ),
                "for": "5m",
                "labels": _labels(*here, severity="ticket"),
                "annotations": {
                    "summary": "{{ $labels.pod }}: every database connection is in use",
                    "description": f"{contract.DB_POOL_IN_USE} at {contract.DB_POOL_SIZE}: handlers wait for "
                    "connections (slow queries, connections held across slow calls, or "
                    "concurrency above what the pool and the database allow). "
                    "See docs/operations.md.",
                },
            }
        )
    rules += [
        {
            "alert": "WorkerNoProgress",
            "expr": (
                f"(sum by ({BY_POOL}) (rate({contract.JOBS_PROCESSED}{{{w()}}}[10m]))\n"
                f" or max by ({BY_POOL}) ({contract.CONCURRENCY}{{{w()}}}) * 0) == 0\n"
                f"and {on} max by ({POOL_SERIES_LABEL}) ({contract.QUEUE_DEPTH}{{{ready}}}) > 0"
            ),
            "for": "10m",
            "labels": _labels(*here, severity="page"),
            "annotations": {
                "summary": f"{series.project}/{series.pool}: a backlog and no job finished in 10m",
                "description": "The pool's workers are up but wedged (see /livez and "
                f"{contract.INFLIGHT_JOBS}) or not fetching. See docs/operations.md.",
            },
        },
        {
            "alert": "WorkerFailureRateHigh",
            "expr": (
                f"sum by ({BY_POOL}, queue) "
                f"(rate({contract.JOBS_PROCESSED}{{{failed}}}[10m]))\n"
                f"> 0.2 * sum by ({BY_POOL}, queue) (rate({contract.JOBS_PROCESSED}{{{w()}}}[10m]))"
            ),
            "for": "15m",
            "labels": _labels(*here, severity="ticket"),
            "annotations": {
                "summary": f"{series.project}/{series.pool}: over 20% of queue "
                "{{ $labels.queue }}'s jobs fail",
                "description": "Retries, failures and dead letters over all job ends; check the "
                "job_end log lines with outcome != success.",
            },
        },
        {
            "alert": "WorkerTimeLimitExceeded",
            "expr": (
                f"sum by ({BY_POOL}, queue, actor) "
                f"(increase({contract.JOBS_TIME_LIMIT_EXCEEDED}{{{w()}}}[10m])) > 0"
            ),
            "labels": _labels(*here, severity="ticket"),
            "annotations": {
                "summary": f"{series.project}/{series.pool}: {{{{ $value }}}} jobs of actor "
                "{{ $labels.actor }} ran past their time limit",
                "description": "Interrupted, abandoned (a handler that swallowed the limit) or "
                "killed with their process (a C call holding the interpreter lock); the "
                "worker's 'ran past its time limit' log lines name the job ids. See "
                "docs/operations.md.",
            },
        },
        oom_rule(series),
        {
            "alert": "WorkerProcessOOMKilled",
            "expr": (f"sum by ({BY_POOL}, pod) (increase({contract.OOM_KILLS}{{{w()}}}[30m])) > 0"),
            "labels": _labels(*here, severity="ticket"),
            "annotations": {
                "summary": "{{ $labels.pod }}: the kernel's OOM killer killed a worker process",
                "description": "The container reached its memory limit and the kernel killed "
                "its biggest process, a worker process, which the supervisor replaced: the "
                "container was not restarted, so WorkerOOMKilled does not fire. Its jobs were "
                "recovered (a crash counts as an attempt). Raise memory or handler_memory in "
                "pools.toml, or lower concurrency; see docs/operations.md.",
            },
        },
        *pool_broker_rules(series),
    ]
    return rules


def pool_broker_rules(series: PoolSeries) -> list[Rule]:
    """The broker's faults as the pool sees them, which it survives but cannot undo: Redis
    lost its data (a reset), settlements that found their message gone, a full Redis (read
    from the backlog's copies: the scheduler's is there at zero pods)."""
    w = series.workers
    here = (series.project, series.namespace, series.pool)
    return [
        {
            "alert": "WorkerBrokerReset",
            "expr": f"sum by ({BY_POOL}) (increase({contract.BROKER_RESETS}{{{w()}}}[10m])) > 0",
            "labels": _labels(*here, severity="page"),
            "annotations": {
                "summary": f"{series.project}/{series.pool}: Redis lost its data (broker reset)",
                "description": "Queued messages are gone; held ones are counted in "
                f"{contract.JOBS_LOST}. See the broker_reset log line and docs/operations.md.",
            },
        },
        {
            "alert": "WorkerJobsLost",
            "expr": (
                f"sum by ({BY_POOL}, queue) (increase({contract.JOBS_LOST}{{{w()}}}[10m])) > 0"
            ),
            "labels": _labels(*here, severity="ticket"),
            "annotations": {
                "summary": f"{series.project}/{series.pool}: {{{{ $value }}}} settlements of "
                "queue {{ $labels.queue }} found their message gone",
                "description": "Lost with a broker reset, or taken by another worker; the job_end "
                "lines with outcome lost say which. See docs/operations.md.",
            },
        },
        {
            "alert": "WorkerBrokerFull",
            "expr": f"max by ({BY_POOL}) ({contract.BROKER_FULL}{{{series.backlog()}}}) == 1",
            "for": "2m",
            "labels": _labels(*here, severity="page"),
            "annotations": {
                "summary": f"{series.project}/{series.pool}: Redis is full and refuses writes",
                "description": "maxmemory reached under noeviction: producers get BrokerFull and "
                "pods are not ready. Free memory or raise maxmemory; see docs/operations.md.",
            },
        },
    ]


def schedule_rules(project: str, namespace: str) -> list[Rule]:
    """A schedule without its expected success; no scheduler that leads (none running
    counts: absence is the failure)."""
    job = f'namespace="{namespace}",job="{scrape_job(namespace, project)}"'
    return [
        {
            "alert": "ScheduleLate",
            "expr": (
                f"max by (namespace, schedule) ({contract.SCHEDULE_DUE}{{{job}}})\n"
                "> max by (namespace, schedule) "
                f"({contract.SCHEDULE_LAST_SUCCESS}{{{job}}})"
            ),
            "for": "5m",
            "labels": _labels(project, namespace, None, severity="ticket"),
            "annotations": {
                "summary": f"{project}: schedule {{{{ $labels.schedule }}}} has no "
                "successful run since its tick at {{ $value | humanizeTimestamp }}",
                "description": f'Check {contract.SCHEDULE_RUNS}{{outcome=~"missed|skipped_overlap"}}, the '
                f"job_end lines of its actor and `{project} schedules`. See docs/operations.md.",
            },
        },
        {
            "alert": "SchedulerNoLeader",
            "expr": f"absent({contract.SCHEDULER_LEADER}{{{job}}} == 1)",
            "for": "2m",
            "labels": _labels(project, namespace, None, severity="page"),
            "annotations": {
                "summary": f"{project}: no scheduler replica leads: no schedule fires, and "
                "no pool's backlog is seen at zero pods",
                "description": "Every scheduler replica is a follower, or none runs (or none is "
                "scraped). Check the scheduler Deployment, its logs (redis_error, step_down) "
                "and Redis. See docs/operations.md.",
            },
        },
    ]


def alert_groups(
    project: str,
    pools: Sequence[PoolSpec],
    *,
    database: bool,
    namespace: str,
    sandbox_namespace: str | None = None,
) -> list[Rule]:
    """The rule groups of a service (Prometheus rule-file and PrometheusRule ``groups``):
    one group per pool, then the service's schedules.

    Parameters:
      project: the service; names the groups, the scrape job and the pods.
      pools: from pools.toml (after a stack's overrides when infra renders them).
      database: include the database-pool alert (a pool holds ``db_pool_size`` connections).
      namespace: the service's namespace (its ordinary pools and the scheduler).
      sandbox_namespace: the sandbox pool's namespace (default ``<namespace>-sandbox``).
    """
    sandbox = sandbox_namespace or f"{namespace}-sandbox"
    groups: list[Rule] = []
    for pool in pools:
        series = pool_series(pool, project, namespace, sandbox)
        groups.append(
            {
                "name": f"{project}-pool-{pool.slug}",
                "rules": [
                    *pool_backlog_rules(pool, series, project),
                    *pool_worker_rules(series, database),
                ],
            }
        )
    groups.append({"name": f"{project}-schedules", "rules": schedule_rules(project, namespace)})
    return groups
