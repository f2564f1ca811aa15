"""Unique jobs (issue #42 item 3): the cost of a unique send against a plain one, side by
side in one run.

    python bench/unique_bench.py [--rounds 40] [--sends 250]

One producer (the runtime's test service, ``runtime/tests/templateservice.py``, as an API process
builds it: only ``REDIS_URL``) on a fresh redis-server sends ``send_notification`` three
ways, in short rounds alternating (each round starts with the next way), so that a load
that drifts meanwhile weighs on the three alike:

* ``plain``: a new message each send;
* ``unique``: each with ``unique=Unique(key="notification_id", ...)``, every key new (the
  lock is taken: one more key written in the same Lua call);
* ``skipped``: the same key each send after the first (the lock is held: ``DuplicateJob``
  raised and caught, nothing stored).

Per way: the median over rounds of the µs a send takes (the producer's wall time, encoding
and the round trip included); the ratios ``unique / plain`` and ``skipped / plain``, of the
medians and (``paired_*``) the median of each round's own ratio.
Writes ``bench/results/unique_bench-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "runtime" / "tests"))

import _results
import _workers

WAYS = ("plain", "unique", "skipped")


def run_way(way: str, actor: Any, round_: int, sends: int) -> float:
    """µs per send of ``sends`` sends the ``way`` way."""
    from worker_runtime.unique import DuplicateJob, Unique

    spec = Unique(key="notification_id", ttl_ms=600_000)
    started = time.perf_counter()
    for n in range(sends):
        notification = f"{way}-{round_}-{n}" if way != "skipped" else f"skip-{round_}"
        if way == "plain":
            actor.send(7, "welcome", notification)
            continue
        try:
            actor.send_with_options(args=(7, "welcome", notification), unique=spec)
        except DuplicateJob:
            pass
    return (time.perf_counter() - started) / sends * 1e6


def paired(timings: dict[str, list[float]], way: str) -> float:
    ratios = [a / b for a, b in zip(timings[way], timings["plain"], strict=True)]
    return round(statistics.median(ratios), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--sends", type=int, default=250)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        server = _workers.redis_server(Path(folder) / "redis")
        try:
            os.environ["REDIS_URL"] = server.url
            os.environ.pop("WORKER_POOL", None)
            import templateservice  # the runtime's test service, rendered from the template

            sys.path.insert(0, str(templateservice.render()))
            import service  # its actors, on a producer's broker
            from worker_runtime.actors import load

            assert service.SERVICE
            broker = load()
            actor = broker.actors["send_notification"]
            run_way("plain", actor, -1, 200)  # warm: connections, scripts loaded
            run_way("unique", actor, -1, 200)
            timings: dict[str, list[float]] = {way: [] for way in WAYS}
            for round_ in range(options.rounds):
                order = WAYS[round_ % 3 :] + WAYS[: round_ % 3]
                for way in order:
                    timings[way].append(run_way(way, actor, round_, options.sends))
                    broker.client.flushall()  # type: ignore[attr-defined]
        finally:
            server.stop()
    medians = {way: statistics.median(values) for way, values in timings.items()}
    results = {
        "us_per_send": {way: round(value, 1) for way, value in medians.items()},
        "unique_over_plain": round(medians["unique"] / medians["plain"], 3),
        "skipped_over_plain": round(medians["skipped"] / medians["plain"], 3),
        # the median of each round's own ratio (the three ways of a round ran side by side)
        "paired_unique_over_plain": paired(timings, "unique"),
        "paired_skipped_over_plain": paired(timings, "skipped"),
        "rounds": options.rounds,
        "sends_per_round": options.sends,
        "all_us": {way: [round(v, 1) for v in values] for way, values in timings.items()},
    }
    print(results)
    _results.write("unique_bench", results)


if __name__ == "__main__":
    main()
