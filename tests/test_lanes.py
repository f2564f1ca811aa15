"""A queue's lanes (issue #42 items 4 and 2) with real worker processes and redis-server.

* One worker thread takes the highest lane first, and a waiting job is passed over by
  exactly ``WORKER_PRIORITY_BOUND`` jobs of higher lanes, no more (the start order is the
  fetch order: one process, one thread, prefetch 1, every job queued before it starts).
* A worker SIGKILLed while it runs a high and a low job: the recovery of its messages (by
  another worker, the queue paused so nothing takes them again) puts each back on its own
  lane, not on Dramatiq's list.
* An unknown priority is refused at the send, one line, nothing stored.
* Fairness: key A with 2,000 queued and running, key B's 10 sent after start within a
  bounded count of A's jobs (B's count plus two per worker slot), not after A's backlog.
* A per-key limit (``fair_key_limit=1``): no key ever has two jobs in flight while other
  keys' jobs run beside it, and the passed-over fetches are counted
  (``jobs_throttled_total{reason="key"}``).
* A bad key option (a ``fair_key`` the model lacks, a ``fair_key_rate`` that does not
  parse, a rate without a key) stops the worker at boot: exit 78, one line naming the actor.

The messages are sent by the runtime's own broker (``SettlingRedisBroker``: what a service's
``producer.enqueue`` uses), with the message option ``priority``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis
from _lifecycle import Worker, bake_with_actors, wait_for, workers_of
from bakery import project_env, run_cli
from worker_runtime import layout
from worker_runtime.redisbroker import SettlingRedisBroker
from worker_runtime.typed import JobArguments
from worker_runtime.typed import actor as typed_actor

pytestmark = pytest.mark.slow

Q = "notifications"

LANE_ACTORS = '''\
"""Each start appends the job's id to one list: the order the worker took them in."""

from __future__ import annotations

import os
import time

import dramatiq
import redis

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


@dramatiq.actor(queue_name="notifications", max_retries=4)
def lane_job(job_id: str, seconds: float) -> None:
    _client.rpush("test:order", job_id)
    time.sleep(0.0 if _client.get("test:short") else seconds)
'''

FAIR_ACTORS = '''\
"""Keyed jobs: each start appends the job's id to one list; the limited one counts its
key's jobs in flight and keeps each key's peak."""

from __future__ import annotations

import os
import time

import redis
from worker_runtime.typed import JobArguments, actor

_client = redis.Redis.from_url(os.environ["REDIS_URL"])
_ENTER = _client.register_script("""
local now = redis.call('hincrby', KEYS[1], ARGV[1], 1)
if now > tonumber(redis.call('hget', KEYS[2], ARGV[1]) or '0') then
  redis.call('hset', KEYS[2], ARGV[1], now)
end
return now
""")


class TenantJob(JobArguments):
    tenant_id: str
    job_id: str
    seconds: float = 0.0


@actor(queue_name="notifications", max_retries=4, fair_key="tenant_id")
def tenant_job(job: TenantJob) -> None:
    _client.rpush("test:order", job.job_id)
    time.sleep(job.seconds)


@actor(queue_name="payments", max_retries=4, fair_key="tenant_id", fair_key_rate="20/s",
       fair_key_burst=2)
def rated_job(job: TenantJob) -> None:
    _client.rpush(f"test:rated:{job.tenant_id}", f"{job.job_id} {time.time()}")


@actor(queue_name="reports", max_retries=4, fair_key="tenant_id", fair_key_limit=1)
def limited_job(job: TenantJob) -> None:
    _ENTER(keys=["test:inflight", "test:peak"], args=[job.tenant_id])
    _client.rpush("test:order", job.job_id)
    try:
        time.sleep(job.seconds)
    finally:
        _client.hincrby("test:inflight", job.tenant_id, -1)
'''


@pytest.fixture(scope="session")
def lanes_project(
    bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return bake_with_actors(bake, tmp_path_factory, "lanes", lanes_test=LANE_ACTORS)


@pytest.fixture(scope="session")
def fair_project(
    bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return bake_with_actors(bake, tmp_path_factory, "fair", fair_test=FAIR_ACTORS)


@pytest.fixture
def fair_workers(
    fair_project: Path, redis_url: str, tmp_path: Path
) -> Iterator[Callable[..., Worker]]:
    yield from workers_of(fair_project, redis_url, tmp_path)


@pytest.fixture
def workers(
    lanes_project: Path, redis_url: str, tmp_path: Path
) -> Iterator[Callable[..., Worker]]:
    yield from workers_of(lanes_project, redis_url, tmp_path)


class TenantJob(JobArguments):
    tenant_id: str
    job_id: str
    seconds: float = 0.0


@pytest.fixture
def broker(redis_url: str) -> Iterator[SettlingRedisBroker]:
    """The runtime's broker as a service's producer uses it, with the bake's actors' names,
    queues and options (the messages it sends are the producer's)."""
    found = SettlingRedisBroker(url=redis_url, middleware=[])
    yield found
    found.close()


@pytest.fixture
def producer(broker: SettlingRedisBroker) -> Callable[..., str]:
    """``send(job_id, priority, seconds)``: enqueue ``lane_job``; returns its redis id."""

    @dramatiq.actor(broker=broker, queue_name=Q, actor_name="lane_job")
    def lane_job(job_id: str, seconds: float) -> None: ...

    def send(job_id: str, priority: str | None = None, seconds: float = 0.0) -> str:
        options: dict[str, Any] = {} if priority is None else {"priority": priority}
        message = lane_job.send_with_options(args=(job_id, seconds), **options)
        return str(message.options[layout.REDIS_MESSAGE_ID])

    return send


@pytest.fixture
def tenants(broker: SettlingRedisBroker) -> Callable[..., None]:
    """``send(actor_name, tenant, job_id, seconds)``: enqueue a keyed job."""

    @typed_actor(
        broker=broker, queue_name=Q, actor_name="tenant_job", fair_key="tenant_id"
    )
    def tenant_job(job: TenantJob) -> None: ...

    @typed_actor(
        broker=broker,
        queue_name="reports",
        actor_name="limited_job",
        fair_key="tenant_id",
        fair_key_limit=1,
    )
    def limited_job(job: TenantJob) -> None: ...

    @typed_actor(
        broker=broker,
        queue_name="payments",
        actor_name="rated_job",
        fair_key="tenant_id",
        fair_key_rate="20/s",
        fair_key_burst=2,
    )
    def rated_job(job: TenantJob) -> None: ...

    declared = {"tenant_job": tenant_job, "limited_job": limited_job, "rated_job": rated_job}

    def send(actor_name: str, tenant: str, job_id: str, seconds: float = 0.0) -> None:
        declared[actor_name].send(tenant_id=tenant, job_id=job_id, seconds=seconds)

    return send


ONE_THREAD = {"WORKER_CONCURRENCY": "1", "WORKER_PREFETCH": "1"}


def order(client: redis.Redis) -> list[str]:
    return [raw.decode() for raw in client.lrange("test:order", 0, -1)]


def test_the_highest_lane_runs_first(
    client: redis.Redis, producer: Callable[..., str], workers: Callable[..., Worker]
) -> None:
    for i in range(3):
        for priority in ("low", None, "high"):
            producer(f"{priority or 'normal'}{i}", priority)
    workers(WORKER_PRIORITY_BOUND="100", **ONE_THREAD)
    wait_for(lambda: len(order(client)) == 9, 30, "every job to start")
    assert [job[0] for job in order(client)] == list("hhhnnnlll")


def test_a_low_job_waits_for_exactly_bound_higher_ones(
    client: redis.Redis, producer: Callable[..., str], workers: Callable[..., Worker]
) -> None:
    for i in range(2):
        producer(f"L{i}", "low")
    for i in range(9):
        producer(f"H{i}", "high")
    workers(WORKER_PRIORITY_BOUND="3", **ONE_THREAD)
    wait_for(lambda: len(order(client)) == 11, 30, "every job to start")
    assert "".join(job[0] for job in order(client)) == "HHHLHHHLHHH"


def test_recovery_puts_a_killed_workers_messages_back_on_their_lanes(
    lanes_project: Path,
    redis_url: str,
    client: redis.Redis,
    producer: Callable[..., str],
    workers: Callable[..., Worker],
) -> None:
    env = {
        "WORKER_CONCURRENCY": "2",
        "WORKER_PREFETCH": "2",
        "WORKER_HEARTBEAT_TIMEOUT_MS": "3000",
    }
    first = workers(**env)
    high, low = producer("high", "high", 60), producer("low", "low", 60)
    wait_for(lambda: len(order(client)) == 2, 30, "both jobs to start")
    pause = run_cli(
        lanes_project, "pause", Q, env=project_env(lanes_project, REDIS_URL=redis_url)
    )
    assert pause.returncode == 0, pause.stderr
    first.signal(signal.SIGKILL, group=True)
    first.wait(timeout=10)
    workers(**env)  # recovers the killed worker's messages, fetches nothing (paused)

    def lanes() -> dict[str, list[str]]:
        return {
            p: [i.decode() for i in client.lrange(layout.lane_key(Q, p), 0, -1)]
            for p in layout.PRIORITIES
        }

    wait_for(lambda: sum(map(len, lanes().values())) == 2, 30, "the recovery of both")
    assert lanes() == {"high": [high], "normal": [], "low": [low]}
    client.set("test:short", 1)
    resume = run_cli(
        lanes_project, "resume", Q, env=project_env(lanes_project, REDIS_URL=redis_url)
    )
    assert resume.returncode == 0, resume.stderr
    wait_for(lambda: len(order(client)) == 4, 30, "both to run again")


def test_an_unknown_priority_is_refused_at_the_send(
    client: redis.Redis, producer: Callable[..., str]
) -> None:
    with pytest.raises(layout.PriorityError) as refused:
        producer("x", "urgent")
    assert "\n" not in str(refused.value) and "'urgent'" in str(refused.value)
    assert not client.keys("dramatiq:notifications*")


def test_a_key_with_a_big_backlog_delays_another_key_by_a_few_jobs_not_its_backlog(
    client: redis.Redis,
    tenants: Callable[..., None],
    fair_workers: Callable[..., Worker],
) -> None:
    backlog_a, sent_b = 2000, 10
    for i in range(backlog_a):
        tenants("tenant_job", "A", f"A{i}", 0.005)
    slots = 4
    fair_workers(WORKER_CONCURRENCY=str(slots), WORKER_PREFETCH=str(slots))
    wait_for(lambda: len(order(client)) >= 100, 60, "A's first jobs to run")
    started = len(order(client))
    for i in range(sent_b):
        tenants("tenant_job", "B", f"B{i}")
    wait_for(lambda: sum(j[0] == "B" for j in order(client)) == sent_b, 60, "B's jobs")
    after = order(client)[started:]
    last_b = max(i for i, job in enumerate(after) if job[0] == "B")
    a_before_last_b = sum(job[0] == "A" for job in after[:last_b])
    # Taken in turns: one A job per B job, plus what each slot held or had in hand.
    print(f"A jobs started between B's send and B's last start: {a_before_last_b}")
    assert a_before_last_b <= sent_b + 2 * slots, (a_before_last_b, after[: last_b + 1])
    assert len(order(client)) < backlog_a, "B ran long before A's backlog"


def test_a_key_never_has_more_in_flight_than_its_limit(
    client: redis.Redis,
    tenants: Callable[..., None],
    fair_workers: Callable[..., Worker],
) -> None:
    jobs = {"A": 8, "B": 4, "C": 4}
    for tenant, count in jobs.items():
        for i in range(count):
            tenants("limited_job", tenant, f"{tenant}{i}", 0.2)
    worker = fair_workers(
        WORKER_POOL="bulk",
        WORKER_PROCESSES="1",
        WORKER_CONCURRENCY="4",
        WORKER_PREFETCH="4",
    )
    wait_for(lambda: len(order(client)) == sum(jobs.values()), 60, "every job to start")
    wait_for(
        lambda: not any(int(v) for v in client.hvals("test:inflight")), 10, "the ends"
    )
    peaks = {k.decode(): int(v) for k, v in client.hgetall("test:peak").items()}
    assert peaks == dict.fromkeys(jobs, 1), "one in flight per key, never two"
    assert len(set(order(client))) == sum(jobs.values()), "each started once"
    text = worker.metrics()
    throttled = [
        line
        for line in text.splitlines()
        if line.startswith("jobs_throttled_total{") and 'reason="key"' in line
    ]
    assert throttled and float(throttled[0].rsplit(" ", 1)[1]) > 0, text


def test_a_keys_starts_keep_its_rate_while_other_keys_run_beside_it(
    client: redis.Redis,
    tenants: Callable[..., None],
    fair_workers: Callable[..., Worker],
) -> None:
    """``fair_key_rate="20/s"``, ``fair_key_burst=2``: A's 40 starts never come faster than
    the rate (in every window, at most the burst plus the rate's worth), and not slower
    than 10% under it; B's 10, sent after, are not held by A's rate: each waits only for
    B's own; no attempt is spent waiting (each job starts once)."""
    rate, burst = 20, 2
    for i in range(40):
        tenants("rated_job", "A", f"A{i}")
    worker = fair_workers(
        WORKER_POOL="critical", WORKER_PROCESSES="1", WORKER_CONCURRENCY="4"
    )

    def stamps(tenant: str) -> list[tuple[str, float]]:
        raw = client.lrange(f"test:rated:{tenant}", 0, -1)
        return [(job, float(at)) for job, at in (item.decode().split() for item in raw)]

    wait_for(lambda: len(stamps("A")) >= 10, 30, "A's first starts")
    sent_b = time.time()
    for i in range(10):
        tenants("rated_job", "B", f"B{i}")
    wait_for(lambda: len(stamps("A")) == 40 and len(stamps("B")) == 10, 60, "every start")
    for tenant, count in (("A", 40), ("B", 10)):
        found = stamps(tenant)
        assert sorted(job for job, _ in found) == sorted(f"{tenant}{i}" for i in range(count))
        times = sorted(at for _, at in found)
        slack = 0.05  # the stamp is taken in the handler, after the admission
        for first in range(len(times)):
            for last in range(first + burst, len(times)):
                allowed = (last - first + 1 - burst) / rate
                assert times[last] - times[first] >= allowed - slack, (tenant, first, last)
    a_times = sorted(at for _, at in stamps("A"))
    measured = (len(a_times) - burst) / (a_times[-1] - a_times[0])
    print(f"key A: {measured:.2f} starts/s for a rate of {rate}/s")
    assert rate * 0.9 <= measured <= rate * 1.05, measured
    b_first = min(at for _, at in stamps("B"))
    assert b_first - sent_b < 0.5, "B's first start waits for no A job's rate"
    assert max(at for _, at in stamps("B")) < a_times[-1], "B ran beside A, not after it"
    text = worker.metrics()
    throttled = [
        line
        for line in text.splitlines()
        if line.startswith("jobs_throttled_total{") and 'reason="key"' in line
        and 'queue="payments"' in line
    ]
    assert throttled and float(throttled[0].rsplit(" ", 1)[1]) > 0, text
    # Each admission on this queue is timed from when the job was due: A's 40 waited for
    # their turn under the rate, B's 10 for theirs (a job's whole wait, its backlog included).
    def admission_waits() -> dict[str, float]:
        return {
            line.split(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in worker.metrics().splitlines()
            if line.startswith("job_admission_wait_seconds_")
        }

    counted = 'job_admission_wait_seconds_count{queue="payments"}'
    waits = wait_for(  # published with the durations, every 0.5 s
        lambda: w if (w := admission_waits()).get(counted) == 50 else None, 10, "50 admissions"
    )
    total = waits.get('job_admission_wait_seconds_sum{queue="payments"}')
    assert total is not None, waits
    # A's i-th start is about (i - burst) / rate after the first: their waits alone sum to
    # about 36 s; far above what 50 unthrottled fetches wait.
    assert total > 20, waits
    assert not any('queue="notifications"' in name for name in waits), "no flow control there"


BAD_KEY_ACTORS = """\
from worker_runtime.typed import JobArguments, actor


class Report(JobArguments):
    tenant_id: str


@actor(queue_name="reports", {options})
def bad_key(job: Report) -> None: ...
"""


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ('fair_key="tenant"', "fair_key 'tenant' is not a field of its arguments (tenant_id)"),
        ('fair_key="tenant_id", fair_key_rate="fast"', "fair_key_rate 'fast' is not a rate"),
        ('fair_key_rate="5/s"', "fair_key_rate without fair_key"),
    ],
    ids=["field", "rate", "unkeyed"],
)
def test_a_bad_fair_key_option_refuses_to_boot_in_one_line(
    bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory, redis_url: str,
    options: str, said: str,
) -> None:
    actors = BAD_KEY_ACTORS.format(options=options)
    project = bake_with_actors(bake, tmp_path_factory, "badkey", bad_key=actors)
    refused = run_cli(
        project,
        "worker",
        env=project_env(project, REDIS_URL=redis_url, WORKER_POOL="bulk"),
    )
    assert refused.returncode == 78, refused.stdout
    # The supervisor's JSON log lines aside, one line says it (and boot_failed's reason).
    (line,) = [line for line in refused.stderr.splitlines() if not line.startswith("{")]
    assert line.startswith("config error: actor module"), line
    assert f"actor 'bad_key': {said}" in line, line
