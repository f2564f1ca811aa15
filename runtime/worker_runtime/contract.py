"""Names and numbers shared with worker_infra (standard library only, imports nothing of the
package): what the service exports and how its pods run, stated once for both sides.

worker_infra imports them (the alert rules, the PodMonitor's relabelling, the pod spec, the
guards); the runtime's own modules use them where they define or apply the same thing, and
``tests/test_contract.py`` checks that the runtime exports each metric named here.
"""

from __future__ import annotations

from typing import Final, Literal

# -- metrics (DESIGN 2.3, 6, 7): the names Prometheus stores (counters with ``_total``) ----
JOBS_PROCESSED: Final = "jobs_processed_total"
JOB_DURATION: Final = "job_duration_seconds"
INFLIGHT_JOBS: Final = "worker_inflight_jobs"
CONCURRENCY: Final = "worker_concurrency"
DB_POOL_IN_USE: Final = "db_pool_in_use"
DB_POOL_SIZE: Final = "db_pool_size"
QUEUE_DEPTH: Final = "queue_depth"
QUEUE_OLDEST_MESSAGE: Final = "queue_oldest_message_seconds"
QUEUE_DEAD_LETTERS: Final = "queue_dead_letters"
QUEUE_CONSUMERS: Final = "queue_consumers"
QUEUE_UNSERVED: Final = "queue_unserved"
BROKER_RESETS: Final = "broker_resets_total"
JOBS_LOST: Final = "jobs_lost_total"
JOBS_THROTTLED: Final = "jobs_throttled_total"
ADMISSION_WAIT: Final = "job_admission_wait_seconds"
JOBS_TIME_LIMIT_EXCEEDED: Final = "jobs_time_limit_exceeded_total"
OOM_KILLS: Final = "worker_oom_kills_total"
BROKER_FULL: Final = "broker_full"
SCHEDULE_RUNS: Final = "schedule_runs_total"
SCHEDULE_LAST_SUCCESS: Final = "schedule_last_success_timestamp_seconds"
SCHEDULE_DUE: Final = "schedule_due_timestamp_seconds"
SCHEDULER_LEADER: Final = "scheduler_leader"
#: Every metric of the contract, as stored.
METRICS: Final = (
    JOBS_PROCESSED,
    JOB_DURATION,
    INFLIGHT_JOBS,
    CONCURRENCY,
    DB_POOL_IN_USE,
    DB_POOL_SIZE,
    QUEUE_DEPTH,
    QUEUE_OLDEST_MESSAGE,
    QUEUE_DEAD_LETTERS,
    QUEUE_CONSUMERS,
    QUEUE_UNSERVED,
    BROKER_RESETS,
    JOBS_LOST,
    JOBS_THROTTLED,
    JOBS_TIME_LIMIT_EXCEEDED,
    OOM_KILLS,
    BROKER_FULL,
    SCHEDULE_RUNS,
    SCHEDULE_LAST_SUCCESS,
    SCHEDULE_DUE,
    SCHEDULER_LEADER,
)
#: The label that carries a series' pool: the exporter's ``pool`` label of a worker pod
#: becomes this one (worker_infra's PodMonitor), so it never clashes with a target label.
POOL_SERIES_LABEL: Final = "worker_template_pool"

#: How a delivery ended, the ``outcome`` label of ``jobs_processed_total`` (the settlement's
#: comments say what each means).
SUCCESS: Final = "success"
FAILURE: Final = "failure"
RETRY: Final = "retry"
DEAD_LETTER: Final = "dead_letter"
REQUEUED: Final = "requeued"
SKIPPED: Final = "skipped"
CANCELLED: Final = "cancelled"
OUTCOMES: Final = (SUCCESS, FAILURE, RETRY, DEAD_LETTER, REQUEUED, SKIPPED, CANCELLED)

#: Why a fetch left messages queued, the ``reason`` label of ``jobs_throttled_total``: a
#: downstream resource's budget or rate (worker_infra's WorkerThrottledByDownstream), or a
#: fairness key's limit in flight (the service's own choice: no alert).
THROTTLE_BUDGET: Final = "budget"
THROTTLE_RATE: Final = "rate"
THROTTLE_KEY: Final = "key"

# -- what one worker process holds of a downstream resource (pools.toml ``per_process``) --
#: Its database connections (``DB_POOL_SIZE``).
PER_PROCESS_DB_POOL: Final = "db_pool_size"
#: Its handler threads (``WORKER_CONCURRENCY``: calls in flight to a partner).
PER_PROCESS_CONCURRENCY: Final = "concurrency"
PerProcess = Literal["db_pool_size", "concurrency"]

# -- how a pod runs ----------------------------------------------------------------------
#: Port of /metrics, /livez and /readyz when ``METRICS_PORT`` is unset.
METRICS_PORT: Final = 9191
#: UID and GID of the image's user (the Dockerfile) and of the pod's ``runAsUser``.
RUN_AS_USER: Final = 10001
MiB: Final = 2**20
#: Bytes a worker process holds besides its handlers (the memory guard's base per process).
MEMORY_BASE_PER_PROCESS: Final = 96 * MiB

# -- the scheduler's leader lease (``SCHEDULER_LEADER_TTL_MS``) ----------------------------
SCHEDULER_LEADER_TTL_MS: Final = 10_000
SCHEDULER_LEADER_TTL_MIN_MS: Final = 1_000
SCHEDULER_LEADER_TTL_MAX_MS: Final = 600_000

# -- liveness ------------------------------------------------------------------------------
#: ``HEALTH_STALLED_AFTER_S`` when unset: a handler loop without progress for this long is
#: not live.
STALLED_AFTER_S: Final = 60.0
#: What a pod's liveness threshold adds to its job timeout: a handler that checkpoints
#: nothing is still inside its time limit until then.
LIVENESS_MARGIN_S: Final = 30


def liveness_threshold_s(job_timeout_ms: int) -> int:
    """Seconds without progress after which a pool's pod is not live: its job timeout
    (rounded up) and :data:`LIVENESS_MARGIN_S`."""
    return -(-job_timeout_ms // 1000) + LIVENESS_MARGIN_S
