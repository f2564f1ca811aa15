"""The runtimes the comparison benchmarks run side by side on one redis-server: the service's
baked worker, bare Dramatiq 2.2.1 and Celery 5.6 (threads and prefork pools, at its defaults
and as careful teams run it: ``acks_late`` with prefetch multiplier 1).

Every runtime runs the same job body (:data:`BODY`: the job's sleep, between two timestamps
and one counter written to Redis) on a queue of its own, so several run at once. A batch is
*prepared* first (untimed: the bodies stored, the ids or Celery's envelopes pushed on a staging
list, each in the runtime's own format) and then *released* in one round trip (``RENAME`` of
the staging list onto the queue, and the service's wake-up ``PUBLISH`` its producer sends),
so a measurement counts no enqueue work and every runtime sees its batch appear at once.

A run whose name starts with ``t`` (traced) also records each job's start, process id and
length (``bench:<run>:starts``): the warm-up, head-of-line and redelivery measures read it.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _workers

#: The runtimes, in the order of the tables: the service, bare Dramatiq, then Celery's
#: (pool, careful) configurations (careful: ``task_acks_late`` and prefetch multiplier 1).
TOOLS: tuple[str, ...] = (
    "service",
    "bare",
    "celery_threads",
    "celery_threads_late",
    "celery_prefork",
    "celery_prefork_late",
)
CELERY: dict[str, tuple[str, bool]] = {
    "celery_threads": ("threads", False),
    "celery_threads_late": ("threads", True),
    "celery_prefork": ("prefork", False),
    "celery_prefork_late": ("prefork", True),
}
LABELS: dict[str, str] = {
    "service": "service",
    "bare": "bare Dramatiq",
    "celery_threads": "Celery threads",
    "celery_threads_late": "Celery threads, acks_late + prefetch 1",
    "celery_prefork": "Celery prefork",
    "celery_prefork_late": "Celery prefork, acks_late + prefetch 1",
}
#: Queues each Dramatiq runtime declares (one actor per queue): instances run side by side.
SERVICE_QUEUES = ("notifications", "svc_b", "svc_c")
BARE_QUEUES = ("bare", "bare_b", "bare_c")
CELERY_QUEUES = ("a", "b", "c")

#: The job body every runtime runs: two timestamps and a counter around the job's sleep.
BODY = """
import os
import time

import redis

_client = redis.Redis.from_url(os.environ["REDIS_URL"])


def _run(run, ms):
    if run[0] == "t":
        _client.rpush("bench:" + run + ":starts", f"{time.time()} {os.getpid()} {ms}")
    _client.zadd("bench:" + run + ":first", {"t": time.time()}, lt=True)
    if ms:
        time.sleep(ms / 1000)
    _client.zadd("bench:" + run + ":last", {"t": time.time()}, gt=True)
    _client.incr("bench:" + run + ":done")
"""
#: Redis calls (and commands) :data:`BODY` makes per untraced job.
BODY_CALLS = 3


def _actors(queues: tuple[str, ...]) -> str:
    """Source declaring one actor ``bench_<queue>`` running :data:`BODY`'s job per queue of
    ``queues``, on the broker set when it runs."""
    return f"""
import dramatiq

for _queue in {queues!r}:
    def _job(run, ms):
        _run(run, ms)

    _job.__name__ = "bench_" + _queue
    dramatiq.actor(queue_name=_queue, max_retries=0)(_job)
"""


SERVICE_ACTORS = BODY + _actors(SERVICE_QUEUES)
BARE_MODULE = (
    BODY
    + """
import dramatiq
from dramatiq.brokers.redis import RedisBroker

dramatiq.set_broker(RedisBroker(url=os.environ["REDIS_URL"]))
"""
    + _actors(BARE_QUEUES)
)
CELERY_MODULE = (
    BODY
    + """
from celery import Celery

app = Celery("celery_bench", broker=os.environ["REDIS_URL"])
app.conf.broker_connection_retry_on_startup = True
if os.environ.get("BENCH_CAREFUL") == "1":
    app.conf.task_acks_late = True
    app.conf.worker_prefetch_multiplier = 1


@app.task(name="bench_job")
def bench_job(run, ms):
    _run(run, ms)
"""
)


@dataclass
class Worker:
    """A started runtime: its process groups (one per Celery node), its queue, its shape."""

    tool: str
    queue: str
    threads: int
    processes: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return LABELS[self.tool]


def group_pids(leaders: Sequence[int]) -> list[int]:
    """Every live process whose process group is one of ``leaders``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) in leaders and fields[0] != "Z":
            found.append(int(entry.name))
    return sorted(found)


def rss_mb(pid: int, field: str = "Rss") -> float:
    """Resident memory of ``pid`` in MiB (0 when it is gone); ``field="Pss"``: its
    proportional share (pages shared with other processes, a fork's, divided among them)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def baked_layout(project: Path) -> Any:
    """The ``layout`` package the baked project runs (worker_runtime's: it imports neither
    redis-py nor Dramatiq): the owner of the keys, channels and scripts the benchmarks use."""
    return importlib.import_module("worker_runtime.layout")


class Bench:
    """A redis-server, a bake with the service's actors, the bare Dramatiq and Celery modules,
    and the workers started on them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        project = _workers.bake(root, {"bench_throughput": SERVICE_ACTORS}, database="none")
        pools = project / "pools.toml"
        declared = 'queues = ["notifications"]'
        assert declared in pools.read_text(), "the interactive pool's queues moved"
        pools.write_text(
            pools.read_text().replace(
                declared, "queues = [" + ", ".join(f'"{q}"' for q in SERVICE_QUEUES) + "]"
            )
        )
        self.project = project
        self.layout = baked_layout(project)
        self.module_dir = root / "modules"
        self.module_dir.mkdir()
        (self.module_dir / "bare_bench.py").write_text(BARE_MODULE)
        (self.module_dir / "celery_bench.py").write_text(CELERY_MODULE)
        self.redis = _workers.redis_server(root / "redis")
        self.redis_url = self.redis.url
        self.client = redis.Redis.from_url(self.redis_url)
        self.runs = 0
        self.polls = 0  # calls the waits made (the round-trip counts subtract them)
        self.workers: list[Worker] = []
        self._celery: Any = None

    def close(self) -> None:
        for worker in self.workers:
            self.stop(worker)
        self.redis.stop()

    # -- workers -------------------------------------------------------------------------
    def start(
        self,
        tool: str,
        threads: int,
        processes: int = 1,
        queue: int = 0,
        prefetch: int | None = None,
        warm: bool = True,
    ) -> Worker:
        """Start ``tool`` with ``threads`` handler threads (prefork: child processes) per
        process on its ``queue``-th queue: the service with ``WORKER_PROCESSES``, Dramatiq
        with ``--processes``, Celery as that many nodes. ``prefetch`` (Dramatiq runtimes):
        what each process holds. With ``warm`` (default), return once every process ran a job."""
        log = self.root / f"{tool}-{queue}.log"
        if tool == "service":
            name = SERVICE_QUEUES[queue]
            env = _workers.worker_env(
                self.project,
                self.redis_url,
                self.root / f"state-{name}",
                WORKER_QUEUES=name,
                WORKER_CONCURRENCY=str(threads),
                WORKER_PROCESSES=str(processes),
                WORKER_JOB_TIMEOUT_MS="20000",
                WORKER_SHUTDOWN_TIMEOUT_MS="25000",
            )
            if prefetch is not None:
                env["WORKER_PREFETCH"] = str(prefetch)
            procs = [_workers.start_worker(self.project, env, log)]
        elif tool == "bare":
            name = BARE_QUEUES[queue]
            env = self._module_env()
            if prefetch is not None:
                env["dramatiq_queue_prefetch"] = str(prefetch)
            command = [
                _workers.PYTHON,
                "-m",
                "dramatiq",
                "bare_bench",
                "--processes",
                str(processes),
                "--threads",
                str(threads),
                "--queues",
                name,
            ]
            procs = [_workers.start(command, self.module_dir, env, log)]
        else:
            pool, careful = CELERY[tool]
            name = f"{tool}_{CELERY_QUEUES[queue]}"
            env = self._module_env()
            if careful:
                env["BENCH_CAREFUL"] = "1"
            procs = []
            for node in range(processes):
                command = [
                    _workers.PYTHON,
                    "-m",
                    "celery",
                    "-A",
                    "celery_bench",
                    "worker",
                    "-P",
                    pool,
                    "-c",
                    str(threads),
                    "-Q",
                    name,
                    "-l",
                    "WARNING",
                    "-n",
                    f"{name}-{node}-{uuid.uuid4().hex[:6]}@%h",
                ]
                procs.append(_workers.start(command, self.module_dir, env, log))
        worker = Worker(tool, name, threads, processes, procs)
        self.workers.append(worker)
        if warm:
            self.warm(worker)
        return worker

    def _module_env(self) -> dict[str, str]:
        env = _workers.foreign_free_env(dict(os.environ))
        env.update(PYTHONPATH=str(self.module_dir), REDIS_URL=self.redis_url)
        return env

    def warm(self, worker: Worker, timeout: float = 180) -> None:
        """Run short traced batches until every process of ``worker`` ran a job (imports
        done, threads up, Celery's nodes past their start-up)."""
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while len(seen) < worker.processes:
            for proc in worker.procs:
                if proc.poll() is not None:
                    raise SystemExit(
                        f"{worker.label} exited {proc.returncode} while warming up"
                        f" (log: {self.root})"
                    )
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"{worker.label}: {len(seen)} of {worker.processes} processes ran a job"
                )
            run = self.new_run("t")
            jobs = 2 * worker.processes * min(worker.threads, 4)
            self.prepare(worker, run, [50.0] * jobs)
            self.release(worker)
            self.wait_done(run, jobs, 180, worker)
            seen |= {int(pid) for _, pid, _ in self.starts(run)}

    def stop(self, worker: Worker) -> None:
        for proc in worker.procs:
            if proc.poll() is None:
                _workers.stop(proc)
        if worker in self.workers:
            self.workers.remove(worker)

    def kill(self, worker: Worker) -> None:
        """SIGKILL to every process of ``worker`` (a pod gone)."""
        for proc in worker.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        self.workers.remove(worker)

    def pids(self, worker: Worker) -> list[int]:
        return group_pids([proc.pid for proc in worker.procs])

    # -- batches -------------------------------------------------------------------------
    def new_run(self, prefix: str = "r") -> str:
        self.runs += 1
        return f"{prefix}{self.runs}"

    def staging(self, worker: Worker) -> str:
        return f"bench:staging:{worker.queue}"

    def queue_key(self, worker: Worker) -> str:
        """The list the runtime pops its queue's messages from."""
        return worker.queue if worker.tool in CELERY else f"{_workers.NS}:{worker.queue}"

    def prepare(self, worker: Worker, run: str, lengths: Sequence[float]) -> None:
        """Stage one job of ``run`` per entry of ``lengths`` (its ms), in that order."""
        staging = self.staging(worker)
        self.client.delete(staging)
        pipe = self.client.pipeline(transaction=False)
        if worker.tool in CELERY:
            templates = {ms: self._celery_template(run, ms) for ms in set(lengths)}
            for ms in lengths:
                pipe.lpush(staging, self._celery_copy(*templates[ms]))
        else:
            actor = f"bench_{worker.queue}"
            for ms in lengths:
                item = _workers.message(actor, run, ms, queue=worker.queue)
                redis_id = item.options["redis_message_id"]
                pipe.hset(f"{_workers.NS}:{worker.queue}.msgs", redis_id, item.encode())
                pipe.rpush(staging, redis_id)
                if worker.tool == "service":  # its producer indexes each message it stores
                    pipe.hset(
                        self.layout.message_index_key(),
                        item.message_id,
                        self.layout.message_place(worker.queue, redis_id),
                    )
        for start in range(0, len(pipe.command_stack), 20_000):
            chunk = self.client.pipeline(transaction=False)
            chunk.command_stack = pipe.command_stack[start : start + 20_000]
            chunk.execute()

    def release(self, worker: Worker) -> float:
        """Move the staged batch onto the queue in one round trip; the time it was done."""
        pipe = self.client.pipeline(transaction=False)
        pipe.rename(self.staging(worker), self.queue_key(worker))
        if worker.tool == "service":
            pipe.publish(self.layout.WAKE_CHANNEL, worker.queue)
        pipe.execute()
        return time.time()

    def _celery_template(self, run: str, ms: float) -> tuple[str, str, str]:
        """One envelope of ``bench_job(run, ms)`` as Celery's producer writes it (sent to a
        scratch list and taken back), with its task id and delivery tag to replace."""
        if self._celery is None:
            from celery import Celery

            self._celery = Celery("bench_producer", broker=self.redis_url)
        scratch = f"bench_scratch_{uuid.uuid4().hex[:8]}"
        result = self._celery.send_task("bench_job", args=(run, ms), queue=scratch)
        raw = self.client.rpop(scratch)
        assert isinstance(raw, bytes), "Celery's producer wrote no envelope"
        text = raw.decode()
        tag = text.split('"delivery_tag": "', 1)[1].split('"', 1)[0]
        return text, str(result.id), tag

    @staticmethod
    def _celery_copy(text: str, task_id: str, tag: str) -> str:
        return text.replace(task_id, str(uuid.uuid4())).replace(tag, str(uuid.uuid4()))

    def wait_done(
        self, run: str, jobs: int, timeout: float, worker: Worker | None = None, step: float = 0.005
    ) -> bool:
        """Poll ``run``'s counter until ``jobs`` are done (True) or ``timeout`` s passed
        (False; a SystemExit when ``worker`` died meanwhile). Counts its calls."""
        deadline = time.monotonic() + timeout
        while True:
            self.polls += 1
            if int(self.client.get(f"bench:{run}:done") or 0) >= jobs:
                return True
            if worker is not None and all(p.poll() is not None for p in worker.procs):
                raise SystemExit(f"{worker.label} exited while running {run} (log: {self.root})")
            if time.monotonic() > deadline:
                return False
            time.sleep(step)

    def done(self, run: str) -> int:
        return int(self.client.get(f"bench:{run}:done") or 0)

    def starts(self, run: str) -> list[tuple[float, int, float]]:
        """(start time, pid, ms) of each job of the traced ``run`` that started."""
        rows = self.client.lrange(f"bench:{run}:starts", 0, -1)
        return [(float(a), int(b), float(c)) for a, b, c in (r.decode().split() for r in rows)]

    def round(self, worker: Worker, jobs: int, ms: float, timeout: float = 600) -> dict[str, float]:
        """Run one batch of ``jobs`` of ``ms`` on ``worker``; its span (first start to last
        end) and total (release to last end) in seconds."""
        run = self.new_run()
        self.prepare(worker, run, [ms] * jobs)
        released = self.release(worker)
        if not self.wait_done(run, jobs, timeout, worker):
            raise SystemExit(f"{worker.label}: {self.done(run)} of {jobs} jobs in {timeout} s")
        first = float(self.client.zscore(f"bench:{run}:first", "t") or 0)
        last = float(self.client.zscore(f"bench:{run}:last", "t") or 0)
        return {"span_s": last - first, "total_s": last - released}


def versions() -> dict[str, str]:
    """The versions of what is compared (recorded with the results)."""
    from importlib.metadata import version

    server = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=True
    )
    return {
        **{name: version(name) for name in ("dramatiq", "celery", "kombu", "redis")},
        "redis-server": server.stdout.split("v=", 1)[-1].split()[0],
    }


def rotate(items: Sequence[Any], index: int) -> list[Any]:
    """``items`` rotated by ``index`` (alternating rounds: each starts with another one)."""
    shift = index % len(items) if items else 0
    return [*items[shift:], *items[:shift]]
