"""JSON-lines logging: one object per line, with the service name and any ``extra`` fields.

A line logged while a span is current (a job's lines, with tracing on) carries its
``trace_id`` and ``span_id``, so logs and traces join.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from opentelemetry import trace

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object; ``extra={...}`` fields become top-level keys.

    Parameters:
      service: the ``service`` key of every line (``OTEL_SERVICE_NAME``).
    """

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "service": self.service,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            line["trace_id"] = trace.format_trace_id(span.trace_id)
            line["span_id"] = trace.format_span_id(span.span_id)
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(service: str, level: str = "INFO") -> None:
    """Send every log record to stderr as JSON lines, written as they are logged (a line
    is on stderr before the call returns: a process killed the next moment keeps it)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    # The lines carry none of the caller's file, line, thread or process names: skip
    # collecting them for every record (the logging HOWTO's "Optimization" knobs).
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("dramatiq").setLevel(max(logging.getLevelName(level), logging.INFO))
