"""Status: the queues and the worker processes, read from Redis alone.

    status [--json] [--check]

Per queue of pools.toml: the pool that serves it and how many live processes serve it
(``consumers``), messages waiting (ready list), delayed (``delay=``, and retries waiting
out their backoff, fetched or not), the age of the oldest due one, in flight (held on the
queue itself by the workers: running or prefetched, never a delayed one) and dead letters.
A queue with waiting or due delayed work and no live consumer is ``unserved``:
``status --check`` exits 1 and lists those (0: none).

Per worker process: its pool, host and pid, the jobs it runs now (actor, running time,
the progress and note its handler last gave ``checkpoint()``), the deliveries it holds
beyond them (prefetched), the delayed ones it keeps until due, and the age of its last
heartbeat. A job leaves the list the moment its delivery is settled: the record a process
publishes with its heartbeat names its jobs, and a job whose delivery is no longer in the
process's acks set (the settlement removes it, in the same Lua call) is dropped, so a
finished job never shows as running. A process that drained forgets itself on exit, and
the supervisor forgets one that died: neither is listed. One that stopped beating for
:data:`STALE_BEATS` of its heartbeat intervals is ``stale`` (shown with its age: stopped,
frozen, or its interpreter held), and one whose record expired (silent a heartbeat
timeout) is shown as silent while it still holds deliveries, until the recovery of the
live workers takes them; a heartbeat with neither (a producer's: Dramatiq's enqueue writes
one) is not a worker process and is not shown. Times are Redis's clock.

Everything comes from Redis, in three round trips whatever the queues hold: one backlog
call, the heartbeats, then each process's record and acks sets (:func:`read_status`, the
one read ``status`` and the console share). Needs ``REDIS_URL`` and pools.toml only,
never a worker setting. Exit codes: ``EX_OK``, ``EX_FAILURE`` when Redis is unreachable
(one line) or ``--check`` found unserved queues, ``EX_CONFIG`` bad configuration. A
closed pipe (``status | head``) ends it quietly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from . import layout
from .backlog import Backlog, read_backlog
from .cli.args import command_parser
from .exitcodes import EX_FAILURE, EX_OK
from .flow import DownstreamStatus, FlowState, read_flow
from .flow import render as render_flow
from .pools import PoolsFile, PoolsFileError

if TYPE_CHECKING:
    import redis

    from .pools import PoolsFile

#: A process is stale once its heartbeat is older than this many of its beat intervals
#: (its record says how often it beats) plus :data:`STALE_SLACK_S`.
STALE_BEATS = 3
STALE_SLACK_S = 1.0
#: Beat interval assumed for a record that does not say (the Recovery pass's longest).
DEFAULT_BEAT_EVERY_MS = 5_000


@dataclass(frozen=True)
class QueueStatus:
    """One queue: its pool, its live consumers, waiting, delayed, the oldest due message's
    age (s: the next message in line, or a delayed one due and not yet moved to the queue),
    in flight, dead letters, and whether work waits that no live process serves."""

    queue: str
    pool: str
    consumers: int
    waiting: int
    delayed: int
    oldest_due_s: float
    delayed_due_s: float
    inflight: int
    dead_letters: int
    unserved: bool
    paused: bool = False
    throttled: str = ""


@dataclass(frozen=True)
class RunningJob:
    """A job a process runs now; ``running_s`` by Redis's clock; ``progress`` (0 to 1) and
    ``note`` as its handler last gave ``checkpoint()`` (None: not given)."""

    queue: str
    actor: str
    message_id: str
    redis_id: str
    running_s: float
    progress: float | None = None
    note: str | None = None


@dataclass(frozen=True)
class ProcessStatus:
    """One worker process (one Dramatiq broker id).

    ``jobs`` are the jobs it runs now (never more than its handler threads); ``held``
    counts the deliveries it holds on its queues (those jobs and the ``prefetched`` ones
    waiting for a thread), ``delayed`` those it keeps until due (``delay=``, retries in
    backoff). ``stale``: no heartbeat for :data:`STALE_BEATS` beat intervals; ``silent``:
    its record expired (no heartbeat for a heartbeat timeout: dead, or stopped)."""

    broker_id: str
    pool: str
    host: str
    pid: int | None
    queues: list[str]
    concurrency: int | None
    held: int
    prefetched: int
    delayed: int
    jobs: list[RunningJob]
    heartbeat_age_s: float
    stale: bool
    silent: bool

    @property
    def live(self) -> bool:
        return not (self.stale or self.silent)


@dataclass(frozen=True)
class Status:
    """The queues and processes at Redis's time ``now_ms``."""

    now_ms: int
    queues: list[QueueStatus]
    processes: list[ProcessStatus]
    downstreams: list[DownstreamStatus] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def unserved(self) -> list[QueueStatus]:
        return [queue for queue in self.queues if queue.unserved]


def _seconds(now_ms: int, since_ms: Any) -> float:
    try:
        return max(0.0, (now_ms - float(since_ms)) / 1000)
    except (TypeError, ValueError):
        return 0.0


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _job(now_ms: int, job: dict[str, Any]) -> RunningJob:
    progress = _number(job.get("progress"))
    note = job.get("note")
    return RunningJob(
        queue=str(job.get("queue", "-")),
        actor=str(job.get("actor", "-")),
        message_id=str(job.get("message_id", "-")),
        redis_id=str(job.get("redis_id", "-")),
        running_s=round(_seconds(now_ms, job.get("started_ms")), 3),
        progress=progress if progress is not None and 0 <= progress <= 1 else None,
        note=str(note) if note is not None else None,
    )


def _process(now_ms: int, member: layout.FleetMember) -> ProcessStatus:
    record = member.record or {}
    running = [
        _job(now_ms, job)
        for job in record.get("jobs", [])
        if isinstance(job, dict) and (not job.get("redis_id") or job["redis_id"] in member.holding)
    ]
    pid, concurrency = record.get("pid"), record.get("concurrency")
    queues = record.get("queues")
    held = sum(n for queue, n in member.held.items() if not queue.endswith(layout.DELAY_SUFFIX))
    beat_every_ms = _number(record.get("beat_every_ms")) or DEFAULT_BEAT_EVERY_MS
    age_s = _seconds(now_ms, member.beat_ms)
    return ProcessStatus(
        broker_id=member.broker_id,
        pool=str(record.get("pool") or "-"),
        host=str(record.get("host") or "-"),
        pid=pid if isinstance(pid, int) else None,
        queues=[str(q) for q in queues] if isinstance(queues, list) else [],
        concurrency=concurrency if isinstance(concurrency, int) else None,
        held=held,
        prefetched=max(0, held - len(running)),
        delayed=sum(n for queue, n in member.held.items() if queue.endswith(layout.DELAY_SUFFIX)),
        jobs=sorted(running, key=lambda job: -job.running_s),
        heartbeat_age_s=round(age_s, 3),
        stale=age_s > STALE_BEATS * beat_every_ms / 1000 + STALE_SLACK_S,
        silent=member.record is None,
    )


def processes_of(now_ms: int, fleet: Sequence[layout.FleetMember]) -> list[ProcessStatus]:
    """The worker processes of ``fleet`` (:func:`.layout.read_fleet`) at ``now_ms``: those
    with a record or holding deliveries, live ones first."""
    return sorted(
        (
            _process(now_ms, member)
            for member in fleet
            if member.record is not None or any(member.held.values())
        ),
        key=lambda p: (p.silent, p.stale, p.pool, p.host, p.pid or 0),
    )


def consumers_of(processes: Sequence[ProcessStatus], queues: Sequence[str]) -> dict[str, int]:
    """How many live processes serve each of ``queues``."""
    return {queue: sum(p.live and queue in p.queues for p in processes) for queue in queues}


def is_unserved(backlog: Backlog, consumers: int) -> bool:
    """Work waits on the queue (ready, or delayed and due) and no live process serves it:
    the one rule of ``status``, ``status --check``, the console and ``queue_unserved``."""
    return not consumers and (backlog.depth > 0 or backlog.delayed_overdue_s > 0)


def read_status(
    client: redis.Redis, queues: Sequence[str], file: PoolsFile | None = None
) -> Status:
    """The status of ``queues`` and of every worker process of their namespaces: the one
    read of ``status`` and of the console; with ``file`` (pools.toml), each queue's pool and
    the flow state too (:func:`.flow.read_flow`: each queue's ``paused`` and ``throttled``,
    the downstream budgets in use)."""
    now_ms, fleet = layout.read_fleet(client, queues)
    processes = processes_of(now_ms, fleet)
    inflight: dict[str, int] = {}
    delayed_held: dict[str, int] = {}
    for member in fleet:
        for queue, held in member.held.items():
            into = delayed_held if queue.endswith(layout.DELAY_SUFFIX) else inflight
            name = layout.canonical(queue)
            into[name] = into.get(name, 0) + held
    consumers = consumers_of(processes, queues)
    backlog = read_backlog(client, queues, now=now_ms / 1000)
    flow = None
    if file is not None:
        flow = read_flow(client, file, {each.queue: each.depth for each in backlog})
    return Status(
        now_ms=now_ms,
        queues=[
            QueueStatus(
                queue=each.queue,
                pool=(file.pool_of_queue(each.queue) if file else None) or "-",
                consumers=consumers[each.queue],
                waiting=each.depth,
                delayed=each.delayed + delayed_held.get(each.queue, 0),
                oldest_due_s=round(max(each.oldest_s, each.delayed_overdue_s), 3),
                delayed_due_s=round(each.delayed_overdue_s, 3),
                inflight=inflight.get(each.queue, 0),
                dead_letters=each.dead_letters,
                unserved=is_unserved(each, consumers[each.queue]),
                paused=flow is not None and each.queue in flow.paused,
                throttled="" if flow is None else flow.throttled(each.queue),
            )
            for each in backlog
        ],
        processes=processes,
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


def job_text(job: RunningJob) -> str:
    """A running job as one line: actor, running time, queue, and its progress and note."""
    said = f"{job.actor} {duration(job.running_s)} ({job.queue})"
    if job.progress is not None:
        said += f" {job.progress:.0%}"
    if job.note:
        said += f" {' '.join(job.note.split())}"
    return said


def heartbeat_text(process: ProcessStatus) -> str:
    """The age of a process's last heartbeat, and whether it is stale or silent."""
    state = " (silent)" if process.silent else " (stale)" if process.stale else ""
    return f"{duration(process.heartbeat_age_s)} ago{state}"


def unserved_text(queue: QueueStatus) -> str:
    """Why ``queue`` is flagged: its work and that no live process serves it."""
    work = []
    if queue.waiting:
        work.append(f"{queue.waiting} waiting (oldest due {duration(queue.oldest_due_s)})")
    if queue.delayed_due_s > 0:
        work.append(f"delayed work due {duration(queue.delayed_due_s)} ago")
    pool = f"pool {queue.pool}" if queue.pool != "-" else "no pool in pools.toml"
    return f"queue {queue.queue} ({pool}): {', '.join(work)}, and no live process serves it"


def render(status: Status) -> str:
    """The two tables ``status`` prints, and a line per unserved queue."""
    queues: list[tuple[str, ...]] = [
        (
            "QUEUE",
            "POOL",
            "CONSUMERS",
            "WAITING",
            "DELAYED",
            "OLDEST DUE",
            "IN FLIGHT",
            "DEAD LETTERS",
            "",
        )
    ]
    queues += [
        (
            q.queue,
            q.pool,
            str(q.consumers),
            str(q.waiting),
            str(q.delayed),
            duration(q.oldest_due_s) if q.waiting or q.oldest_due_s else "-",
            str(q.inflight),
            str(q.dead_letters),
            "UNSERVED" if q.unserved else "",
        )
        for q in status.queues
    ]
    lines = [table(queues)]
    lines += [f"unserved: {unserved_text(q)}" for q in status.unserved]
    lines.append("")
    flow = render_flow(FlowState(status.now_ms, {}, status.downstreams))
    paused = [f"paused: {q.queue}" for q in status.queues if q.paused]
    lines += [*paused, flow, ""] if paused or flow else []
    if not status.processes:
        lines.append("no worker process has a heartbeat in Redis")
        return "\n".join(lines)
    processes: list[tuple[str, ...]] = [
        ("POOL", "HOST", "PID", "RUNNING", "PREFETCHED", "DELAYED", "HEARTBEAT", "JOBS")
    ]
    for p in status.processes:
        running = [job_text(job) for job in p.jobs]
        processes.append(
            (
                p.pool,
                p.host,
                str(p.pid or "-"),
                f"{len(p.jobs)}/{p.concurrency}" if p.concurrency else str(len(p.jobs)),
                str(p.prefetched),
                str(p.delayed),
                heartbeat_text(p),
                running[0] if running else "-",
            )
        )
        processes += [("", "", "", "", "", "", "", more) for more in running[1:]]
    lines.append(table(processes))
    live = sum(p.live for p in status.processes)
    jobs = sum(len(p.jobs) for p in status.processes)
    said = f"\n{_plural(live, 'live process', 'es')}, {_plural(jobs, 'running job')}"
    if stale := sum(p.stale and not p.silent for p in status.processes):
        said += f", {stale} stale"
    lines.append(said)
    return "\n".join(lines)


def _plural(number: int, noun: str, suffix: str = "s") -> str:
    return f"{number} {noun}{'' if number == 1 else suffix}"


def pools_queues() -> list[str]:
    """Every queue of pools.toml."""
    return [name for pool in pools_file().pools.values() for name in pool.queues]


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
    if args.json:
        print(json.dumps(status.as_dict(), indent=2))
    elif args.check:
        for queue in status.unserved:
            print(f"unserved: {unserved_text(queue)}")
        if not status.unserved:
            print("every queue with work has a live process serving it")
    else:
        print(render(status))
    return EX_FAILURE if args.check and status.unserved else EX_OK


def add_command(commands: Any) -> None:
    """Add ``status [--json] [--check]`` to the CLI's ``commands`` (argparse subparsers)."""
    status = command_parser(commands, "status", "queues and worker processes, from Redis", __doc__)
    status.add_argument("--json", action="store_true", help="JSON instead of tables")
    status.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a queue has waiting or due work and no live process serves it "
        "(and list them)",
    )
    status.set_defaults(run=_status)
