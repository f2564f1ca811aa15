"""Log lines: none is lost when the process exits at once, in order per thread, with tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import {{ cookiecutter.package }}

SRC = Path({{ cookiecutter.package }}.__file__).resolve().parents[1]


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
        from {{ cookiecutter.package }} import logs
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


def test_an_exception_is_formatted_with_its_traceback() -> None:
    (line,) = run(
        """
        import logging
        from {{ cookiecutter.package }} import logs
        logs.configure("svc")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("t").exception("failed", extra={"job_id": "j"})
        """
    )
    assert line["msg"] == "failed" and line["job_id"] == "j" and line["level"] == "error"
    assert "ValueError: boom" in str(line["exc"])
