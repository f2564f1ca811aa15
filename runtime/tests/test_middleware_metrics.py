"""Metrics on Dramatiq's StubBroker: each outcome counted once its settlement is stored,
published by one thread; handler threads take no lock.

The broker settles deliveries as the worker's does (:class:`stub_brokers.SettlingStubBroker`),
so CrashAwareRetries and GracefulShutdown decide each outcome as they do in production.
"""

from __future__ import annotations

import logging

import dramatiq
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.middleware import AgeLimit
from prometheus_client import REGISTRY, Histogram

from worker_runtime.lifecycle import Requeue
from worker_runtime.middleware import Attempts, CrashAwareRetries, GracefulShutdown, Metrics
from worker_runtime.middleware.metrics import DURATION_BUCKETS, observe_all
from worker_runtime.settlement import ADMISSION_SIGNAL

from stub_brokers import SettlingStubBroker, work_off

MAX_ATTEMPTS = 3


def processed(queue: str, actor: str, outcome: str) -> float:
    """``jobs_processed_total{queue,actor,outcome}`` now (0 when never counted)."""
    labels = {"queue": queue, "actor": actor, "outcome": outcome}
    return REGISTRY.get_sample_value("jobs_processed_total", labels) or 0.0


def durations(queue: str, actor: str) -> float:
    """How many runs ``job_duration_seconds{queue,actor}`` observed."""
    labels = {"queue": queue, "actor": actor}
    return REGISTRY.get_sample_value("job_duration_seconds_count", labels) or 0.0


def gauge(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def stack(concurrency: int = 2) -> tuple[Metrics, SettlingStubBroker]:
    """The production order of the middleware that decide an outcome (``broker.py``)."""
    metrics = Metrics(concurrency, database=False)
    broker = SettlingStubBroker(
        middleware=[
            Attempts(MAX_ATTEMPTS),
            metrics,
            GracefulShutdown(),
            AgeLimit(),
            CrashAwareRetries(max_retries=MAX_ATTEMPTS - 1),
        ]
    )
    return metrics, broker


def test_each_outcome_is_counted_once_with_its_duration_and_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics, broker = stack()
    queue = "metrics_outcomes"
    inflight_seen: list[float] = []

    @dramatiq.actor(broker=broker, queue_name=queue)
    def succeeds() -> None:
        metrics.publish()
        inflight_seen.append(gauge("worker_inflight_jobs"))

    @dramatiq.actor(broker=broker, queue_name=queue)
    def fails() -> None:
        raise ValueError("boom")

    @dramatiq.actor(broker=broker, queue_name=queue, throws=(KeyError,))
    def aborts() -> None:
        raise KeyError("expected")

    @dramatiq.actor(broker=broker, queue_name=queue)
    def stops() -> None:
        raise Requeue("shutdown")

    @dramatiq.actor(broker=broker, queue_name=queue)
    def refused() -> None:
        raise AssertionError("a message over its attempts never runs")

    @dramatiq.actor(broker=broker, queue_name=queue)
    def expired() -> None:
        raise AssertionError("a message past its age limit never runs")

    succeeds.send()
    fails.send()  # retries left: a retry copy
    fails.send_with_options(retries=MAX_ATTEMPTS - 1)  # the last attempt: a dead letter
    aborts.send()
    stops.send()
    refused.send_with_options(retries=1, crashes=MAX_ATTEMPTS - 1)
    old = expired.message_with_options(max_age=60_000)
    broker.enqueue(old.copy(message_timestamp=old.message_timestamp - 3_600_000))
    expected = {
        ("succeeds", "success"): 1,
        ("fails", "retry"): 1,
        ("fails", "dead_letter"): 1,
        ("aborts", "failure"): 1,
        ("stops", "requeued"): 1,
        ("refused", "dead_letter"): 1,
        ("expired", "dead_letter"): 1,
    }
    outcomes = ("success", "failure", "retry", "dead_letter", "requeued", "skipped")
    actors = ("succeeds", "fails", "aborts", "stops", "refused", "expired")
    before = {(a, o): processed(queue, a, o) for a in actors for o in outcomes}
    runs_before = {actor: durations(queue, actor) for actor in actors}

    with caplog.at_level(logging.INFO):
        work_off(broker, queue)  # the worker's shutdown publishes what is left

    counted = {
        key: processed(queue, *key) - value
        for key, value in before.items()
        if processed(queue, *key) != value
    }
    assert counted == expected
    runs = {actor: durations(queue, actor) - runs_before[actor] for actor in actors}
    assert runs == {
        "succeeds": 1,
        "fails": 2,
        "aborts": 1,
        "stops": 1,
        "refused": 0,
        "expired": 0,
    }, "every run of a handler is timed; a refused message never ran"
    assert inflight_seen == [1.0], "one handler in flight while it ran"
    assert gauge("worker_inflight_jobs") == 0
    assert gauge("worker_concurrency") == 2
    lines = sorted(
        (record.actor, record.outcome)  # type: ignore[attr-defined]
        for record in caplog.records
        if getattr(record, "event", None) == "job_end"
    )
    assert lines == sorted(expected), "one job_end line per delivery, with its outcome"
    assert [s.kind for s in broker.settlements()].count("dead_letter") == 4


def test_an_outcome_is_counted_only_once_redis_holds_it() -> None:
    metrics, broker = stack()
    queue = "metrics_settled"

    @dramatiq.actor(broker=broker, queue_name=queue)
    def job() -> None: ...

    message = MessageProxy(job.message())
    before = processed(queue, "job", "success")
    metrics.before_process_message(broker, message)
    metrics.after_process_message(broker, message)
    metrics.publish()
    assert processed(queue, "job", "success") == before, (
        "not counted before the ack: while Redis is down the settlement is retried"
    )
    metrics.after_ack(broker, message)
    metrics.publish()
    assert processed(queue, "job", "success") == before + 1
    metrics.after_ack(broker, message)  # Dramatiq retried a settlement that had succeeded
    metrics.after_nack(broker, message)
    metrics.publish()
    assert processed(queue, "job", "success") == before + 1, "counted once"


def test_a_delayed_message_moved_to_its_queue_is_not_a_job() -> None:
    metrics, broker = stack()

    @dramatiq.actor(broker=broker, queue_name="metrics_moved")
    def job() -> None: ...

    before = processed("metrics_moved", "job", "success")
    metrics.after_ack(broker, MessageProxy(job.message()))  # acked without a handler run
    metrics.publish()
    assert processed("metrics_moved", "job", "success") == before


def test_admission_waits_are_recorded_by_the_signal_and_published_per_queue() -> None:
    metrics, broker = stack()

    def waits(queue: str) -> tuple[float, float]:
        labels = {"queue": queue}
        count = REGISTRY.get_sample_value("job_admission_wait_seconds_count", labels) or 0.0
        total = REGISTRY.get_sample_value("job_admission_wait_seconds_sum", labels) or 0.0
        return count, total

    before = waits("metrics_gated")
    broker.emit_after(ADMISSION_SIGNAL, "metrics_gated", 1.5)
    broker.emit_after(ADMISSION_SIGNAL, "metrics_gated", 0.25)
    assert waits("metrics_gated") == before, "recorded by the handler's thread, not written"
    metrics.publish()
    count, total = waits("metrics_gated")
    assert count == before[0] + 2 and total == pytest.approx(before[1] + 1.75)
    le = {"queue": "metrics_gated", "le": "0.25"}
    assert (REGISTRY.get_sample_value("job_admission_wait_seconds_bucket", le) or 0) >= 1


def test_observe_all_writes_what_observe_writes_one_by_one() -> None:
    amounts = [0.0, 0.0049, 0.005, 0.0051, 0.3, 7.0, 3600.0, 3600.5, 1e9, 0.005, 0.01]
    one_by_one = Histogram("one_by_one", "h", buckets=DURATION_BUCKETS, registry=None)
    at_once = Histogram("at_once", "h", buckets=DURATION_BUCKETS, registry=None)
    for amount in amounts:
        one_by_one.observe(amount)
    observe_all(at_once, amounts)

    def samples(histogram: Histogram, name: str) -> dict[tuple[str, str], float]:
        (metric,) = histogram.collect()
        return {
            (sample.name.replace(name, ""), sample.labels.get("le", "")): sample.value
            for sample in metric.samples
            if not sample.name.endswith("_created")
        }

    expected, got = samples(one_by_one, "one_by_one"), samples(at_once, "at_once")
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
