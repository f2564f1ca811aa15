"""Prometheus alert rules of a service, derived from its pools (pools.toml).

Pure functions, no Pulumi: :func:`alert_groups` is what :class:`~.service.WorkerService`
renders as a ``PrometheusRule`` and what the baked ``make alerts`` writes to
``ops/alerts.yaml``. A queue added to a pool gets its backlog-age alert at the pool's
``backlog_age_target_s`` without a hand edit. How to read each alert:
docs/operations.md of the template.

Conventions: one pool = one scrape job, so rules aggregate ``by (job)``; the backlog
series (``queue_*``) are exported by every replica of a pool with the same values, so they
are combined with ``max``, never summed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .args import PoolSpec

Rule = dict[str, Any]

#: How long a backlog may stay over its target before the alert fires.
BACKLOG_FOR = "10m"
#: Container name of every worker pod (see :mod:`.pool`).
WORKER_CONTAINER = "worker"
#: Metrics of kube-state-metrics the OOM alert reads (not exported by the service).
KUBE_STATE_METRICS = (
    "kube_pod_container_status_last_terminated_reason",
    "kube_pod_container_status_restarts_total",
)

_AGE_SUMMARY = "Queue {{ $labels.queue }}: next message waited {{ $value | humanizeDuration }}"


def backlog_age_rule(pool: PoolSpec, queue: str) -> Rule:
    """The age alert of one queue, at its pool's ``backlog_age_target_s``."""
    target = pool.backlog_age_target_s
    return {
        "alert": "WorkerBacklogAgeOverSLO",
        "expr": f'max by (queue) (queue_oldest_message_seconds{{queue="{queue}"}}) > {target}',
        "for": BACKLOG_FOR,
        "labels": {
            "severity": "page",
            "pool": pool.name,
            "queue": queue,
            "slo_seconds": str(target),
        },
        "annotations": {
            "summary": _AGE_SUMMARY,
            "description": (
                f"Over pool {pool.name}'s backlog_age_target_s ({target} s, pools.toml) for "
                f"{BACKLOG_FOR}: scaling is capped (max_replicas, downstream capacity) or the "
                "workers are not fetching. Compare worker_inflight_jobs with worker_concurrency."
            ),
        },
    }


def backlog_rules(project: str, pools: Sequence[PoolSpec]) -> list[Rule]:
    """Per queue of every pool: its age alert; then the delay-queue and dead-letter alerts."""
    rules = [backlog_age_rule(pool, queue) for pool in pools for queue in pool.queues]
    rules.append(
        {
            "alert": "WorkerDelayedMessagesOverdue",
            "expr": 'max by (queue) (queue_oldest_message_seconds{queue=~".+\\\\.DQ"}) > 300',
            "for": BACKLOG_FOR,
            "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "Delay queue {{ $labels.queue }}: due messages waited "
                "{{ $value | humanizeDuration }}",
                "description": "No worker is fetching this pool's delay queue. "
                "Are the workers of the pool running?",
            },
        }
    )
    rules.append(
        {
            "alert": "WorkerDeadLettersGrowing",
            "expr": "max by (queue) (delta(queue_dead_letters[15m])) > 0",
            "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "Queue {{ $labels.queue }}: {{ $value }} new dead letters in 15m",
                "description": "Messages that used up WORKER_MAX_ATTEMPTS (failures or crashes). "
                f"Inspect with `{project} dlq list`, fix, then `dlq replay`.",
            },
        }
    )
    return rules


def oom_rule(project: str, namespaces: Sequence[str]) -> Rule:
    """A worker container was OOM-killed and restarted within the last 30 minutes."""
    where = (
        f'namespace=~"{"|".join(namespaces)}", pod=~"{project}-.+", container="{WORKER_CONTAINER}"'
    )
    return {
        "alert": "WorkerOOMKilled",
        "expr": (
            "max by (namespace, pod, container) "
            f'(kube_pod_container_status_last_terminated_reason{{{where}, reason="OOMKilled"}}) '
            "== 1\nand on (namespace, pod, container) "
            f"increase(kube_pod_container_status_restarts_total{{{where}}}[30m]) > 0"
        ),
        "labels": {"severity": "ticket"},
        "annotations": {
            "summary": "{{ $labels.pod }}: the worker container was OOM-killed and restarted",
            "description": "Peak memory exceeded the pool's memory limit: its messages were "
            "recovered (a crash counts as an attempt). Raise memory or handler_memory in "
            "pools.toml, or lower concurrency; see docs/operations.md.",
        },
    }


def worker_rules(database: bool) -> list[Rule]:
    """Fetch bottleneck, DB pool saturation (``database``), no progress, failure rate."""
    rules: list[Rule] = [
        {
            "alert": "WorkerFetchBottleneck",
            "expr": (
                "sum by (job) (worker_inflight_jobs) < 0.8 * sum by (job) (worker_concurrency)\n"
                'and on (job) max by (job) (queue_depth{queue!~".+\\\\.DQ"}) > 0\n'
                'and on (job) max by (job) (deriv(queue_depth{queue!~".+\\\\.DQ"}[10m])) > 0'
            ),
            "for": "10m",
            "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "{{ $labels.job }}: handlers idle while the backlog grows",
                "description": "worker_inflight_jobs stays below worker_concurrency with a "
                "growing queue_depth: a fetch bottleneck (Redis latency, prefetch, a consumer "
                "thread that died). See docs/operations.md.",
            },
        }
    ]
    if database:
        rules.append(
            {
                "alert": "WorkerDbPoolSaturated",
                "expr": (
                    "sum by (job, instance) (db_pool_in_use) "
                    ">= sum by (job, instance) (db_pool_size)\n"
                    "and on (job, instance) sum by (job, instance) (db_pool_size) > 0"
                ),
                "for": "5m",
                "labels": {"severity": "ticket"},
                "annotations": {
                    "summary": "{{ $labels.instance }}: every database connection is in use",
                    "description": "db_pool_in_use at db_pool_size: handlers wait for "
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
                "(sum by (job) (rate(jobs_processed_total[10m])) "
                "or max by (job) (worker_concurrency) * 0) == 0\n"
                'and on (job) max by (job) (queue_depth{queue!~".+\\\\.DQ"}) > 0'
            ),
            "for": "10m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "{{ $labels.job }}: a backlog and no job finished in 10m",
                "description": "Handlers are wedged (see /livez and worker_inflight_jobs) or no "
                "worker fetches. See docs/operations.md.",
            },
        },
        {
            "alert": "WorkerFailureRateHigh",
            "expr": (
                "sum by (job, queue) "
                '(rate(jobs_processed_total{outcome=~"retry|failure|dead_letter"}[10m]))\n'
                "> 0.2 * sum by (job, queue) (rate(jobs_processed_total[10m]))"
            ),
            "for": "15m",
            "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "{{ $labels.queue }}: over 20% of jobs fail",
                "description": "Retries, failures and dead letters over all job ends; check the "
                "job_end log lines with outcome != success.",
            },
        },
    ]
    return rules


def schedule_rules(project: str) -> list[Rule]:
    """A schedule without its expected success; schedulers without a leader."""
    return [
        {
            "alert": "ScheduleLate",
            "expr": (
                "max by (schedule) (schedule_due_timestamp_seconds)\n"
                "> max by (schedule) (schedule_last_success_timestamp_seconds)"
            ),
            "for": "5m",
            "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "Schedule {{ $labels.schedule }}: no successful run since its tick at "
                "{{ $value | humanizeTimestamp }}",
                "description": 'Check schedule_runs_total{outcome=~"missed|skipped_overlap"}, the '
                f"job_end lines of its actor and `{project} schedules`. See docs/operations.md.",
            },
        },
        {
            "alert": "SchedulerNoLeader",
            "expr": "max(scheduler_leader) == 0",
            "for": "2m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "No scheduler replica leads: no schedule fires",
                "description": "Every scheduler replica is a follower. Check their logs "
                "(redis_error, step_down) and Redis. See docs/operations.md.",
            },
        },
    ]


def alert_groups(
    project: str,
    pools: Sequence[PoolSpec],
    *,
    database: bool,
    namespaces: Sequence[str],
) -> list[Rule]:
    """The rule groups of a service (Prometheus rule-file and PrometheusRule ``groups``).

    Parameters:
      project: the service; names the groups and the pods (``<project>-<pool>``).
      pools: from pools.toml (after a stack's overrides when infra renders them).
      database: include the database-pool alert (a pool holds ``db_pool_size`` connections).
      namespaces: where the pods run (the sandbox namespace included), for the OOM alert.
    """
    return [
        {"name": f"{project}-backlog", "rules": backlog_rules(project, pools)},
        {
            "name": f"{project}-workers",
            "rules": [*worker_rules(database), oom_rule(project, namespaces)],
        },
        {"name": f"{project}-schedules", "rules": schedule_rules(project)},
    ]
