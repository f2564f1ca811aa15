"""Cost of tracing, measured side by side in one run; prints numbers and ratios, writes JSON.

    python bench/tracing_bench.py [--rounds 3] [--jobs 1500] [--calls 20000]

Three variants of one baked service (``database=none``), each round in turn:

``absent``  the Tracing middleware removed from the broker's stack (the baseline);
``off``     the stack as baked, no ``OTEL_*`` variable set (the default);
``on``      ``OTEL_EXPORTER_OTLP_ENDPOINT`` set: every job exports its spans (sampler
            always on) over OTLP/HTTP to a receiver in this process that answers 200.

1. Throughput of no-op jobs: ``jobs`` messages are queued first, then the baked
   ``worker`` command (1 process, 8 threads) runs them; timed from the first job's start
   to the last ack. Reported as jobs/s and the ratio to ``absent``.
2. Hook cost, in process: the middleware's enqueue and delivery hooks called ``calls``
   times on a fresh message each, off and on (on: a real SDK provider whose exporter
   drops the spans), against a middleware whose hooks do nothing (``absent``: the cost
   of making the message); in microseconds per message, and added over ``absent``.

Bakes the template into a temp dir and starts its own redis-server on a free port.
Results: ``bench/results/tracing_bench-<UTC timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _workers
from _workers import PACKAGE, QUEUE

RESULTS = Path(__file__).resolve().parent / "results"
ACTORS = """
import dramatiq


@dramatiq.actor(queue_name="notifications", max_retries=0)
def bench_noop() -> None:
    pass
"""
HOOKS = """
import json, sys, time
import dramatiq
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from worker_runtime.middleware.tracing import Tracing


class Drop(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


def per_message_us(middleware, calls):
    broker = StubBroker()
    broker.emit_after = lambda *a, **k: None
    started = time.perf_counter()
    for index in range(calls):
        message = dramatiq.Message(queue_name="notifications", actor_name="a", args=(),
                                   kwargs={{}}, options={{}})
        middleware.before_enqueue(broker, message, None)
        middleware.after_enqueue(broker, message, None)
        proxy = MessageProxy(message)
        middleware.before_process_message(broker, proxy)
        middleware.after_process_message(broker, proxy, result=None)
        middleware.after_ack(broker, proxy)
    return (time.perf_counter() - started) / calls * 1e6


calls = int(sys.argv[1])
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(Drop()))
print(json.dumps({{"absent": per_message_us(dramatiq.Middleware(), calls),
                  "off": per_message_us(Tracing(), calls),
                  "on": per_message_us(Tracing(provider), calls)}}))
"""


class Sink:
    """An OTLP/HTTP endpoint that accepts every export and counts the requests."""

    def __init__(self) -> None:
        self.requests = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Bench:
    def __init__(self, root: Path) -> None:
        baked = _workers.bake(root / "with", {"bench": ACTORS}, database="none")
        absent = root / "absent" / baked.name
        shutil.copytree(baked, absent)
        broker_py = absent / "src" / PACKAGE / "broker.py"
        text = broker_py.read_text()
        stack = "    return default_stack(settings, client)\n"
        assert stack in text, "the bench expects the runtime's stack in the bake's broker.py"
        broker_py.write_text(
            text.replace(
                stack,
                (
                    "    from worker_runtime.middleware import Tracing\n\n"
                    "    return [m for m in default_stack(settings, client) if not isinstance(m, Tracing)]\n"
                ),
            )
        )
        self.projects = {"absent": absent, "off": baked, "on": baked}
        self.root = root
        self.sink = Sink()
        self.redis = _workers.redis_server(root / "redis")
        self.url = self.redis.url
        self.client = redis.Redis.from_url(self.url)

    def env(self, variant: str) -> dict[str, str]:
        env = _workers.worker_env(
            self.projects[variant],
            self.url,
            Path(tempfile.mkdtemp(dir=self.root)),
            WORKER_CONCURRENCY="8",
        )
        if variant == "on":
            env.update(
                OTEL_EXPORTER_OTLP_ENDPOINT=self.sink.endpoint,
                OTEL_SERVICE_NAME="bench",
                OTEL_TRACES_SAMPLER="always_on",
            )
        return env

    def throughput(self, variant: str, jobs: int) -> float:
        """No-op jobs per second, first start to last ack, in one worker process."""
        self.client.flushall()
        _workers.push(self.client, (_workers.message("bench_noop") for _ in range(jobs)))
        bodies = f"dramatiq:{QUEUE}.msgs"
        worker = _workers.start_worker(self.projects[variant], self.env(variant))
        try:
            _workers.wait_for(lambda: self.client.hlen(bodies) < jobs, 60, "the first job")
            started = time.perf_counter()
            _workers.wait_for(lambda: self.client.hlen(bodies) == 0, 300, "every job")
            return jobs / (time.perf_counter() - started)
        finally:
            _workers.stop(worker)

    def hooks(self, calls: int) -> dict[str, float]:
        env = self.env("off")
        done = subprocess.run(
            [_workers.PYTHON, "-c", HOOKS.format(package=PACKAGE), str(calls)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        result: dict[str, float] = json.loads(done.stdout)
        return result

    def close(self) -> None:
        self.client.close()
        self.redis.stop()
        self.sink.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=1500)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tracing-bench-"))
    bench = Bench(root)
    rates: dict[str, list[float]] = {"absent": [], "off": [], "on": []}
    hooks: dict[str, list[float]] = {"absent": [], "off": [], "on": []}
    try:
        for round_index in range(args.rounds):
            order = list(rates)
            order = order[round_index % 3 :] + order[: round_index % 3]  # no order bias
            for variant in order:
                rates[variant].append(bench.throughput(variant, args.jobs))
            for variant, value in bench.hooks(args.calls).items():
                hooks[variant].append(value)
            print(
                f"round {round_index + 1}: "
                + ", ".join(f"{v} {r[-1]:.0f} jobs/s" for v, r in rates.items())
            )
        exported = bench.sink.requests
    finally:
        bench.close()
        shutil.rmtree(root, ignore_errors=True)

    median = {variant: statistics.median(values) for variant, values in rates.items()}
    results = {
        "jobs": args.jobs,
        "rounds": args.rounds,
        "throughput_jobs_per_s": median,
        "throughput_runs": rates,
        "ratio_to_absent": {v: median[v] / median["absent"] for v in ("off", "on")},
        "hook_us_per_message": {v: statistics.median(values) for v, values in hooks.items()},
        "hook_us_added_per_message": {
            v: statistics.median(hooks[v]) - statistics.median(hooks["absent"])
            for v in ("off", "on")
        },
        "otlp_export_requests_when_on": exported,
    }
    print(json.dumps(results, indent=2))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"tracing_bench-{stamp}.json"
    path.write_text(json.dumps({"cores": os.cpu_count(), "results": results}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
