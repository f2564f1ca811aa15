"""OpenTelemetry tracing, configured only by the standard ``OTEL_*`` variables.

Tracing is on in a process when its environment says where spans go:
``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (OTLP over
HTTP/protobuf, e.g. ``http://otel-collector:4318``), or ``OTEL_TRACES_EXPORTER`` set to
``otlp`` or ``console``. It is off when none of them is set, and whenever
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``: then no SDK is loaded, no
span is made, nothing is exported, and the tracing middleware does nothing per message.

The SDK reads everything else itself: ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` (the resource; the service name defaults to the
project's), ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``,
``OTEL_EXPORTER_OTLP_(TRACES_)HEADERS/TIMEOUT/COMPRESSION/CERTIFICATE``, ``OTEL_BSP_*``
(batching) and ``OTEL_PROPAGATORS`` (W3C trace context by default).

A process whose code already installed an SDK tracer provider (an API with its own
OpenTelemetry setup) keeps it: the middleware uses that provider and this module
configures nothing.

When on, the official Redis and psycopg instrumentations are installed, so a
handler's commands and queries are child spans of its job. A Redis command or a
query outside any span (the worker's fetch polls, heartbeats, recovery passes) is
not recorded: each would be a one-span trace of its own, many per second.

A bad value (an unknown sampler or exporter, a ratio outside [0, 1], the gRPC
protocol this image does not ship) refuses to boot with exit 78, one line each.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace

from . import layout
from .service import current as current_service
from .service import runtime_version
from .settings import refuse

if TYPE_CHECKING:
    from dramatiq import Message
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.util.types import Attributes

#: The message option that carries the trace context (a dict of propagation headers).
CONTEXT_OPTION = "trace_context"
SYSTEM = "dramatiq"


def message_context(message: Message[Any]) -> Context:
    """The trace context a message carries (an empty context when it carries none)."""
    carrier = message.options.get(CONTEXT_OPTION)
    return propagate.extract(carrier if isinstance(carrier, dict) else {})


def delivery_attributes(
    message: Message[Any], queue: str, operation: str = "process"
) -> dict[str, Any]:
    """The messaging attributes of a span about ``message`` on ``queue``: a delivery
    (``operation`` ``process``, the default) or its enqueue (``send``; the former name of
    the operation, ``messaging.operation``, is then ``publish``)."""
    return {
        "messaging.system": SYSTEM,
        "messaging.destination.name": layout.canonical(queue),
        "messaging.message.id": message.message_id,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.operation": "publish" if operation == "send" else operation,
        "dramatiq.actor": message.actor_name,
    }


#: The values of OTEL_TRACES_SAMPLER that the SDK knows (the specification's list).
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("http/protobuf",)
ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
#: Name of the tracer (the instrumentation scope) of this service's spans.
#: The instrumentation scope of the runtime's own spans.
SCOPE = "worker_runtime.tracing"
#: The version of the runtime's instrumentation (its spans' scope).
RUNTIME_VERSION = runtime_version()

_lock = threading.Lock()
_resolved = False
_provider: trace.TracerProvider | None = None


def _get(environ: Mapping[str, str], name: str) -> str:
    return environ.get(name, "").strip()


def requested(environ: Mapping[str, str]) -> bool:
    """True when the environment asks for spans to be exported."""
    if _get(environ, "OTEL_SDK_DISABLED").lower() == "true":
        return False
    exporter = _get(environ, "OTEL_TRACES_EXPORTER").lower()
    if exporter == "none":
        return False
    return bool(exporter) or any(_get(environ, name) for name in ENDPOINTS)


def problems(environ: Mapping[str, str]) -> list[str]:
    """One line per bad ``OTEL_*`` value that tracing would use (none when it is off)."""
    if not requested(environ):
        return []
    found = []
    exporter = _get(environ, "OTEL_TRACES_EXPORTER").lower() or "otlp"
    if exporter not in EXPORTERS:
        found.append(f"OTEL_TRACES_EXPORTER={exporter!r}: must be one of {', '.join(EXPORTERS)}")
    protocol = (
        _get(environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or _get(environ, "OTEL_EXPORTER_OTLP_PROTOCOL")
        or PROTOCOLS[0]
    )
    if exporter == "otlp" and protocol not in PROTOCOLS:
        found.append(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: must be http/protobuf "
            "(the collector's OTLP/HTTP port, usually 4318; gRPC is not installed)"
        )
    sampler = _get(environ, "OTEL_TRACES_SAMPLER").lower()
    if sampler and sampler not in SAMPLERS:
        found.append(f"OTEL_TRACES_SAMPLER={sampler!r}: must be one of {', '.join(SAMPLERS)}")
    if sampler.endswith("traceidratio"):
        ratio = _get(environ, "OTEL_TRACES_SAMPLER_ARG")
        try:
            valid = 0.0 <= float(ratio) <= 1.0
        except ValueError:
            valid = False
        if not valid:
            found.append(
                f"OTEL_TRACES_SAMPLER_ARG={ratio or 'unset'}: {sampler} needs a ratio "
                "between 0 and 1"
            )
    return found


def tracer_provider() -> trace.TracerProvider | None:
    """This process's tracer provider, or None when tracing is off (decided once).

    Configures the SDK from ``os.environ`` on the first call (exit 78 on a bad value),
    unless the process already installed an SDK provider, which is then used as is.
    """
    global _resolved, _provider
    with _lock:
        if not _resolved:
            _provider = _resolve(os.environ)
            _resolved = True
        return _provider


def _resolve(environ: Mapping[str, str]) -> trace.TracerProvider | None:
    current = trace.get_tracer_provider()
    if not isinstance(current, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return current  # the application configured OpenTelemetry itself
    if not requested(environ):
        return None
    bad = problems(environ)
    if bad:
        refuse(bad)
    provider = build_provider(environ)
    trace.set_tracer_provider(provider)
    instrument(provider)
    return provider


def build_provider(environ: Mapping[str, str]) -> TracerProvider:
    """An SDK tracer provider exporting in batches to the exporter the environment names."""
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    resource = Resource.create(
        {
            SERVICE_NAME: _get(environ, "OTEL_SERVICE_NAME") or current_service().project,
            SERVICE_VERSION: current_service().version,
        }
    )
    provider = TracerProvider(resource=resource)
    provider.sampler = skip_orphan_client_spans(provider.sampler)  # before any tracer exists
    exporter: SpanExporter
    if _get(environ, "OTEL_TRACES_EXPORTER").lower() == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def instrument(provider: trace.TracerProvider) -> None:
    """Install the official Redis (and, with the database option, psycopg) instrumentation."""
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    RedisInstrumentor().instrument(tracer_provider=provider)
    try:  # the postgres extra's: absent without it
        from opentelemetry.instrumentation.psycopg import (  # type: ignore[import-untyped,unused-ignore]
            PsycopgInstrumentor,
        )
    except ImportError:
        return
    PsycopgInstrumentor().instrument(tracer_provider=provider)


def skip_orphan_client_spans(sampler: Sampler) -> Sampler:
    """A sampler that drops a client span without a parent and lets ``sampler`` decide the rest.

    A Redis command or an SQL query outside any job or enqueue (fetch polls,
    heartbeats, recovery passes) would otherwise be a trace of its own.

    Parameters:
      sampler: the sampler of ``OTEL_TRACES_SAMPLER`` (the provider's default).
    """
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class SkipOrphanClientSpans(Sampler):
        def should_sample(
            self,
            parent_context: Context | None,
            trace_id: int,
            name: str,
            kind: trace.SpanKind | None = None,
            attributes: Attributes = None,
            links: Sequence[trace.Link] | None = None,
            trace_state: trace.TraceState | None = None,
        ) -> SamplingResult:
            if (
                kind is trace.SpanKind.CLIENT
                and not trace.get_current_span(parent_context).get_span_context().is_valid
            ):
                return SamplingResult(Decision.DROP)
            return sampler.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )

        def get_description(self) -> str:
            return "SkipOrphanClientSpans(" + sampler.get_description() + ")"

    return SkipOrphanClientSpans()


def record_lost_delivery(message: Message[Any], queue: str, dead_letter_reason: str | None) -> None:
    """A span for a delivery whose worker process died before it ended (its own span died too).

    Called by recovery for each message it charges with a crash; the span joins the
    message's trace, so the trace shows the lost delivery between the others.

    Parameters:
      message: the recovered message, its ``crashes`` already counting this one.
      queue: the queue it was held on.
      dead_letter_reason: set when the crash used up its attempts and it was dead-lettered.
    """
    provider = tracer_provider()
    if provider is None:
        return
    attributes = delivery_attributes(message, queue)
    attributes["dramatiq.attempt"] = layout.deliveries(message.options)
    attributes["dramatiq.outcome"] = "dead_letter" if dead_letter_reason else "crash"
    if dead_letter_reason:
        attributes["dramatiq.dead_letter_reason"] = dead_letter_reason
    tracer = provider.get_tracer(SCOPE, RUNTIME_VERSION)
    span = tracer.start_span(
        f"process {attributes['messaging.destination.name']}",
        context=message_context(message),
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
    )
    span.set_status(trace.StatusCode.ERROR, "the worker process died during this delivery")
    span.end()
