"""JSON-lines logging: one object per line, with the service name and any ``extra`` fields.

A line logged while a span is current (a job's lines, with tracing on) carries its
``trace_id`` and ``span_id``, so logs and traces join.

Lines are written by one thread of their own (the standard library's ``QueueHandler``
hands records to it): a handler thread that logs its job's line hands the record over
and goes on, instead of waiting for the handler lock while another thread formats and
writes (measured: a third of the handler threads' time with 8 no-op jobs at a time).
The writer writes what is pending every :data:`WRITE_INTERVAL_S`; up to
:data:`PENDING_LINES` lines wait, past that a logging thread waits for the writer
(nothing is dropped). It writes what is pending when the process exits; a process
killed outright (SIGKILL) loses at most the last :data:`WRITE_INTERVAL_S` of lines.
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import queue
import sys
import threading
from typing import Any

from opentelemetry import trace

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

#: Lines waiting for the writer thread before a logging thread waits too.
PENDING_LINES = 10_000
#: Seconds between two writes of the pending lines.
WRITE_INTERVAL_S = 0.05


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
            # Rendered once, by the logging thread (see _HandOver.prepare), when it went there.
            "msg": record.__dict__.get("message") or record.getMessage(),
        }
        span = getattr(record, "_span", None) or trace.get_current_span().get_span_context()
        if span.is_valid:
            line["trace_id"] = trace.format_trace_id(span.trace_id)
            line["span_id"] = trace.format_span_id(span.span_id)
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class _HandOver(logging.handlers.QueueHandler):
    """Hands a record to the writer thread as it is (same process: nothing to pickle),
    with what only the logging thread knows: its message and its current span."""

    def __init__(self, pending: queue.Queue[logging.LogRecord]) -> None:
        super().__init__(pending)
        self.pending = pending

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.message = record.getMessage()
        setattr(record, "_span", trace.get_current_span().get_span_context())  # noqa: B010
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        self.pending.put(record)  # blocks when PENDING_LINES wait: slower, never lost


class _Writer(threading.Thread):
    """Writes the pending records every :data:`WRITE_INTERVAL_S`, all at once (one write),
    so a logging thread neither waits for the write nor wakes the writer for each line."""

    def __init__(self, pending: queue.Queue[logging.LogRecord], formatter: JsonFormatter) -> None:
        super().__init__(name="log-writer", daemon=True)
        self.pending = pending
        self.output = logging.StreamHandler(sys.stderr)
        self.output.setFormatter(formatter)
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(WRITE_INTERVAL_S):
            self.write_pending()
        self.write_pending()

    def write_pending(self) -> None:
        lines: list[str] = []
        while True:
            try:
                record = self.pending.get_nowait()
            except queue.Empty:
                break
            try:
                lines.append(self.output.format(record))
            except Exception:  # a record that cannot be formatted: say so, keep the others
                self.output.handleError(record)
        if lines:
            self.output.stream.write("\n".join(lines) + "\n")
            self.output.flush()

    def stop(self) -> None:
        """Write what is pending and end."""
        self.stopping.set()
        self.join()


_writers: list[_Writer] = []


def configure(service: str, level: str = "INFO") -> None:
    """Send every log record to stderr as JSON lines, written by a thread of their own."""
    pending: queue.Queue[logging.LogRecord] = queue.Queue(PENDING_LINES)
    _stop_writers()  # configured again (tests): one writer at a time
    writer = _Writer(pending, JsonFormatter(service))
    _writers.append(writer)
    writer.start()
    # The lines carry none of the caller's file, line, thread or process names: skip
    # collecting them for every record (the logging HOWTO's "Optimization" knobs).
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [_HandOver(pending)]
    root.setLevel(level)
    logging.getLogger("dramatiq").setLevel(max(logging.getLevelName(level), logging.INFO))


def _stop_writers() -> None:
    """Write what is pending (at exit, or before a new configuration)."""
    while _writers:
        _writers.pop().stop()


atexit.register(_stop_writers)
