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
  else 503 with the reasons (the same rule as ``healthcheck ready``);
* ``/console/``: the web console (:mod:`.console`), only with ``CONSOLE_IN_EXPORTER=true``
  (default false: 404), read-only unless ``CONSOLE_TOKEN`` is set; its pages carry the
  console's security headers.

Backlog, per queue ``q`` of the pool, read by :func:`.backlog.read_backlog` with one Lua
call per scrape (:data:`.layout.BACKLOG`: constant work per queue, however many messages
wait) and one ``TIME``: ages are judged by Redis's clock, as the worker writes them, never
this host's:

* ``queue_depth{queue="q"}``: messages ready to run, ``LLEN dramatiq:q`` (the list
  a KEDA ``redis`` trigger watches); ``queue_depth{queue="q.DQ"}``: delayed
  messages (retries with backoff, ``send_with_options(delay=...)``) that no worker
  has picked up yet.
* ``queue_oldest_message_seconds{queue="q"}``: how long the message at the head of
  ``dramatiq:q``, the next one in line, has waited since it became due: since its
  ``eta`` for a delayed or retried message (:func:`.backlog.due_ms`), else since it was sent.
  Dramatiq requeues to the tail (shutdown, recovery), so an older message may wait
  behind it: this is the wait of the next message in line, not a scan for the
  oldest. 0 when the list is empty.
  For ``q.DQ``: how long the next due delayed message has been due (now - its eta,
  at least 0; the earliest of the due set, :func:`.backlog.read_backlog`); above 0 for
  more than a moment means no worker moves due messages to their queue.
* ``queue_dead_letters{queue="q"}``: ``ZCARD dramatiq:q.XQ``.
* ``queue_consumers{queue="q"}``: live worker processes serving ``q`` (a fresh heartbeat,
  read from their records as ``status`` reads them: two more round trips per scrape).
* ``queue_unserved{queue="q"}``: 1 while ``q`` has waiting or due delayed messages and no
  live process serves it (:func:`.status.is_unserved`, the rule of ``status --check``).
* ``broker_full``: 1 while Redis refuses writes for being full (``maxmemory`` reached
  under ``noeviction``; :func:`.brokerstate.full_problem`, one write probe per scrape),
  else 0; one series per pool on the scheduler.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import redis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from . import brokerstate, contract, layout, redisclient
from .backlog import read_backlog
from .pools import pool_slug
from .status import consumers_of, is_unserved, processes_of

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .settings import WorkerSettings

logger = logging.getLogger(__name__)
ANY_HOST = "0.0.0.0"  # noqa: S104  (Prometheus scrapes the pod from outside)
#: What the exporter serves besides its own paths: path prefix -> a function answering a
#: request under it, given the request's handler and method (``GET``, ``POST``). The
#: console is mounted so (:func:`.console.exporter_mount`), without the exporter knowing it.
Mount = Callable[[BaseHTTPRequestHandler, str], None]
Mounts = Mapping[str, Mount]


#: Label of a series' pool, as Prometheus stores it: the pod label ``worker-template/pool``
#: of a worker pod becomes ``worker_template_pool`` (worker_infra's PodMonitor,
#: ``podTargetLabels``); the scheduler, whose pod serves no pool, sets it on the backlog.
POOL_SERIES_LABEL = contract.POOL_SERIES_LABEL


class BacklogCollector(Collector):
    """``queue_depth``, ``queue_oldest_message_seconds``, ``queue_dead_letters``,
    ``queue_consumers`` and ``queue_unserved``, read from Redis at each scrape. When Redis
    does not answer, they are absent from that scrape
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
            now_ms, fleet = layout.read_fleet(self.client, self.queues)
            backlog = read_backlog(self.client, self.queues, now=now_ms / 1000)
        except redis.RedisError as error:
            logger.warning("backlog metrics unavailable: %s", error)
            return []
        consumers = consumers_of(processes_of(now_ms, fleet), self.queues)
        names = ["queue"] if self.pools is None else ["queue", POOL_SERIES_LABEL]
        depth = GaugeMetricFamily(
            contract.QUEUE_DEPTH,
            "Messages waiting in the queue (q: ready to "
            "run, LLEN dramatiq:q; q.DQ: delayed, not yet due or not yet moved).",
            labels=names,
        )
        oldest = GaugeMetricFamily(
            contract.QUEUE_OLDEST_MESSAGE,
            "How long the next message in line (head of dramatiq:q) has waited since it "
            "became due; q.DQ: how long the next due delayed message has been due.",
            labels=names,
        )
        dead = GaugeMetricFamily(
            contract.QUEUE_DEAD_LETTERS,
            "Dead-lettered messages (ZCARD dramatiq:q.XQ).",
            labels=names,
        )
        serving = GaugeMetricFamily(
            contract.QUEUE_CONSUMERS,
            "Live worker processes serving the queue (heartbeat fresh, by their records).",
            labels=names,
        )
        unserved = GaugeMetricFamily(
            contract.QUEUE_UNSERVED,
            "1 while the queue has waiting or due delayed messages and no live process "
            "serves it, else 0.",
            labels=names,
        )
        for item in backlog:
            pool = [] if self.pools is None else [pool_slug(self.pools[item.queue])]
            delayed = [layout.delay_queue(item.queue), *pool]
            depth.add_metric([item.queue, *pool], item.depth)
            depth.add_metric(delayed, item.delayed)
            oldest.add_metric([item.queue, *pool], item.oldest_s)
            oldest.add_metric(delayed, item.delayed_overdue_s)
            dead.add_metric([item.queue, *pool], item.dead_letters)
            serving.add_metric([item.queue, *pool], consumers[item.queue])
            unserved.add_metric([item.queue, *pool], is_unserved(item, consumers[item.queue]))
        full = GaugeMetricFamily(
            contract.BROKER_FULL,
            "1 while Redis refuses writes for being full (OOM), else 0.",
            labels=[] if self.pools is None else [POOL_SERIES_LABEL],
        )
        is_full = 1.0 if brokerstate.full_problem(self.client, self.namespace) else 0.0
        if self.pools is None:
            full.add_metric([], is_full)
        for name in sorted(set((self.pools or {}).values())):
            full.add_metric([pool_slug(name)], is_full)
        return [depth, oldest, dead, serving, unserved, full]


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


class FlowCollector(Collector):
    """``queue_paused{queue}`` (1 while ``pause`` holds it) and
    ``jobs_deduplicated_total{queue,action}`` (sends of unique jobs skipped or replaced,
    :mod:`.unique`, counted in Redis by every producer) for ``queues``, and per
    downstream resource of ``limits`` (name -> ``capacity - reserved`` in effect)
    ``downstream_in_use{downstream}`` (deliveries of every pool holding a slot) and
    ``downstream_limit{downstream}``, read from Redis at each scrape (three round trips);
    absent from a scrape while Redis does not answer."""

    def __init__(self, client: redis.Redis, queues: Sequence[str], limits: Mapping[str, int]):
        self.client = client
        self.queues = list(queues)
        self.limits = dict(limits)

    def collect(self) -> Iterable[Metric]:
        try:
            paused = layout.paused_queues(self.client, self.queues)
            uses = layout.downstream_use(self.client, list(self.limits))
            deduped = layout.dedupe_counts(self.client, self.queues)
        except redis.RedisError as error:
            logger.warning("flow metrics unavailable: %s", error)
            return []
        gauge = GaugeMetricFamily(
            "queue_paused", "1 while the queue is paused (no worker fetches it).", labels=["queue"]
        )
        for queue in self.queues:
            gauge.add_metric([queue], 1.0 if queue in paused else 0.0)
        in_use = GaugeMetricFamily(
            "downstream_in_use",
            "Deliveries of every pool holding a slot of the downstream budget now.",
            labels=["downstream"],
        )
        limit = GaugeMetricFamily(
            "downstream_limit",
            "The downstream's run-time budget of jobs in flight (capacity - reserved).",
            labels=["downstream"],
        )
        for use in uses:
            in_use.add_metric([use.name], float(use.in_use))
            limit.add_metric([use.name], float(self.limits[use.name]))
        dedupe = CounterMetricFamily(
            "jobs_deduplicated",
            "Sends of a unique job an equal job's lock turned away (skipped) or merged into "
            "the pending delayed one (replaced), by every producer (counted in Redis).",
            labels=["queue", "action"],
        )
        for (queue, action), count in sorted(deduped.items()):
            dedupe.add_metric([queue, action], float(count))
        return [gauge, in_use, limit, dedupe]


def _settled(path: str) -> bool:
    try:
        return os.path.getsize(path) >= 8
    except OSError:
        return False


def build_registry(
    client: redis.Redis,
    queues: Sequence[str],
    multiprocess_dir: str | None = None,
    limits: Mapping[str, int] | None = None,
) -> CollectorRegistry:
    """The exporter's registry: every worker process's metrics, the queues' backlog and
    flow state (``limits``: the pool's downstream budgets, default none)."""
    registry = CollectorRegistry()
    path = multiprocess_dir or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        SettledMultiProcessCollector(registry, path=path)
    registry.register(BacklogCollector(client, queues))
    registry.register(FlowCollector(client, queues, limits or {}))
    return registry


class Exporter(ThreadingHTTPServer):
    """The HTTP server of /metrics, /livez and /readyz, and of ``mounts`` (default none)."""

    daemon_threads = True

    def __init__(
        self,
        settings: WorkerSettings,
        registry: CollectorRegistry,
        host: str = ANY_HOST,
        mounts: Mounts | None = None,
    ) -> None:
        super().__init__((host, settings.metrics_port), _Handler)
        self.settings = settings
        self.registry = registry
        self.mounts = dict(mounts or {})

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A request that fails unexpectedly is one JSON log line (not a raw traceback on
        stderr); the server goes on serving."""
        logger.exception("metrics request failed", extra={"client": str(client_address)})


class _Handler(BaseHTTPRequestHandler):
    server: Exporter

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if self._mounted(path, "GET"):
            return
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

    def do_POST(self) -> None:
        if not self._mounted(self.path.split("?", 1)[0], "POST"):
            self._send(404, b"not found\n")

    def _mounted(self, path: str, method: str) -> bool:
        """Answer from the mount ``path`` is under; False when it is under none."""
        for prefix, serve in self.server.mounts.items():
            if path == prefix or path.startswith(prefix + "/"):
                serve(self, method)
                return True
        return False

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
        send(self, status, body, content_type)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes are not worth a log line each."""


def send(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: bytes,
    content_type: str,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Answer ``handler``'s request: ``status``, ``body`` of ``content_type``, and
    ``headers`` (default none; the console's security headers on its pages)."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)


def start_exporter(
    settings: WorkerSettings, mounts: Mounts | None = None, collectors: Iterable[Collector] = ()
) -> Exporter:
    """Serve /metrics, /livez and /readyz (and ``mounts``: see :data:`Mount`) on
    ``METRICS_PORT`` from a daemon thread; ``collectors`` add the supervisor's own series
    (:class:`.oomkills.OomKills`).

    Called once per container, by the supervisor, after it set and emptied
    ``PROMETHEUS_MULTIPROC_DIR`` (files of a previous run are stale). A port that
    cannot be bound (already in use) refuses to boot: one line, exit 78.
    """
    client = redisclient.connect(
        settings.redis_url.get_secret_value(), socket_timeout=2, socket_connect_timeout=2
    )
    try:
        limits = {name: resource.budget for name, resource in settings.downstreams.items()}
        registry = build_registry(client, settings.worker_queues, limits=limits)
        for collector in collectors:
            registry.register(collector)
        exporter = Exporter(settings, registry, mounts=mounts)
    except OSError as error:  # e.g. the port is taken: a restart would fail the same way
        from .settings import refuse

        refuse([f"METRICS_PORT={settings.metrics_port}: cannot listen: {error.strerror or error}"])
    thread = threading.Thread(target=exporter.serve_forever, name="metrics-exporter", daemon=True)
    thread.start()
    logger.info("metrics exporter listening", extra={"port": settings.metrics_port})
    return exporter
