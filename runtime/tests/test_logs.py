"""Log lines: none is lost when the process exits at once, in order per thread, with tracebacks;
whole lines whatever stderr is (a pipe, a full pipe, a file)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import worker_runtime

SRC = Path(worker_runtime.__file__).resolve().parents[1]


def run(code: str) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC)},
        check=True,
    )
    return [json.loads(line) for line in done.stderr.splitlines()]


def test_every_line_is_written_though_the_process_exits_at_once() -> None:
    lines = run(
        """
        import logging, threading
        from worker_runtime import logs
        logs.configure("svc")
        log = logging.getLogger("t")
        def burst(t):
            for n in range(15_000):
                log.info("line %d", n, extra={"burst": t})
        threads = [threading.Thread(target=burst, args=(t,)) for t in range(2)]
        for t in threads: t.start()
        for t in threads: t.join()
        """
    )
    # 30,000 lines from two threads, the process exiting right after the last.
    assert len(lines) == 30_000
    for burst in (0, 1):
        mine = [line["msg"] for line in lines if line["burst"] == burst]
        assert mine == [f"line {n}" for n in range(15_000)], "in order, none lost"
    assert {line["service"] for line in lines} == {"svc"}


BURST = """
    import logging, threading
    from worker_runtime import logs
    logs.configure("svc")
    log = logging.getLogger("t")
    def burst(t):
        for n in range(5_000):
            log.info("line %d", n, extra={"burst": t, "pad": "x" * (n % 300)})
    threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    """


def check_bursts(text: str) -> None:
    lines = [json.loads(line) for line in text.splitlines()]  # each line whole JSON
    assert len(lines) == 20_000
    for burst in range(4):
        mine = [line["msg"] for line in lines if line["burst"] == burst]
        assert mine == [f"line {n}" for n in range(5_000)], "in order, none lost"


def test_a_full_pipe_loses_and_interleaves_nothing() -> None:
    # Nobody reads the pipe for a second: it fills, the one-call writes are refused
    # (the handler's own descriptor is non-blocking) and the lines wait in os.write.
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(BURST)],
        stderr=subprocess.PIPE,
        env={"PYTHONPATH": str(SRC)},
    )
    time.sleep(1.0)
    assert process.poll() is None, "the writer waits for the reader"
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0
    check_bursts(err.decode())


def test_lines_to_a_file_are_whole_and_in_order(tmp_path: Path) -> None:
    log = tmp_path / "err.log"
    with log.open("wb") as stderr:
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(BURST)],
            stderr=stderr,
            env={"PYTHONPATH": str(SRC)},
            timeout=60,
            check=True,
        )
    check_bursts(log.read_text())


def test_an_exception_is_formatted_with_its_traceback() -> None:
    (line,) = run(
        """
        import logging
        from worker_runtime import logs
        logs.configure("svc")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("t").exception("failed", extra={"job_id": "j"})
        """
    )
    assert line["msg"] == "failed" and line["job_id"] == "j" and line["level"] == "error"
    assert "ValueError: boom" in str(line["exc"])


def test_an_event_line_is_the_line_its_record_makes_without_making_the_record() -> None:
    lines = run(
        """
        import datetime, logging
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from worker_runtime import logs
        logs.configure("svc")
        log = logging.getLogger("worker_runtime.middleware.metrics")
        fields = {
            "event": "job_end", "job_id": "j", "big": 2**70, "_private": 1,
            "when": datetime.date(2026, 1, 2), "retries": 0,
        }
        trace.set_tracer_provider(TracerProvider())
        made = []
        make = logging.Logger.makeRecord
        def counted(self, *args, **kwargs):
            made.append(1)
            return make(self, *args, **kwargs)
        logging.Logger.makeRecord = counted
        for level in (logging.INFO, logging.WARNING):
            with trace.get_tracer("t").start_as_current_span("job"):
                log.log(level, "job %s", "retry", extra={**fields, "way": "record"})
                logs.event(log, level, "job %s", ("retry",), {**fields, "way": "event"})
        logs.event(log, logging.DEBUG, "job %s", ("x",), {"way": "below the level"})
        log.info("done", extra={"records_made": len(made)})
        """
    )
    *pairs, done = lines
    assert done["records_made"] == 2, "the two record-way lines only"
    assert [line["way"] for line in pairs] == ["record", "event"] * 2
    for record_way, event_way in zip(pairs[::2], pairs[1::2], strict=True):
        for line in (record_way, event_way):
            del line["ts"], line["way"]
            assert line["trace_id"] and line["big"] == 2**70 and line["when"] == "2026-01-02"
        assert list(event_way.items()) == list(record_way.items()), "same keys, same order"


def test_an_event_reaches_other_handlers_filters_and_record_factories_as_a_record() -> None:
    lines = run(
        """
        import logging
        from worker_runtime import logs
        logs.configure("svc")
        log = logging.getLogger("worker_runtime.middleware.metrics")
        def event(case):
            logs.event(log, logging.INFO, "job %s", ("success",), {"case": case})

        seen = []
        class Keep(logging.Handler):
            def emit(self, record):
                seen.append(record.case)
        keep = Keep()
        logging.getLogger("worker_runtime").addHandler(keep)
        event("another handler")
        logging.getLogger("worker_runtime").removeHandler(keep)

        log.addFilter(lambda record: False)
        event("a filter that drops it")
        log.filters.clear()

        plain = logging.getLogRecordFactory()
        def with_pod(*args, **kwargs):
            record = plain(*args, **kwargs)
            record.pod = "p-1"
            return record
        logging.setLogRecordFactory(with_pod)
        event("a record factory")
        logging.setLogRecordFactory(plain)

        logging.getLogger().handlers[0].setLevel(logging.ERROR)
        event("a handler above the level")
        logging.getLogger().handlers[0].setLevel(logging.NOTSET)

        logging.disable(logging.INFO)
        event("logging disabled")
        logging.disable(logging.NOTSET)

        event("nothing else")
        log.info("seen", extra={"seen": seen})
        """
    )
    assert [line.get("case") for line in lines[:-1]] == [
        "another handler",
        "a record factory",
        "nothing else",
    ]
    assert lines[1]["pod"] == "p-1", "the factory's attribute is on the line"
    assert lines[-1]["seen"] == ["another handler"]


def test_console_format_is_readable_at_a_desk() -> None:
    """LOG_FORMAT=console: local time, level, message, key=value fields, the traceback as
    text (not an escaped JSON string)."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import logging
                from worker_runtime import logs
                logs.configure("svc", "INFO", "console")
                log = logging.getLogger("t")
                log.info("job done", extra={"actor": "send", "duration_s": 0.25, "note": "a b"})
                try:
                    1 / 0
                except ZeroDivisionError:
                    log.exception("job failed", extra={"actor": "send"})
                """
            ),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC)},
        check=True,
    )
    lines = done.stderr.splitlines()
    stamp = r"\d\d:\d\d:\d\d\.\d\d\d"
    assert re.fullmatch(
        stamp + r' INFO    job done  actor=send duration_s=0\.25 note="a b"', lines[0]
    ), lines[0]
    assert re.fullmatch(stamp + r" ERROR   job failed  actor=send", lines[1]), lines[1]
    assert lines[2] == "Traceback (most recent call last):"
    assert lines[-1] == "ZeroDivisionError: division by zero"
    assert not any(line.startswith("{") for line in lines)
