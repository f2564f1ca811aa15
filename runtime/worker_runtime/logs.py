"""JSON-lines logging: one object per line, with the service name and any ``extra`` fields.

``LOG_FORMAT=console`` writes the same records for a person at a desk instead
(:class:`ConsoleFormatter`): local time, level, message, ``key=value`` fields and
tracebacks as text. JSON stays the default: it is what production's log pipeline reads.

A line logged while a span is current (a job's lines, with tracing on) carries its
``trace_id`` and ``span_id``, so logs and traces join.

Each line reaches stderr in one ``write(2)`` before the logging call returns, so a
process killed the next moment keeps it. In a busy worker that write takes no lock
that another handler thread could be kept waiting on (see :class:`LineHandler`), and
a line logged once per job goes through :func:`event`: when our handler alone would
see its record, the handler writes the line without the record being made.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import logging
import os
import select
import stat
import sys
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

import orjson
from opentelemetry import trace

_PROCESS = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PROCESS.__setitem__(0, os.getpid()))


def _pid() -> int:
    """This process's id, without a system call per line (kept right across a fork)."""
    return _PROCESS[0]


_RECORD_FIELDS = vars(logging.LogRecord("", 0, "", 0, "", None, None))
_STANDARD = set(_RECORD_FIELDS) | {"message", "asctime"}
#: A record's own attributes come first; ``extra`` fields are added after them.
_N_RECORD_FIELDS = len(_RECORD_FIELDS)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object; ``extra={...}`` fields become top-level keys.

    Parameters:
      service: the ``service`` key of every line (``OTEL_SERVICE_NAME``).
    """

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = self.fields(record.created, record.levelname, record.name, record.getMessage())
        line.update(_extras(itertools.islice(vars(record).items(), _N_RECORD_FIELDS, None)))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return _dumps(line).decode()

    def fields(self, created: float, level: str, logger: str, message: str) -> dict[str, Any]:
        """The keys every line starts with (an ``extra`` field comes after them)."""
        line: dict[str, Any] = {
            "ts": round(created, 3),
            "level": level.lower(),
            "logger": logger,
            "service": self.service,
            "pid": _pid(),
            "msg": message,
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            line["trace_id"] = trace.format_trace_id(span.trace_id)
            line["span_id"] = trace.format_span_id(span.span_id)
        return line


class ConsoleFormatter(logging.Formatter):
    """Formats a record for a terminal: ``HH:MM:SS.mmm LEVEL   message  key=value ...``,
    then the traceback, if any, as Python prints it.

    Parameters:
      service: unused (the terminal knows what runs in it); kept so both formats are
        made alike.
    """

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        millis = int(record.created * 1000) % 1000
        fields = _extras(itertools.islice(vars(record).items(), _N_RECORD_FIELDS, None))
        shown = " ".join(f"{key}={_console_value(value)}" for key, value in fields.items())
        line = f"{stamp}.{millis:03d} {record.levelname:<7} {record.getMessage()}"
        if shown:
            line = f"{line}  {shown}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


def _console_value(value: Any) -> str:
    """A field's value as the console shows it: plain when it has no space, else JSON."""
    text = value if isinstance(value, str) else _dumps(value).decode()
    if text and not any(char.isspace() or char in '"=' for char in text):
        return text
    return json.dumps(text) if isinstance(value, str) else text


def _extras(fields: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The ``extra`` fields a line shows: not a record attribute, not private."""
    return {key: value for key, value in fields if key not in _STANDARD and key[:1] != "_"}


def _dumps(line: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(line, default=str)
    except orjson.JSONEncodeError:  # e.g. an int beyond 64 bits: the standard library's way
        return json.dumps(line, default=str).encode()


def event(
    logger: logging.Logger, level: int, msg: str, args: tuple[Any, ...], fields: dict[str, Any]
) -> None:
    """``logger.log(level, msg, *args, extra=fields)`` for a line logged once per job.

    When the record would reach our :class:`LineHandler` alone (see :func:`sole_handler`),
    the handler writes the line the record would have made, without the record: making
    and dispatching a LogRecord costs more than the line's own rendering and write, and
    in a busy worker that cost is paid per job. Anything else in the way (another
    handler, a filter, a record factory, a logger class of its own) gets the record,
    as ``logger.log`` makes it.
    """
    if not logger.isEnabledFor(level):
        return
    handler = sole_handler(logger, level)
    if handler is None or not handler.write_event(level, logger.name, msg, args, fields):
        logger.log(level, msg, *args, extra=fields)


#: The logger classes whose records :func:`event` may leave unmade (no handle() of their own).
_PLAIN_LOGGERS = (logging.Logger, logging.RootLogger)


def sole_handler(logger: logging.Logger, level: int) -> LineHandler | None:
    """The :class:`LineHandler` that alone would handle ``logger``'s records at ``level``,
    formatting them with a :class:`JsonFormatter`; None when a record would meet anything
    else (a filter, another handler, a record factory, a Logger or formatter subclass)."""
    if logging.getLogRecordFactory() is not logging.LogRecord:
        return None
    handlers: list[logging.Handler] = []
    current: logging.Logger | None = logger
    while current is not None:
        if type(current) not in _PLAIN_LOGGERS or current.filters or current.disabled:
            return None
        handlers += current.handlers
        current = current.parent if current.propagate else None
    if len(handlers) != 1:
        return None
    handler = handlers[0]
    if (
        type(handler) is not LineHandler
        or handler.filters
        or handler.fd is None
        or level < handler.level
        or type(handler.formatter) is not JsonFormatter
    ):
        return None
    return handler


def _libc_write() -> Any:
    """The C library's ``write(2)``, called with the interpreter lock held (``ctypes.PyDLL``);
    None where it cannot be loaded."""
    try:
        write = ctypes.PyDLL(None, use_errno=True).write
    except (OSError, AttributeError):
        return None
    write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t
    return write


class LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler that writes each line to its stream's descriptor in one ``write(2)``.

    StreamHandler takes the handler's lock around each write and ``os.write``
    releases the interpreter lock during it. With a dozen handler threads logging a
    line per job, a thread that loses the interpreter lock while it holds the
    handler's one makes the others queue behind it: a line then cost three times
    its own work (measured with 8 threads). This handler needs neither:

    * A line of at most ``PIPE_BUF`` bytes goes out in one ``write(2)`` made with
      the interpreter lock held, which no other thread of the process can
      interleave with: to a regular file as it is (it never waits for a reader),
      to a pipe (a container's stderr) through a descriptor of its own opened
      non-blocking, so the write takes the whole line or nothing (POSIX) and never
      waits while holding the lock.
    * Otherwise (a full pipe, a longer line, a partial write, another kind of
      stream) the rest goes through ``os.write`` under the handler's lock, which
      waits without holding the interpreter lock.

    The line is formatted before anything is locked. A stream without a descriptor
    (a test's capture) is written as StreamHandler does.

    Parameters:
      stream: where the lines go (default ``sys.stderr``).
    """

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self.fd = _fileno(self.stream)
        self._write_now: Callable[[int, bytes, int], int] | None = (
            _libc_write() if self.fd is not None else None
        )
        #: The descriptor of the one-call writes (None: every write takes the slow way).
        self._fast_fd = _fast_descriptor(self.fd) if self._write_now is not None else None

    def handle(self, record: logging.LogRecord) -> bool:
        """Filter ``record``, then :meth:`emit` it without taking the handler's lock first."""
        if self.fd is None:
            return super().handle(record)
        passed = self.filter(record)
        if isinstance(passed, logging.LogRecord):  # Python 3.12+: a filter may replace it
            record = passed
        if passed:
            self.emit(record)
        return bool(passed)

    def emit(self, record: logging.LogRecord) -> None:
        """Format ``record``, then write it (see the class docstring)."""
        if self.fd is None:
            super().emit(record)
            return
        try:
            self._write((self.format(record) + self.terminator).encode("utf-8", "backslashreplace"))
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)

    def write_event(
        self, level: int, logger: str, msg: str, args: tuple[Any, ...], fields: dict[str, Any]
    ) -> bool:
        """Write the line :class:`JsonFormatter` makes of a record of ``logger`` at ``level``
        with ``msg % args`` and the ``extra`` ``fields``, without the record (see
        :func:`event`). False when it could not (the caller then logs the record, whose
        way reports the error)."""
        formatter = self.formatter
        if self.fd is None or not isinstance(formatter, JsonFormatter):
            return False
        try:
            message = msg % args if args else msg  # as LogRecord.getMessage makes it
            line = formatter.fields(time.time(), logging.getLevelName(level), logger, message)
            line.update(_extras(fields.items()))
            self._write(_dumps(line) + self.terminator.encode())
        except Exception:
            return False
        return True

    def _write(self, line: bytes) -> None:
        sent, write_now = 0, self._write_now
        if self._fast_fd is not None and write_now is not None and len(line) <= select.PIPE_BUF:
            sent = max(0, write_now(self._fast_fd, line, len(line)))
            if sent == len(line):
                return
        assert self.fd is not None
        view = memoryview(line)
        with self.lock:  # type: ignore[union-attr]
            while sent < len(line):
                try:
                    sent += os.write(self.fd, view[sent:])
                except InterruptedError:
                    continue
                except BlockingIOError as error:  # a non-blocking descriptor that is full
                    if error.errno != errno.EAGAIN:
                        raise
                    select.select([], [self.fd], [])

    def close(self) -> None:
        if self._fast_fd is not None and self._fast_fd != self.fd:
            os.close(self._fast_fd)
        self._fast_fd = None
        super().close()


def _fast_descriptor(fd: int | None) -> int | None:
    """Where a one-call write of ``fd``'s lines goes: ``fd`` itself for a regular file, a new
    non-blocking descriptor of the same pipe for a pipe; None for anything else."""
    if fd is None:
        return None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return fd
        if stat.S_ISFIFO(mode):
            # A pipe opened again through /proc is a new open file description: O_NONBLOCK
            # here leaves stderr itself (shared with other processes) as it was.
            return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    return None


def _fileno(stream: IO[str]) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def own_standard_streams() -> None:
    """Give ``sys.stdout`` and ``sys.stderr`` descriptors of this process's own (duplicates
    of 1 and 2, not inherited by children), before :func:`configure`: a handler (or a
    library) that closes descriptor 1 or 2 then changes nothing of where the worker's log
    lines and prints go, and a file opened later on 1 or 2 (a Redis connection, a metrics
    file) never receives one. A stream without a descriptor (a test's capture) is kept."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        fd = _fileno(stream)
        if fd is None or fd > 2:
            continue
        try:
            own = os.fdopen(
                os.dup(fd), "w", buffering=1, encoding=stream.encoding, errors=stream.errors
            )
        except OSError:
            continue
        setattr(sys, name, own)


def configure(service: str, level: str = "INFO", log_format: str = "json") -> None:
    """Send every log record to stderr, each line written before the logging call returns
    (a process killed the next moment keeps it).

    Parameters:
      service: the ``service`` key of the JSON lines (``OTEL_SERVICE_NAME``).
      level: the root logger's level (``LOG_LEVEL``, default INFO).
      log_format: ``json`` (default) or ``console`` (``LOG_FORMAT``).
    """
    handler = LineHandler(sys.stderr)
    formatter = ConsoleFormatter if log_format == "console" else JsonFormatter
    handler.setFormatter(formatter(service))
    # The lines carry none of the caller's file, line, thread or process names: skip
    # collecting them for every record (the logging HOWTO's "Optimization" knobs).
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False
    logging.logProcesses = False  # the formatter takes the pid from :func:`_pid`
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("dramatiq").setLevel(max(logging.getLevelName(level), logging.INFO))
