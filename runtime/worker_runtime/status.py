"""Status: the queues and the worker processes, read from Redis alone.

    status [--json]

Per queue of pools.toml: messages waiting (ready list), delayed (retries with backoff,
``delay=``), the age of the oldest due one, in flight (held in the workers' acks sets) and
dead letters. Per worker process: its pool, host and pid, the deliveries it holds, each
job it runs now with its actor and running time, and the age of its last heartbeat.

Everything comes from Redis (a process publishes its record with its heartbeat,
:func:`.layout.process_key`), in three round trips whatever the queues hold: one
backlog call, the heartbeats, then each process's record and acks-set sizes. A process
whose record expired (silent for a heartbeat timeout) is shown as silent while it still
holds deliveries, until the recovery of the live workers takes them; a heartbeat with
neither (a producer's: Dramatiq's enqueue writes one, or a process that stopped cleanly)
is not a worker process and is not shown. Times are Redis's clock.

Needs ``REDIS_URL`` and pools.toml only, never a worker setting. Exit codes: ``EX_OK``,
``EX_FAILURE`` when Redis is unreachable (one line), ``EX_CONFIG`` bad configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from . import layout
from .backlog import read_backlog
from .cli.args import command_parser
from .exitcodes import EX_FAILURE, EX_OK
from .flow import DownstreamStatus, FlowState, read_flow
from .flow import render as render_flow
from .pools import PoolsFile, PoolsFileError

if TYPE_CHECKING:
    import redis


@dataclass(frozen=True)
class QueueStatus:
    """One queue: waiting, delayed, the oldest due message's age (s: the next message in
    line, or a delayed one due and not yet moved to the queue), in flight, dead."""

    queue: str
    waiting: int
    delayed: int
    oldest_due_s: float
    inflight: int
    dead_letters: int
    paused: bool = False
    throttled: str = ""


@dataclass(frozen=True)
class RunningJob:
    """A job a process runs now; ``running_s`` by Redis's clock."""

    queue: str
    actor: str
    message_id: str
    redis_id: str
    running_s: float


@dataclass(frozen=True)
class ProcessStatus:
    """One worker process (one Dramatiq broker id).

    ``silent`` is true when its record expired: it has not beaten for a heartbeat timeout
    (dead, or stopped); ``held`` counts the deliveries in its acks sets (running and
    prefetched)."""

    broker_id: str
    pool: str
    host: str
    pid: int | None
    concurrency: int | None
    held: int
    jobs: list[RunningJob]
    heartbeat_age_s: float
    silent: bool


@dataclass(frozen=True)
class Status:
    """The queues and processes at Redis's time ``now_ms``."""

    now_ms: int
    queues: list[QueueStatus]
    processes: list[ProcessStatus]
    downstreams: list[DownstreamStatus] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _seconds(now_ms: int, since_ms: Any) -> float:
    try:
        return max(0.0, (now_ms - float(since_ms)) / 1000)
    except (TypeError, ValueError):
        return 0.0


def _process(now_ms: int, member: layout.FleetMember) -> ProcessStatus:
    record = member.record or {}
    jobs = [
        RunningJob(
            queue=str(job.get("queue", "-")),
            actor=str(job.get("actor", "-")),
            message_id=str(job.get("message_id", "-")),
            redis_id=str(job.get("redis_id", "-")),
            running_s=round(_seconds(now_ms, job.get("started_ms")), 3),
        )
        for job in record.get("jobs", [])
        if isinstance(job, dict)
    ]
    pid, concurrency = record.get("pid"), record.get("concurrency")
    return ProcessStatus(
        broker_id=member.broker_id,
        pool=str(record.get("pool") or "-"),
        host=str(record.get("host") or "-"),
        pid=pid if isinstance(pid, int) else None,
        concurrency=concurrency if isinstance(concurrency, int) else None,
        held=sum(member.held.values()),
        jobs=sorted(jobs, key=lambda job: -job.running_s),
        heartbeat_age_s=round(_seconds(now_ms, member.beat_ms), 3),
        silent=member.record is None,
    )


def read_status(
    client: redis.Redis, queues: Sequence[str], file: PoolsFile | None = None
) -> Status:
    """The status of ``queues`` and of every worker process of their namespaces; with
    ``file`` (pools.toml), the flow state too (:func:`.flow.read_flow`: each queue's
    ``paused`` and ``throttled``, the downstream budgets in use)."""
    now_ms, fleet = layout.read_fleet(client, queues)
    inflight: dict[str, int] = {}
    for member in fleet:
        for queue, held in member.held.items():
            name = layout.canonical(queue)
            inflight[name] = inflight.get(name, 0) + held
    backlog = read_backlog(client, queues, now=now_ms / 1000)
    flow = None
    if file is not None:
        flow = read_flow(client, file, {each.queue: each.depth for each in backlog})
    return Status(
        now_ms=now_ms,
        queues=[
            QueueStatus(
                queue=each.queue,
                waiting=each.depth,
                delayed=each.delayed,
                oldest_due_s=round(max(each.oldest_s, each.delayed_overdue_s), 3),
                inflight=inflight.get(each.queue, 0),
                dead_letters=each.dead_letters,
                paused=flow is not None and each.queue in flow.paused,
                throttled="" if flow is None else flow.throttled(each.queue),
            )
            for each in backlog
        ],
        processes=sorted(
            (
                _process(now_ms, member)
                for member in fleet
                if member.record is not None or any(member.held.values())
            ),
            key=lambda process: (process.silent, process.pool, process.host, process.pid or 0),
        ),
        downstreams=[] if flow is None else flow.downstreams,
    )


def duration(seconds: float) -> str:
    """``seconds`` as an operator reads it: 850ms, 12.3s, 4m05s, 2h10m, 3d04h."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def table(rows: list[tuple[str, ...]]) -> str:
    """``rows`` (the first is the header) as aligned columns."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def render(status: Status) -> str:
    """The two tables ``status`` prints."""
    queues: list[tuple[str, ...]] = [
        ("QUEUE", "WAITING", "DELAYED", "OLDEST DUE", "IN FLIGHT", "DEAD LETTERS")
    ]
    queues += [
        (
            q.queue,
            str(q.waiting),
            str(q.delayed),
            duration(q.oldest_due_s) if q.waiting or q.oldest_due_s else "-",
            str(q.inflight),
            str(q.dead_letters),
        )
        for q in status.queues
    ]
    lines = [table(queues), ""]
    flow = render_flow(FlowState(status.now_ms, {}, status.downstreams))
    paused = [f"paused: {q.queue}" for q in status.queues if q.paused]
    lines += [*paused, flow, ""] if paused or flow else []
    if not status.processes:
        lines.append("no worker process has a heartbeat in Redis")
        return "\n".join(lines)
    processes: list[tuple[str, ...]] = [("POOL", "HOST", "PID", "HELD", "HEARTBEAT", "RUNNING")]
    for p in status.processes:
        beat = duration(p.heartbeat_age_s) + " ago" + (" (silent)" if p.silent else "")
        running = [f"{job.actor} {duration(job.running_s)} ({job.queue})" for job in p.jobs]
        processes.append(
            (
                p.pool,
                p.host,
                str(p.pid or "-"),
                f"{p.held}/{p.concurrency}" if p.concurrency else str(p.held),
                beat,
                running[0] if running else "-",
            )
        )
        processes += [("", "", "", "", "", more) for more in running[1:]]
    lines.append(table(processes))
    live = sum(not p.silent for p in status.processes)
    jobs = sum(len(p.jobs) for p in status.processes)
    lines.append(f"\n{_plural(live, 'live process', 'es')}, {_plural(jobs, 'running job')}")
    return "\n".join(lines)


def _plural(number: int, noun: str, suffix: str = "s") -> str:
    return f"{number} {noun}{'' if number == 1 else suffix}"


def pools_queues() -> list[str]:
    """Every queue of pools.toml."""
    from .settings import pools

    return [name for pool in pools().pools.values() for name in pool.queues]


def pools_file() -> PoolsFile:
    """pools.toml, validated (exit 78 when it is not)."""
    from .settings import pools

    return pools()


def connect() -> tuple[redis.Redis, str]:
    """A Redis client for ``REDIS_URL`` and the URL with its password masked."""
    from .redisclient import connect as redis_connect
    from .settings import load_redis_settings, mask_url

    url = load_redis_settings().redis_url.get_secret_value()
    return redis_connect(url, socket_timeout=10, socket_connect_timeout=5), mask_url(url)


def _status(args: argparse.Namespace) -> int:
    import redis

    from .settings import config_errors, refuse

    client, url = connect()
    try:
        status = read_status(client, pools_queues(), pools_file())
    except PoolsFileError as error:
        refuse(config_errors(error))
    except redis.RedisError as error:
        print(f"status: Redis at {url} failed: {error}", file=sys.stderr)
        return EX_FAILURE
    finally:
        client.close()
    print(json.dumps(status.as_dict(), indent=2) if args.json else render(status))
    return EX_OK


def add_command(commands: Any) -> None:
    """Add ``status [--json]`` to the CLI's ``commands`` (argparse subparsers)."""
    status = command_parser(commands, "status", "queues and worker processes, from Redis", __doc__)
    status.add_argument("--json", action="store_true", help="JSON instead of tables")
    status.set_defaults(run=_status)
