"""Traces of a baked service: one job followed from the API that enqueued it through every delivery.

Everything runs as real processes against a real redis-server. Spans travel the
real exporter path: each process exports OTLP/HTTP (protobuf) to a receiver this
test starts on the loopback, which decodes them with the ``opentelemetry-proto``
package. The API side is a script with only ``REDIS_URL`` and ``OTEL_*`` set.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
from _lifecycle import Worker, wait_for
from bakery import PYTHON, package_of, project_env
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

pytestmark = pytest.mark.slow

TRACE_ACTORS = '''\
"""Actors of the tracing tests."""

from __future__ import annotations

import logging
import os
import sys
import time

import dramatiq
import redis

from ..lifecycle import checkpoint

_client = redis.Redis.from_url(os.environ["REDIS_URL"])
logger = logging.getLogger(__name__)


@dramatiq.actor(queue_name="notifications", max_retries=3, min_backoff=100, max_backoff=200)
def trace_flaky(job_id: str) -> None:
    """Fails on its first delivery, succeeds on the next; each try is a Redis command."""
    tries = _client.incr(f"test:tries:{job_id}")
    logger.info("trying", extra={"tries": tries})
    if tries == 1:
        raise RuntimeError("the first try fails")


@dramatiq.actor(queue_name="notifications", max_retries=3)
def trace_hang_once(job_id: str) -> None:
    """Hangs on its first delivery (the test kills its process or stops the worker: it stops
    at a checkpoint), returns on the next."""
    if _client.incr(f"test:tries:{job_id}") == 1:
        for _ in range(600):
            time.sleep(0.1)
            checkpoint()


@dramatiq.actor(queue_name="notifications")
def trace_report(job_id: str) -> None:
    """Records which tracer provider this process has and whether the SDK is loaded."""
    from opentelemetry import trace

    _client.set(f"test:provider:{job_id}", type(trace.get_tracer_provider()).__name__)
    _client.set(f"test:sdk:{job_id}", int("opentelemetry.sdk.trace" in sys.modules))
'''


# The API side: no worker settings, only REDIS_URL and OTEL_*; enqueues inside its own span.
API_SCRIPT = '''\
import json, sys

from opentelemetry import trace

from {package}.producer import enqueue

tracer = trace.get_tracer("api")
with tracer.start_as_current_span("POST /jobs", kind=trace.SpanKind.SERVER) as span:
    message = enqueue(sys.argv[1], sys.argv[2])
print(json.dumps({{
    "message_id": message.message_id,
    "trace_id": trace.format_trace_id(span.get_span_context().trace_id),
    "span_id": trace.format_span_id(span.get_span_context().span_id),
    "options": message.options,
}}))
'''


@dataclass
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str
    attributes: dict[str, Any]
    status: int
    links: list[tuple[str, str]] = field(default_factory=list)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class Receiver:
    """An OTLP/HTTP receiver on the loopback: decodes every export into :class:`Span`."""

    def __init__(self, port: int = 0) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                receiver.add(request, self.path)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: ExportTraceServiceRequest, path: str) -> None:
        assert path == "/v1/traces", path
        with self.lock:
            self.requests += 1
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        if any(seen.span_id == span.span_id.hex() for seen in self.spans):
                            continue  # an exporter's retry: OTLP delivers at least once
                        self.spans.append(Span(
                            service=str(resource.get("service.name")),
                            trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(), name=span.name,
                            kind=SpanProto.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            status=span.status.code,
                            links=[(link.trace_id.hex(), link.span_id.hex())
                                   for link in span.links]))

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    started = Receiver()
    yield started
    started.close()


@pytest.fixture(scope="module")
def project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = bake(database="none")
    target = tmp_path_factory.mktemp("tracing") / base.name
    shutil.copytree(base, target)
    (target / "src" / package_of(target) / "actors" / "trace_test.py").write_text(TRACE_ACTORS)
    return target


def otel_env(receiver: Receiver, service: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_SERVICE_NAME": service,
            "OTEL_BSP_SCHEDULE_DELAY": "100"}


def without_otel(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if not key.startswith("OTEL_")}


def api_enqueue(project: Path, redis_url: str, receiver: Receiver, actor: str,
                job_id: str) -> dict[str, Any]:
    """Run the API-side script; return the message id and the trace of its request span."""
    script = project / "api_enqueue.py"
    script.write_text(API_SCRIPT.format(package=package_of(project)))
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(project / "src"),
           "REDIS_URL": redis_url, **otel_env(receiver, "api")}
    done = subprocess.run([PYTHON, str(script), actor, job_id], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    sent: dict[str, Any] = json.loads(done.stdout)
    return sent


@pytest.fixture
def start_worker(project: Path, redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def _start(otel: dict[str, str] | None, **env: str) -> Worker:
        worker = Worker(project, redis_url, tmp_path / f"w{len(started)}", **env)
        worker.env = {**without_otel(worker.env), **(otel or {})}
        started.append(worker)
        return worker.start()

    yield _start
    for worker in started:
        worker.kill()


def consumer_spans(spans: list[Span]) -> list[Span]:
    found = [span for span in spans if span.kind == "CONSUMER"]
    return sorted(found, key=lambda span: span.attributes["dramatiq.attempt"])


def test_a_job_that_fails_once_is_one_trace_from_the_api_through_both_deliveries(
        project: Path, redis_url: str, receiver: Receiver,
        start_worker: Callable[..., Worker]) -> None:
    worker = start_worker(otel_env(receiver, "orders-worker"))
    sent = api_enqueue(project, redis_url, receiver, "trace_flaky", "flaky")
    trace_id = sent["trace_id"]
    assert sent["options"]["trace_context"]["traceparent"].split("-")[1] == trace_id

    def complete() -> bool:
        consumers = consumer_spans(receiver.trace(trace_id))
        return [span.attributes.get("dramatiq.outcome") for span in consumers] == [
            "retry", "success"]

    wait_for(complete, 30, "both deliveries to be exported")
    spans = receiver.trace(trace_id)
    by_id = {span.span_id: span for span in spans}
    (request,) = [span for span in spans if span.name == "POST /jobs"]
    (producer,) = [span for span in spans if span.kind == "PRODUCER"]
    assert (request.service, request.parent_id) == ("api", "")
    assert producer.service == "api" and producer.parent_id == request.span_id
    assert producer.name == "send notifications"
    assert producer.attributes["messaging.destination.name"] == "notifications"
    assert producer.attributes["messaging.message.id"] == sent["message_id"]
    assert (producer.attributes["messaging.operation.type"],
            producer.attributes["messaging.operation"]) == ("send", "publish")

    first, second = consumer_spans(spans)
    for attempt, span in enumerate((first, second), start=1):
        assert span.service == "orders-worker"
        assert span.name == "process notifications"
        assert span.parent_id == producer.span_id, "each delivery is a child of the enqueue"
        assert (trace_id, producer.span_id) in span.links
        assert span.attributes["dramatiq.attempt"] == attempt
        assert span.attributes["dramatiq.actor"] == "trace_flaky"
        assert span.attributes["messaging.system"] == "dramatiq"
        assert span.attributes["messaging.destination.name"] == "notifications"
        assert span.attributes["messaging.message.id"] == sent["message_id"]
        assert span.attributes["messaging.operation.type"] == "process"
    assert first.status == 2 and second.status != 2  # STATUS_CODE_ERROR, then not

    # The handler's Redis command is a child of each delivery; the retry's enqueue too.
    for delivery in (first, second):
        children = [span for span in spans if span.parent_id == delivery.span_id]
        assert any(span.kind == "CLIENT" and span.name == "INCRBY" for span in children), [
            (span.name, span.kind) for span in children]
    # Every span of the trace hangs off the request: no orphan, no second root.
    for span in spans:
        if span is not request:
            assert span.parent_id in by_id, span
    # Redis commands outside any job (fetch polls, heartbeats) are no traces of their own.
    time.sleep(0.5)
    orphans = [span for span in receiver.spans if span.service == "orders-worker"
               and span.kind == "CLIENT" and not span.parent_id]
    assert not orphans, orphans[:3]

    # The job's log lines carry the trace and span of their delivery.
    wait_for(lambda: worker.log().count('"job_end"') >= 2, 10, "both job ends to be logged")
    ends = [json.loads(line) for line in worker.log().splitlines()
            if '"job_end"' in line and sent["message_id"] in line]
    assert [(end["outcome"], end["trace_id"], end["span_id"]) for end in ends] == [
        ("retry", trace_id, first.span_id), ("success", trace_id, second.span_id)]


def test_a_delivery_lost_to_sigkill_and_its_redelivery_are_in_the_same_trace(
        project: Path, redis_url: str, receiver: Receiver,
        start_worker: Callable[..., Worker]) -> None:
    client = redis.Redis.from_url(redis_url)
    worker = start_worker(otel_env(receiver, "orders-worker"))
    sent = api_enqueue(project, redis_url, receiver, "trace_hang_once", "hang")
    wait_for(lambda: client.get("test:tries:hang") == b"1", 30, "the first delivery to start")
    (child,) = worker.children()
    os.kill(child, signal.SIGKILL)

    def complete() -> bool:
        consumers = consumer_spans(receiver.trace(sent["trace_id"]))
        return [span.attributes.get("dramatiq.outcome") for span in consumers] == [
            "crash", "success"]

    wait_for(complete, 30, "the lost delivery and the redelivery to be exported")
    spans = receiver.trace(sent["trace_id"])
    (producer,) = [span for span in spans if span.kind == "PRODUCER"]
    lost, redelivery = consumer_spans(spans)
    assert lost.attributes["dramatiq.attempt"] == 1 and lost.status == 2
    assert redelivery.attributes["dramatiq.attempt"] == 2
    for span in (lost, redelivery):
        assert span.parent_id == producer.span_id
        assert span.attributes["messaging.message.id"] == sent["message_id"]
    assert int(client.get("test:tries:hang") or 0) == 2


def test_a_message_requeued_by_a_drain_and_a_replayed_dead_letter_keep_their_trace(
        project: Path, redis_url: str, receiver: Receiver,
        start_worker: Callable[..., Worker]) -> None:
    client = redis.Redis.from_url(redis_url)
    worker = start_worker(otel_env(receiver, "orders-worker"))
    sent = api_enqueue(project, redis_url, receiver, "trace_hang_once", "drained")
    wait_for(lambda: client.get("test:tries:drained") == b"1", 30, "the job to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    (redis_id,) = client.lrange("dramatiq:notifications", 0, -1)
    queued = json.loads(client.hget("dramatiq:notifications.msgs", redis_id) or b"{}")
    assert queued["message_id"] == sent["message_id"]
    assert queued["options"]["trace_context"] == sent["options"]["trace_context"]

    # The same message dead-lettered, then replayed: the replay carries the same context.
    client.delete("dramatiq:notifications", "dramatiq:notifications.msgs")
    client.zadd("dramatiq:notifications.XQ", {"dead-1": int(time.time() * 1000)})
    client.hset("dramatiq:notifications.XQ.msgs", "dead-1", json.dumps(
        {**queued, "options": {**queued["options"], "dead_letter_reason": "test"}}))
    env = project_env(project, WORKER_POOL="interactive", REDIS_URL=redis_url)
    replay = subprocess.run([PYTHON, "-m", package_of(project), "dlq", "replay", "dead-1"],
                            env=without_otel(env), cwd=project, capture_output=True, text=True,
                            timeout=60, check=False)
    assert replay.returncode == 0, replay.stderr
    (redis_id,) = client.lrange("dramatiq:notifications", 0, -1)
    replayed = json.loads(client.hget("dramatiq:notifications.msgs", redis_id) or b"{}")
    assert replayed["options"]["trace_context"] == sent["options"]["trace_context"]
    assert "dead_letter_reason" not in replayed["options"]


def test_without_otel_configuration_the_worker_runs_and_exports_nothing(
        project: Path, redis_url: str, start_worker: Callable[..., Worker]) -> None:
    # An SDK left to its defaults would export to localhost:4318: listen there when we can.
    try:
        default_port: Receiver | None = Receiver(4318)
    except OSError:
        default_port = None
    try:
        client = redis.Redis.from_url(redis_url)
        worker = start_worker(None)
        env = project_env(project, REDIS_URL=redis_url)
        script = (f"from {package_of(project)}.producer import enqueue\n"
                  "print(sorted(enqueue('trace_report', 'quiet').options))\n")
        done = subprocess.run([PYTHON, "-c", script], env=without_otel(env), cwd=project,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert "trace_context" not in done.stdout, "nothing is injected with tracing off"
        wait_for(lambda: client.get("test:sdk:quiet") is not None, 30, "the job to run")
        assert client.get("test:provider:quiet") == b"ProxyTracerProvider"
        assert client.get("test:sdk:quiet") == b"0", "the SDK is not even imported"
        wait_for(lambda: '"job_end"' in worker.log(), 10, "the job's end to be logged")
        lines = [json.loads(line) for line in worker.log().splitlines() if '"job_end"' in line]
        assert not any("trace_id" in line for line in lines)
        if default_port is not None:
            time.sleep(1)
            assert default_port.requests == 0
    finally:
        if default_port is not None:
            default_port.close()


@pytest.mark.parametrize(("env", "expected"), [
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER='sometimes': must be one of"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
     "OTEL_TRACES_SAMPLER_ARG=2: traceidratio needs a ratio between 0 and 1"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL='grpc': must be"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin': must be one of"),
])
def test_bad_otel_values_refuse_to_boot_with_exit_78(project: Path, redis_url: str,
                                                     env: dict[str, str],
                                                     expected: str) -> None:
    full = {**without_otel(project_env(project, WORKER_POOL="interactive", REDIS_URL=redis_url)),
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", **env}
    done = subprocess.run([PYTHON, "-m", package_of(project), "worker", "--process"], env=full,
                          cwd=project, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 78, done.stderr
    assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("off", [{"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}])
def test_tracing_switched_off_by_standard_variables(project: Path, redis_url: str,
                                                    off: dict[str, str]) -> None:
    env = project_env(project, REDIS_URL=redis_url,
                      OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", **off)
    script = (f"import {package_of(project)}\n"
              "from worker_runtime import telemetry\n"
              "print(telemetry.tracer_provider())\n")
    done = subprocess.run([PYTHON, "-c", script], env=env, cwd=project, capture_output=True,
                          text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "None"), done.stderr


def test_the_sandbox_child_gets_no_otel_variables_and_no_sdk(
        bake: Callable[..., Path], receiver: Receiver) -> None:
    project = bake()
    snippet = ("import os\n\n"
               "def main(payload):\n"
               "    try:\n        import opentelemetry\n        sdk = 'importable'\n"
               "    except ImportError:\n        sdk = 'not importable'\n"
               "    return [sorted(k for k in os.environ if k.startswith('OTEL')), sdk]\n")
    script = (f"from {package_of(project)}.sandbox import run_untrusted\n"
              f"result = run_untrusted({snippet!r})\n"
              "print(repr(result))\n")
    env = project_env(project, **otel_env(receiver, "orders-worker"),
                      OTEL_TRACES_EXPORTER="otlp")
    done = subprocess.run([PYTHON, "-c", script], env=env, cwd=project, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "[[], 'not importable']" in done.stdout, done.stdout
    time.sleep(0.5)
    assert receiver.requests == 0


DB_ACTOR = '''\
"""Actor of the tracing tests: one SQL query."""

import dramatiq

from .. import db


@dramatiq.actor(queue_name="{queue}")
def trace_query(job_id: str) -> None:
    with db.connection() as conn:
        conn.execute("SELECT 1").fetchone()
'''


def test_a_handlers_sql_query_is_a_child_span_of_its_delivery(
        bake: Callable[..., Path], tmp_path: Path, redis_url: str, receiver: Receiver) -> None:
    from bakery import DATABASE_POOL, DATABASE_QUEUE, TEST_DATABASE_URL

    base = bake()  # the database option
    project = tmp_path / base.name
    shutil.copytree(base, project)
    actors = project / "src" / package_of(project) / "actors"
    (actors / "trace_db.py").write_text(DB_ACTOR.replace("{queue}", DATABASE_QUEUE))
    worker = Worker(project, redis_url, tmp_path / "w", WORKER_POOL=DATABASE_POOL,
                    DATABASE_URL=TEST_DATABASE_URL, DB_POOL_SIZE="4")
    worker.env = {**without_otel(worker.env), **otel_env(receiver, "orders-worker")}
    try:
        worker.start()
        sent = api_enqueue(project, redis_url, receiver, "trace_query", "q")

        def query_span() -> list[Span]:
            return [span for span in receiver.trace(sent["trace_id"])
                    if span.kind == "CLIENT" and span.attributes.get("db.system") == "postgresql"]

        wait_for(lambda: query_span() and consumer_spans(receiver.trace(sent["trace_id"])), 30,
                 "the query's span and its delivery's")
        # Under load a first attempt may fail (a slow connect) and be retried: every
        # query span must still be the child of one of the job's deliveries.
        deliveries = {span.span_id: span for span in consumer_spans(receiver.trace(sent["trace_id"]))}
        for query in query_span():
            assert query.parent_id in deliveries, (query, list(deliveries.values()))
            assert "SELECT" in query.name or "SELECT 1" in str(query.attributes), query
    finally:
        worker.kill()
