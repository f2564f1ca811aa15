"""Capacity: throughput against concurrency, and the level where it stops rising.

    capacity --actor NAME [--args JSON] [--kwargs JSON] [--jobs N]
             [--concurrency 1,2,4,8,16] [--rounds 3] [--min-gain 0.1] [--timeout S]
             [--json]

In each of ``--rounds`` rounds (default 3), for each concurrency level ``c``,
lowest first, it:

1. enqueues ``--jobs`` messages (default 200) of the actor with ``--args`` and
   ``--kwargs`` on the actor's queue;
2. starts this service's own ``worker`` command as a subprocess, configured as
   the queue's pool in pools.toml except for ``WORKER_CONCURRENCY=c``,
   ``WORKER_PROCESSES=1``, ``WORKER_QUEUES=<the queue>`` (and ``DB_POOL_SIZE``
   at least ``c``), with a private ``WORKER_STATE_DIR`` and ``METRICS_PORT``,
   against ``REDIS_URL``: the real middleware stack, actor and broker;
3. polls the queue every few milliseconds and times the steady state: the clock
   starts once ``c`` jobs are done and stops once all but ``c`` are, and
   throughput is the jobs done in between over that time. The first wave (the
   worker's boot, ``c`` jobs begun together) and the last (fewer jobs left than
   threads) are not timed: timing from the first job done would count ``c - 1``
   jobs already under way as done in the window and favour higher levels (by
   25 % at ``c`` = 4 with 16 jobs). So ``--jobs`` must be a few times the
   highest level (its help says how many);
4. stops the worker with SIGTERM, its normal drain. The worker is also sent SIGTERM
   when the probe itself dies (killed, even with SIGKILL): it never outlives the probe.

A level's throughput is its best round: other load on the machine only slows a
round, and alternating the levels spreads a burst of it over all of them. It
then reports, per level, that jobs/s, every round's and the gain over the level
before; where throughput stops rising: the lowest level that no higher level
beats by ``--min-gain`` (default 10 %) or more; and, when a level's rounds
differ by more than ``NOISY_SPREAD`` (25 %), that something else ran and the
verdict may be wrong. An I/O-bound handler scales with threads until something
downstream saturates; a CPU-bound one stops at 1, because of
the GIL: give it processes or replicas, not threads.

Dramatiq's key namespace is fixed, so the probe runs on the actor's real queue.
So that it never mixes with production traffic it refuses to start while that
queue holds any message (ready, running or delayed); run it where no other
worker serves the queue (a local or staging Redis), since another worker would
take probe jobs and skew the numbers. A probe job that fails (retried or
dead-lettered) aborts the measurement: capacity is measured with jobs that
succeed. Probe messages left behind by an abort are removed. The probe runs the
real actor: pick one, and arguments, whose side effects are harmless, and levels
that the downstream resources it calls can take.

The result (what ``--json`` prints, and when it was measured) is also kept in Redis as
the queue's last capacity result, which the web console's Capacity page draws as a chart.

Exit codes: 0 measured, 1 refused or aborted (one line says why), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from worker_runtime import layout, service
from worker_runtime.cli.args import command_parser, positive_int
from worker_runtime.exitcodes import EX_FAILURE, EX_INTERRUPTED, EX_OK
from worker_runtime.layout import QueueKeys
from worker_runtime.parentdeath import stop_with_parent
from worker_runtime.pools import Concurrency, bounds
from worker_runtime.timing import KILL_AFTER_DRAIN_S

if TYPE_CHECKING:
    import dramatiq
    import redis

DEFAULT_LEVELS = (1, 2, 4, 8, 16)
#: Seconds between two looks at the queue while the worker runs.
POLL_INTERVAL_S = 0.005
#: A level whose timed jobs take less than this to run is too fast to time: enqueue more.
MIN_WINDOW_S = 0.2
#: ``--jobs`` at least this many times the highest level: half of them or more are timed.
TIMED_SHARE = 4
#: A level whose best round beats its slowest by more than this was measured on a busy
#: machine; the report says so.
NOISY_SPREAD = 0.25
#: Lines of the worker's log shown when it fails.
LOG_TAIL = 5


class CapacityError(Exception):
    """The measurement cannot start or cannot go on; the message says why."""


@dataclass(frozen=True)
class Probe:
    """What to measure.

    Parameters:
      actor: the actor, as declared on the broker.
      args, kwargs: the arguments of every probe job.
      jobs: jobs per concurrency level.
      timeout_s: the longest one level may take (default 300 s).
    """

    actor: dramatiq.Actor[Any, Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    jobs: int = 200
    timeout_s: float = 300.0

    @property
    def queue(self) -> str:
        return str(self.actor.queue_name)


@dataclass(frozen=True)
class Level:
    """The throughput measured at one concurrency (its best round), and its gain over the
    level before."""

    concurrency: int
    jobs_per_s: float
    gain: float | None = None
    rounds: tuple[float, ...] = ()

    @property
    def spread(self) -> float:
        """How much the best round beats the slowest (0 with one round)."""
        return max(self.rounds) / min(self.rounds) - 1 if self.rounds else 0.0


def free_port() -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def messages_in(client: redis.Redis, queue: str) -> int:
    """Messages ``queue`` holds: ready, running (fetched, not acked) or delayed."""
    keys = QueueKeys.of(queue)
    pipe = client.pipeline(transaction=False)
    pipe.hlen(keys.ready_bodies)
    pipe.hlen(keys.delayed_bodies)
    return sum(int(size) for size in pipe.execute())


def enqueue(probe: Probe) -> set[str]:
    """Send ``probe.jobs`` messages; return their message ids."""
    return {
        probe.actor.send_with_options(args=probe.args, kwargs=probe.kwargs).message_id
        for _ in range(probe.jobs)
    }


def message_id_of(body: bytes | str) -> str | None:
    """The ``message_id`` of a stored message body, or None when it is not one."""
    fields = layout.message_fields(body)
    return None if fields is None else str(fields.get("message_id"))


def remove(client: redis.Redis, queue: str, message_ids: set[str]) -> int:
    """Delete the messages ``message_ids`` from ``queue``, its delay queue and dead letters.

    For an aborted measurement, once its worker has stopped. Returns how many.
    """
    keys = QueueKeys.of(queue)
    removed = 0
    for listing, bodies in (
        (keys.ready, keys.ready_bodies),
        (keys.delayed, keys.delayed_bodies),
        (keys.dead, keys.dead_bodies),
    ):
        for raw_id, body in client.hgetall(bodies).items():
            redis_id = layout.text(raw_id)
            if message_id_of(body) not in message_ids:
                continue
            if listing == keys.dead:
                client.zrem(listing, redis_id)
            else:
                if listing == keys.delayed:
                    client.zrem(keys.due, redis_id)
                client.lrem(listing, 0, redis_id)
            removed += int(client.hdel(bodies, redis_id))
    return removed


def failure_reason(client: redis.Redis, queue: str) -> str:
    """Why the latest probe job failed: its dead-letter reason or its traceback's last line."""
    from worker_runtime.deadletters.store import DeadLetter

    keys = QueueKeys.of(queue)
    newest = cast(list[bytes], client.zrange(keys.dead, -1, -1))
    bodies: list[Any] = [client.hget(keys.dead_bodies, redis_id) for redis_id in newest]
    bodies += client.hvals(keys.delayed_bodies)[:1]
    for body in bodies:
        if body is not None:
            return DeadLetter(queue, "", 0, layout.raw_bytes(body)).reason
    return "reason unknown"


def worker_environment(
    probe: Probe,
    pool: str,
    concurrency: int,
    state_dir: Path,
) -> dict[str, str]:
    """The environment of the probe's worker: the pool's own config, ``concurrency`` threads.

    ``WORKER_*`` and ``DB_POOL_SIZE`` of this process are not passed on (they may
    belong to another pool); ``WORKER_POOLS_FILE`` is.
    """
    from worker_runtime.settings import database_enabled, pools

    env = {
        name: value
        for name, value in os.environ.items()
        if name == "WORKER_POOLS_FILE" or not name.startswith(("WORKER_", "DB_POOL_SIZE"))
    }
    env.update(
        WORKER_POOL=pool,
        WORKER_QUEUES=probe.queue,
        WORKER_CONCURRENCY=str(concurrency),
        WORKER_PROCESSES="1",
        WORKER_STATE_DIR=str(state_dir),
        METRICS_PORT=str(free_port()),
    )
    if database_enabled():
        own = pools().pools[pool].effective_db_pool_size
        env["DB_POOL_SIZE"] = str(max(own, concurrency))
    return env


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Run this service's ``worker`` command with ``env``, its output going to ``log``.

    The worker is told to drain (SIGTERM) when the probe dies, however it dies: a probe
    killed mid-measurement never leaves a worker behind taking jobs from the queue.
    """
    package = service.current().package  # the service's CLI (python -m <package>)
    with log.open("wb") as output:
        return subprocess.Popen(
            [sys.executable, "-m", package, "worker"],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            preexec_fn=stop_with_parent(os.getpid()),
        )


def stop_worker(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM (the worker drains), then SIGKILL if it is still running after ``timeout_s``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def tail(log: Path, lines: int = LOG_TAIL) -> str:
    """The last ``lines`` lines of ``log``, indented."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return "".join(f"\n    {line}" for line in text.splitlines()[-lines:])


def time_jobs(
    client: redis.Redis,
    probe: Probe,
    concurrency: int,
    worker: subprocess.Popen[bytes],
    log: Path,
    dead_before: int,
) -> float:
    """Watch the queue until the probe's jobs are done; return jobs per second from the
    ``concurrency``-th job done to the last but ``concurrency`` (the steady state).

    Raises:
      CapacityError: when a job fails, the worker exits, ``probe.timeout_s`` passes,
        or the jobs are done too fast to time.
    """
    keys = QueueKeys.of(probe.queue)
    deadline = time.monotonic() + probe.timeout_s
    samples: list[tuple[float, int]] = []  # (time, jobs done) at each look
    while True:
        pipe = client.pipeline(transaction=False)
        pipe.hlen(keys.ready_bodies)
        pipe.hlen(keys.delayed_bodies)
        pipe.zcard(keys.dead)
        pending, retried, dead = (int(value) for value in pipe.execute())
        now = time.monotonic()
        failed = retried + dead - dead_before
        if failed:
            raise CapacityError(
                f"{failed} probe job(s) failed ({failure_reason(client, probe.queue)}); "
                "capacity is measured with jobs that succeed"
            )
        samples.append((now, probe.jobs - pending))
        if pending == 0:
            break
        if worker.poll() is not None:
            raise CapacityError(f"the worker exited with code {worker.returncode}:{tail(log)}")
        if now > deadline:
            raise CapacityError(
                f"{pending} of {probe.jobs} jobs still pending after "
                f"{probe.timeout_s:g} s (--timeout)"
            )
        time.sleep(POLL_INTERVAL_S)
    return steady_rate(samples, probe.jobs, concurrency)


def steady_rate(samples: list[tuple[float, int]], jobs: int, concurrency: int) -> float:
    """Jobs per second in the steady state of one level, from ``samples`` of
    ``(time, jobs done)`` taken while ``jobs`` jobs ran at ``concurrency``.

    The clock starts at the first sample with ``concurrency`` jobs done and stops at the
    first with all but ``concurrency`` done; the rate is the jobs done in between over
    that time. The first wave (``concurrency`` jobs begun together at the worker's boot)
    and the last (fewer jobs left than threads) are not timed.

    Raises:
      CapacityError: when the timed jobs took less than ``MIN_WINDOW_S``.
    """
    start = next(sample for sample in samples if sample[1] >= concurrency)
    stop = next(sample for sample in samples if sample[1] >= jobs - concurrency)
    window, counted = stop[0] - start[0], stop[1] - start[1]
    if not counted or window < MIN_WINDOW_S:
        raise CapacityError(
            f"the {counted} timed jobs of {jobs} were done in {window:.3f} s, too fast "
            "to time; give more --jobs"
        )
    return counted / window


def measure(client: redis.Redis, probe: Probe, pool: str, concurrency: int) -> float:
    """Jobs per second of ``probe`` run by a worker of ``pool`` with ``concurrency`` threads."""
    from worker_runtime.settings import pools

    drain_s = pools().pools[pool].shutdown_timeout_ms / 1000 + KILL_AFTER_DRAIN_S
    if messages_in(client, probe.queue):
        raise CapacityError(
            f"queue {probe.queue!r} holds messages; the probe runs only on an "
            "idle queue, so it never mixes with real traffic"
        )
    keys = QueueKeys.of(probe.queue)
    dead_before = int(client.zcard(keys.dead))
    message_ids = enqueue(probe)
    with tempfile.TemporaryDirectory(prefix="capacity-") as state:
        log = Path(state) / "worker.log"
        env = worker_environment(probe, pool, concurrency, Path(state) / "state")
        worker = start_worker(env, log)
        try:
            return time_jobs(client, probe, concurrency, worker, log, dead_before)
        finally:
            stop_worker(worker, drain_s)
            if messages_in(client, probe.queue) or client.zcard(keys.dead) > dead_before:
                remove(client, probe.queue, message_ids)


def with_gains(measured: dict[int, list[float]]) -> list[Level]:
    """Each level's rounds (concurrency -> jobs/s of each round, lowest level first) as
    levels: the best round, with the gain over the level before."""
    levels: list[Level] = []
    for concurrency, rounds in measured.items():
        rate = max(rounds)
        gain = rate / levels[-1].jobs_per_s - 1 if levels else None
        levels.append(Level(concurrency, rate, gain, tuple(rounds)))
    return levels


def stops_rising_at(levels: list[Level], min_gain: float) -> int | None:
    """The lowest level that no higher level beats by ``min_gain`` or more.

    None when that is the highest level measured and it still gained ``min_gain``
    over the one before: throughput was still rising. Judging each level against
    every higher one, not only the next, keeps one noisy level from hiding a rise.
    """
    for index, level in enumerate(levels[:-1]):
        best = max(higher.jobs_per_s for higher in levels[index + 1 :])
        if best < level.jobs_per_s * (1 + min_gain):
            return level.concurrency
    return None


def noisy(levels: list[Level]) -> list[int]:
    """The levels whose rounds differ by more than ``NOISY_SPREAD``."""
    return [level.concurrency for level in levels if level.spread > NOISY_SPREAD]


def noise_warning(levels: list[Level]) -> str | None:
    """A line saying which levels were measured on a busy machine; None when none was."""
    busy = noisy(levels)
    if not busy:
        return None
    worst = max(level.spread for level in levels)
    return (
        f"the rounds of concurrency {', '.join(map(str, busy))} differ by up to {worst:.0%}: "
        "something else ran on this machine, and the verdict may be wrong; measure again "
        "where nothing else runs"
    )


def verdict(levels: list[Level], min_gain: float, configured: int) -> str:
    """A sentence or two on where throughput stops rising, and what that means."""
    knee = stops_rising_at(levels, min_gain)
    if knee is None:
        return (
            f"throughput still rises at concurrency {levels[-1].concurrency}, the highest "
            "level measured; measure higher levels"
        )
    at_knee = next(level for level in levels if level.concurrency == knee)
    best = max((level for level in levels if level.concurrency > knee), key=_rate)
    text = (
        f"throughput stops rising at concurrency {knee}: no higher level gains "
        f"{min_gain:.0%} over it (best: concurrency {best.concurrency}, "
        f"{best.jobs_per_s / at_knee.jobs_per_s - 1:+.0%})"
    )
    if knee == 1:
        text += (
            "\nmore threads do not help: the handler is CPU-bound (or holds a lock); "
            "scale it with WORKER_PROCESSES or replicas, not WORKER_CONCURRENCY"
        )
    elif configured > knee:
        text += f"\nthe pool runs concurrency {configured}, above that level"
    return text


def _rate(level: Level) -> float:
    return level.jobs_per_s


def _row(concurrency: object, rate: object, gain: object, rounds: object) -> str:
    return f"{concurrency!s:>11}  {rate!s:>10}  {gain!s:>7}  {rounds!s}"


def _probe(args: argparse.Namespace) -> Probe:
    from dramatiq.errors import ActorNotFound

    from worker_runtime.actors import load

    broker = load()  # every actor declared on the service's broker

    try:
        actor = broker.get_actor(args.actor)
    except ActorNotFound:
        names = ", ".join(sorted(broker.actors))
        raise CapacityError(f"no actor named {args.actor!r} (actors: {names})") from None
    return Probe(actor, tuple(args.args), args.kwargs, args.jobs, args.timeout)


def run(args: argparse.Namespace) -> int:
    """The ``capacity`` command."""
    import redis

    from worker_runtime.settings import load_settings, mask_url, pools

    try:
        probe = _probe(args)
        highest = args.concurrency[-1]
        if probe.jobs < TIMED_SHARE * highest:
            raise CapacityError(
                f"--jobs {probe.jobs} is too few to time concurrency {highest}: give at least "
                f"{TIMED_SHARE * highest} (a level's first and last {highest} are not timed)"
            )
        pool = pools().pool_of_queue(probe.queue) or ""
        client = probe.actor.broker.client  # type: ignore[attr-defined]
        if not args.json:
            plural = "s" if args.rounds > 1 else ""
            print(
                f"actor {args.actor!r} on queue {probe.queue!r} (pool {pool}), "
                f"{probe.jobs} jobs per level, best of {args.rounds} round{plural}\n"
            )
            print(_row("concurrency", "jobs/s", "gain", "rounds"), flush=True)
        measured: dict[int, list[float]] = {concurrency: [] for concurrency in args.concurrency}
        for number in range(1, args.rounds + 1):
            for concurrency in args.concurrency:
                measured[concurrency].append(measure(client, probe, pool, concurrency))
                if number < args.rounds and not args.json:  # progress, before the rows
                    print(
                        f"round {number} of {args.rounds}: concurrency {concurrency}, "
                        f"{measured[concurrency][-1]:.1f} jobs/s",
                        file=sys.stderr,
                        flush=True,
                    )
                if number == args.rounds and not args.json:  # the level's row is complete
                    so_far = {c: rates for c, rates in measured.items() if c <= concurrency}
                    level = with_gains(so_far)[-1]
                    gain = "-" if level.gain is None else f"{level.gain:+.0%}"
                    rounds = " ".join(f"{rate:.1f}" for rate in level.rounds)
                    print(_row(concurrency, f"{level.jobs_per_s:.1f}", gain, rounds), flush=True)
    except CapacityError as error:
        print(f"capacity: {error}", file=sys.stderr)
        return EX_FAILURE
    except redis.RedisError as error:
        url = mask_url(load_settings().redis_url.get_secret_value())
        unreachable = isinstance(error, redis.ConnectionError | redis.TimeoutError)
        problem = "is unreachable" if unreachable else "failed"
        print(f"capacity: Redis at {url} {problem}: {error}", file=sys.stderr)
        return EX_FAILURE
    except KeyboardInterrupt:
        print(
            "capacity: interrupted (the probe's worker stopped, its messages removed)",
            file=sys.stderr,
        )
        return EX_INTERRUPTED
    levels = with_gains(measured)
    warning = noise_warning(levels)
    said = verdict(levels, args.min_gain, pools().pools[pool].concurrency)
    result = {
        "actor": args.actor,
        "queue": probe.queue,
        "pool": pool,
        "jobs": probe.jobs,
        "rounds": args.rounds,
        "min_gain": args.min_gain,
        "levels": [level.__dict__ for level in levels],
        "stops_rising_at": stops_rising_at(levels, args.min_gain),
        "noisy": noisy(levels),
        "warnings": [warning] if warning else [],
        "verdict": said,
    }
    store(client, result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        if warning:
            print(f"\n{warning}")
        print("\n" + said)
    return EX_OK


def store(client: redis.Redis, result: dict[str, Any]) -> None:
    """Keep ``result`` (what ``--json`` prints) as the queue's last capacity result, with
    ``measured_at_ms`` on Redis's clock (``layout.capacity_key``: the console's capacity
    page charts it). A Redis that fails now costs the stored copy only: one line on
    stderr, the result is still printed."""
    import redis

    try:
        stamped = {**result, "measured_at_ms": layout.redis_now_ms(client)}
        client.set(layout.capacity_key(result["queue"]), json.dumps(stamped))
    except redis.RedisError as error:
        print(f"capacity: the result is not stored in Redis: {error}", file=sys.stderr)


def _levels(text: str) -> list[int]:
    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError("a comma list of whole numbers, e.g. 1,2,4,8") from None
    low, high = bounds(Concurrency)
    if not levels or levels[0] < low or levels[-1] > high:
        raise argparse.ArgumentTypeError(f"levels must be between {low} and {high}")
    return levels


def _json_of(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"must be a JSON {kind.__name__}")
        return value

    return parse


def add_command(commands: Any) -> None:
    """Add ``capacity`` to the CLI's ``commands`` (argparse subparsers)."""
    capacity = command_parser(commands, "capacity", "throughput against concurrency", __doc__)
    capacity.add_argument("--actor", required=True, help="the actor to run (its name)")
    capacity.add_argument(
        "--args",
        type=_json_of(list),
        default=[],
        metavar="JSON",
        help="positional arguments, a JSON list (default [])",
    )
    capacity.add_argument(
        "--kwargs",
        type=_json_of(dict),
        default={},
        metavar="JSON",
        help="keyword arguments, a JSON object (default {})",
    )
    capacity.add_argument(
        "--jobs",
        type=positive_int,
        default=200,
        metavar="N",
        help=f"jobs per level and round, at least {TIMED_SHARE} x the highest level (default 200)",
    )
    capacity.add_argument(
        "--concurrency",
        type=_levels,
        default=list(DEFAULT_LEVELS),
        metavar="LEVELS",
        help="comma list of levels (default 1,2,4,8,16)",
    )
    capacity.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        metavar="N",
        help="rounds over the levels; a level counts its best (default 3)",
    )
    capacity.add_argument(
        "--min-gain",
        type=float,
        default=0.1,
        metavar="F",
        help="a smaller gain means throughput stopped rising (default 0.1)",
    )
    capacity.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="the longest one level may take (default 300)",
    )
    capacity.add_argument("--json", action="store_true", help="JSON instead of a table")
    capacity.set_defaults(run=run)
