"""Background threads never die of an unexpected exception: one JSON log line, then they go on.

Each test injects an exception into one thread's work (the recovery pass that also
keeps the heartbeat, the consumer's fetch, an exporter request) against a real
Redis, and proves the same thread carries on with the next piece of work.
"""

from __future__ import annotations

import json
import threading
import time
import types
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dramatiq
import dramatiq.worker
import pytest
import redis

from worker_runtime import accounting as recovery
from worker_runtime import layout
from worker_runtime.exporter import Exporter, _Handler, build_registry
from worker_runtime.logs import JsonFormatter
from worker_runtime.messages import inspect
from worker_runtime.middleware.recovery import Recovery
from worker_runtime.redisbroker import SettlingRedisBroker


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def logged(caplog: pytest.LogCaptureFixture, message: str) -> list[dict[str, Any]]:
    """The records whose message starts with ``message``, as the JSON lines they become."""
    formatter = JsonFormatter("test")
    lines = [formatter.format(r) for r in caplog.records if r.getMessage().startswith(message)]
    assert all("\n" not in line for line in lines)
    return [json.loads(line) for line in lines]


def test_recovery_thread_logs_an_unexpected_error_and_goes_on(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    passes: list[float] = []
    real = recovery.recover_dead_workers

    def flaky(*args: Any) -> tuple[int, int]:
        passes.append(time.monotonic())
        if len(passes) == 1:
            raise RuntimeError("injected")
        return real(*args)

    monkeypatch.setattr(recovery, "recover_dead_workers", flaky)
    client = redis.Redis.from_url(redis_url)
    broker: Any = types.SimpleNamespace(
        client=client,
        broker_id="w-test",
        reclaim_orphans=lambda now: 0,
        keep_time=lambda ms: None,
        observe_epochs=lambda epochs: None,
    )
    middleware = Recovery(["notifications"], 60_000, 3, interval_s=0.05)
    middleware.after_worker_boot(broker, None)  # type: ignore[arg-type]
    try:
        wait_for(lambda: len(passes) >= 3, 10, "two more recovery passes")
        client.delete(layout.HEARTBEATS)
        wait_for(lambda: client.zscore(layout.HEARTBEATS, "w-test"), 5, "the next heartbeat")
    finally:
        middleware.after_worker_shutdown(broker, None)  # type: ignore[arg-type]
    (line,) = logged(caplog, "recovery pass failed")
    assert line["level"] == "error" and "RuntimeError: injected" in line["exc"]


def test_consumer_thread_logs_an_unexpected_error_and_goes_on(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(dramatiq.worker, "CONSUMER_RESTART_DELAY_SECS", 0.05)
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    done: list[int] = []

    @dramatiq.actor(broker=broker, queue_name="background")
    def record(n: int) -> None:
        done.append(n)

    real = broker.fetch_script
    failures: list[str] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if any(key.endswith(":background") for key in kwargs["keys"]) and not failures:
            failures.append("injected")
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    broker.fetch_script = flaky
    for n in range(5):
        record.send(n)
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=50)
    worker.start()
    try:
        wait_for(lambda: sorted(done) == list(range(5)), 10, "every message after the error")
    finally:
        worker.stop()
        broker.close()
    assert failures == ["injected"]
    (line,) = logged(caplog, "Consumer encountered an unexpected error")
    assert "RuntimeError: injected" in line["exc"]
    assert not redis.Redis.from_url(redis_url).keys(layout.acks_pattern(broker.broker_id))


def test_exporter_logs_a_failed_request_and_goes_on(
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = build_registry(redis.Redis.from_url(redis_url), ["notifications"], str(tmp_path))
    settings: Any = types.SimpleNamespace(metrics_port=0)
    exporter = Exporter(settings, registry, host="127.0.0.1")
    threading.Thread(target=exporter.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{exporter.server_address[1]}/metrics"
    try:

        def broken(*args: Any, **kwargs: Any) -> None:
            raise ConnectionResetError("injected")

        with monkeypatch.context() as patch:
            patch.setattr(_Handler, "_send", broken)
            with pytest.raises(OSError):
                urllib.request.urlopen(url, timeout=5)
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
    finally:
        exporter.shutdown()
        exporter.server_close()
    (line,) = logged(caplog, "metrics request failed")
    assert "ConnectionResetError: injected" in line["exc"]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"\x80{", "body is not JSON"),
        (b"[1]", "body is a JSON list, must be an object"),
        (b'{"queue_name": "q"}', "no actor_name"),
        (b"null", "body is a JSON null, must be an object"),
    ],
)
def test_inspect_names_what_is_wrong(body: bytes, problem: str) -> None:
    found, message, _ = inspect(body, "q", "id-1", None)
    assert found is not None and found.startswith(problem) and message is None


def test_inspect_names_wrong_fields_of_a_message() -> None:
    fields: dict[str, Any] = {
        "queue_name": "q",
        "actor_name": "a",
        "args": [],
        "kwargs": {},
        "options": {"redis_message_id": "id-1"},
        "message_id": "m",
        "message_timestamp": 1,
    }

    def check(**changes: Any) -> str | None:
        problem, _, _ = inspect(json.dumps({**fields, **changes}).encode(), "q", "id-1", {"a"})
        return problem

    assert check() is None
    assert check(options=None) == "options is null, must be an object"
    assert check(options={}) == "no options.redis_message_id"
    assert check(options={"redis_message_id": "id-2"}) == (
        "options.redis_message_id 'id-2' is not its id 'id-1'"
    )
    assert check(actor_name="b") == "unknown actor 'b' (none declared here)"
    assert check(queue_name="q.DQ") == "queue_name 'q.DQ' is not its queue 'q'"
    assert check(extra=1) == "unexpected fields extra"
    assert check(options={"redis_message_id": "id-1", "retries": "x"}) == (
        'options.retries is "x", must be an integer'
    )
    assert check(message_timestamp=True) == "message_timestamp is true, must be a number"
