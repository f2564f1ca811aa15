"""The container's one exporter: /metrics, /livez and /readyz on ``METRICS_PORT``.

The supervisor (the master process) sets ``PROMETHEUS_MULTIPROC_DIR`` to an empty
folder before it starts the worker processes, and calls :func:`start_exporter`,
which serves from a daemon thread:

* ``/metrics``: the worker processes' metrics, merged by prometheus-client's
  multiprocess collector (counters and histograms summed over every process that
  ever ran in this container; ``worker_*`` and ``db_pool_*`` gauges summed over
  the live processes only), plus the backlog of the pool's queues, read from
  Redis at scrape time (:class:`BacklogCollector`);
* ``/livez``: 200 when :func:`.probe.liveness_problems` finds none, else 503
  with the problems, one a line (the same rule as ``healthcheck live``);
* ``/readyz``: 200 when Redis (and the database) answer and the Redis node is a primary,
  else 503 with the reasons (the same rule as ``healthcheck ready``).

Backlog, per queue ``q`` of the pool, with one Lua call per scrape
(:data:`.layout.BACKLOG`: constant work per queue, however many messages wait) and one
``TIME``: ages are judged by Redis's clock, as the worker writes them, never this host's:

* ``queue_depth{queue="q"}``: messages ready to run, ``LLEN dramatiq:q`` (the list
  a KEDA ``redis`` trigger watches); ``queue_depth{queue="q.DQ"}``: delayed
  messages (retries with backoff, ``send_with_options(delay=...)``) that no worker
  has picked up yet.
* ``queue_oldest_message_seconds{queue="q"}``: how long the message at the head of
  ``dramatiq:q``, the next one in line, has waited since it became due: since its
  ``eta`` for a delayed or retried message (:func:`due_ms`), else since it was sent.
  Dramatiq requeues to the tail (shutdown, recovery), so an older message may wait
  behind it: this is the wait of the next message in line, not a scan for the
  oldest. 0 when the list is empty.
  For ``q.DQ``: how overdue the head of the delay list is (now - its eta, at
  least 0); above 0 means no worker is fetching delayed messages.
* ``queue_dead_letters{queue="q"}``: ``ZCARD dramatiq:q.XQ``.
* ``broker_full``: 1 while Redis refuses writes for being full (``maxmemory`` reached
  under ``noeviction``; :func:`.brokerstate.full_problem`, one write probe per scrape),
  else 0; one series per pool on the scheduler.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import redis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from . import brokerstate, layout, redisclient
from .pools import pool_slug

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .settings import Settings

logger = logging.getLogger(__name__)
#: How many ids at the head of a list are tried when a head id has no body (a race with an ack).
HEAD_PROBE = 3
ANY_HOST = "0.0.0.0"  # noqa: S104  (Prometheus scrapes the pod from outside)


@dataclass(frozen=True)
class Backlog:
    """One queue's backlog at one instant."""

    queue: str
    depth: int
    oldest_s: float
    delayed: int
    delayed_overdue_s: float
    dead_letters: int


def _number(value: Any) -> float | None:
    """``value`` as a number of the message's fields, None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _age_s(now_ms: float, since_ms: Any) -> float:
    """Seconds from ``since_ms`` (epoch ms) to ``now_ms``; 0 when unknown or in the future."""
    since = _number(since_ms)
    if since is None:
        return 0.0
    return max(0.0, (now_ms - since) / 1000)


def due_ms(fields: dict[str, Any]) -> float | None:
    """When a message became due (epoch ms): its ``eta`` (a delay, a retry's backoff) when
    it has one and it is later than its sending, else ``message_timestamp``. A delayed
    message keeps its first ``message_timestamp`` through retries: counting from it, a
    message sent with a 25 s delay would read 25 s old the instant it is due."""
    sent = _number(fields.get("message_timestamp"))
    options = fields.get("options")
    eta = _number(options.get("eta")) if isinstance(options, dict) else None
    if eta is not None and (sent is None or eta > sent):
        return eta
    return sent


def read_backlog(
    client: redis.Redis,
    queues: Sequence[str],
    now: float | None = None,
) -> list[Backlog]:
    """The backlog of ``queues`` with a single Lua call (constant work per queue), its ages
    judged at ``now`` (epoch s; default: Redis's clock, ``TIME``, the clock every ``eta`` and
    ``message_timestamp`` the worker writes is on: a host whose clock is off reports the
    right ages)."""
    now_ms = (layout.redis_now(client) if now is None else now) * 1000
    found = []
    records = layout.read_backlog_records(client, queues, HEAD_PROBE)
    for queue, record in zip(queues, records, strict=True):
        head = layout.message_fields(record["head"]) or {}
        options = (layout.message_fields(record["delayed_head"]) or {}).get("options")
        found.append(
            Backlog(
                queue=queue,
                depth=int(record["depth"]),
                oldest_s=_age_s(now_ms, due_ms(head)),
                delayed=int(record["delayed"]),
                delayed_overdue_s=_age_s(now_ms, options.get("eta"))
                if isinstance(options, dict)
                else 0.0,
                dead_letters=int(record["dead_letters"]),
            )
        )
    return found


#: Label of a series' pool, as Prometheus stores it: the pod label ``worker-template/pool``
#: of a worker pod becomes ``worker_template_pool`` (worker_infra's PodMonitor,
#: ``podTargetLabels``); the scheduler, whose pod serves no pool, sets it on the backlog.
POOL_SERIES_LABEL = "worker_template_pool"


class BacklogCollector(Collector):
    """``queue_depth``, ``queue_oldest_message_seconds`` and ``queue_dead_letters``, read from
    Redis at each scrape. When Redis does not answer, the three are absent from that scrape
    (an alert on ``absent()`` or on readiness catches it); the rest of /metrics still serves.

    Parameters:
      client: the Redis client.
      queues: the queues to read.
      pools: queue -> pool name; given, every series carries :data:`POOL_SERIES_LABEL`
        (the scheduler, which exports every pool's backlog). Default: none (a worker pod,
        whose pod label gives the pool).
    """

    def __init__(
        self,
        client: redis.Redis,
        queues: Sequence[str],
        pools: dict[str, str] | None = None,
    ) -> None:
        self.client = client
        self.queues = list(queues)
        self.pools = pools
        self.namespace = layout.namespace_of(self.queues[0]) if self.queues else layout.NAMESPACE

    def collect(self) -> Iterable[Metric]:
        try:
            backlog = read_backlog(self.client, self.queues)
        except redis.RedisError as error:
            logger.warning("backlog metrics unavailable: %s", error)
            return []
        names = ["queue"] if self.pools is None else ["queue", POOL_SERIES_LABEL]
        depth = GaugeMetricFamily(
            "queue_depth",
            "Messages waiting in the queue (q: ready to "
            "run, LLEN dramatiq:q; q.DQ: delayed, not fetched yet).",
            labels=names,
        )
        oldest = GaugeMetricFamily(
            "queue_oldest_message_seconds",
            "How long the next message in line (head of dramatiq:q) has waited since it "
            "became due; q.DQ: how overdue the head of the delay list is.",
            labels=names,
        )
        dead = GaugeMetricFamily(
            "queue_dead_letters", "Dead-lettered messages (ZCARD dramatiq:q.XQ).", labels=names
        )
        for item in backlog:
            pool = [] if self.pools is None else [pool_slug(self.pools[item.queue])]
            delayed = [layout.delay_queue(item.queue), *pool]
            depth.add_metric([item.queue, *pool], item.depth)
            depth.add_metric(delayed, item.delayed)
            oldest.add_metric([item.queue, *pool], item.oldest_s)
            oldest.add_metric(delayed, item.delayed_overdue_s)
            dead.add_metric([item.queue, *pool], item.dead_letters)
        full = GaugeMetricFamily(
            "broker_full",
            "1 while Redis refuses writes for being full (OOM), else 0.",
            labels=[] if self.pools is None else [POOL_SERIES_LABEL],
        )
        is_full = 1.0 if brokerstate.full_problem(self.client, self.namespace) else 0.0
        if self.pools is None:
            full.add_metric([], is_full)
        for name in sorted(set((self.pools or {}).values())):
            full.add_metric([pool_slug(name)], is_full)
        return [depth, oldest, dead, full]


class SettledMultiProcessCollector(MultiProcessCollector):
    """prometheus-client's multiprocess collector, minus files still being created.

    A worker process creates its file empty and sizes it a moment later; a scrape in
    between would fail as a whole (HTTP 500). Such a file holds no sample yet: skip it.
    """

    def __init__(self, registry: CollectorRegistry, path: str) -> None:
        super().__init__(registry, path=path)  # type: ignore[no-untyped-call]

    def collect(self) -> Iterable[Metric]:
        files = [path for path in glob.glob(os.path.join(self._path, "*.db")) if _settled(path)]
        metrics: Iterable[Metric] = self.merge(files, accumulate=True)  # type: ignore[no-untyped-call]
        return metrics


def _settled(path: str) -> bool:
    try:
        return os.path.getsize(path) >= 8
    except OSError:
        return False


def build_registry(
    client: redis.Redis, queues: Sequence[str], multiprocess_dir: str | None = None
) -> CollectorRegistry:
    """The exporter's registry: every worker process's metrics and the queues' backlog."""
    registry = CollectorRegistry()
    path = multiprocess_dir or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        SettledMultiProcessCollector(registry, path=path)
    registry.register(BacklogCollector(client, queues))
    return registry


class Exporter(ThreadingHTTPServer):
    """The HTTP server of /metrics, /livez and /readyz."""

    daemon_threads = True

    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry,
        host: str = ANY_HOST,
    ) -> None:
        super().__init__((host, settings.metrics_port), _Handler)
        self.settings = settings
        self.registry = registry

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A request that fails unexpectedly is one JSON log line (not a raw traceback on
        stderr); the server goes on serving."""
        logger.exception("metrics request failed", extra={"client": str(client_address)})


class _Handler(BaseHTTPRequestHandler):
    server: Exporter

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
            elif path == "/livez":
                self._probe(self._liveness())
            elif path == "/readyz":
                from .probe import readiness_problems

                self._probe(readiness_problems(self.server.settings))
            else:
                self._send(404, b"not found: try /metrics, /livez or /readyz\n")
        except Exception as error:
            logger.exception("exporter request failed")
            self._send(500, f"{type(error).__name__}: {error}\n".encode())

    def _liveness(self) -> list[str]:
        from .probe import liveness_problems

        settings = self.server.settings
        return liveness_problems(settings.worker_state_dir, settings.health_stalled_after_s)

    def _probe(self, problems: list[str]) -> None:
        body = "".join(f"{problem}\n" for problem in problems) or "ok\n"
        self._send(503 if problems else 200, body.encode())

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes are not worth a log line each."""


def start_exporter(settings: Settings) -> Exporter:
    """Serve /metrics, /livez and /readyz on ``METRICS_PORT`` from a daemon thread.

    Called once per container, by the supervisor, after it set and emptied
    ``PROMETHEUS_MULTIPROC_DIR`` (files of a previous run are stale). A port that
    cannot be bound (already in use) refuses to boot: one line, exit 78.
    """
    client = redisclient.connect(
        settings.redis_url.get_secret_value(), socket_timeout=2, socket_connect_timeout=2
    )
    try:
        exporter = Exporter(settings, build_registry(client, settings.worker_queues))
    except OSError as error:  # e.g. the port is taken: a restart would fail the same way
        from .settings import refuse

        refuse([f"METRICS_PORT={settings.metrics_port}: cannot listen: {error.strerror or error}"])
    thread = threading.Thread(target=exporter.serve_forever, name="metrics-exporter", daemon=True)
    thread.start()
    logger.info("metrics exporter listening", extra={"port": settings.metrics_port})
    return exporter
