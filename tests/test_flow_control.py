"""Flow control at the fetch (issues #42 and #41 item 5), with real worker processes.

* ``pause <queue>``: no worker of any pool fetches the queue (decided in the fetch script),
  while another queue flows; it stays paused across a worker's restart; ``status`` and
  ``queue_paused`` show it; ``resume`` lets every waiting job run.
* A downstream budget (``capacity - reserved``, here lowered by the environment's
  ``DOWNSTREAM_PARTNER_API_*``): a fake downstream counts the calls in flight in Redis
  across several worker processes of two supervisors; the peak never exceeds the budget,
  no attempt is spent while waiting (each job starts once, no retry, no dead letter), and
  the budget in use, its limit and the throttled fetches are in /metrics and ``status``.
* A worker SIGKILLed while it holds every slot: its slots come back when its messages are
  recovered (one heartbeat timeout), long before their lease would end.
* A rate: the starts never come faster than the bucket allows.
* Bad values of ``DOWNSTREAM_<NAME>_*`` refuse to boot: exit 78, one line.

The idle consumers poll at most every second (``IDLE_POLL_MS``) and a held-back one waits
at most a second too, so each consumer asks for the paused queue at least once a second.
The issue's "not fetched for 30 s" is proven as "no fetch across every poll of every
consumer", each poll counted (Redis's ``MONITOR``, :class:`FetchWatch`): every process asks
for the paused queue several times a watch at its steady one-second pace, and each ask is
the same stateless decision (the queue in a hash with no expiry, checked in the fetch
script), so a 30 s watch would see the same refusal thirty times; the pause cannot lapse
with time (its key has no TTL).
"""

from __future__ import annotations

import collections
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis
from _lifecycle import NS, Worker, bake_with_actors, wait_for, workers_of
from bakery import project_env, run_cli
from worker_runtime import layout

pytestmark = pytest.mark.slow

PARTNER = "partner"

FLOW_ACTORS = '''\
"""A fake downstream: each call counts itself in flight in Redis and keeps the peak."""

from __future__ import annotations

import os
import time

import dramatiq
import redis

_client = redis.Redis.from_url(os.environ["REDIS_URL"])
_ENTER = _client.register_script("""
local now = redis.call('incr', KEYS[1])
if now > tonumber(redis.call('get', KEYS[2]) or '0') then redis.call('set', KEYS[2], now) end
return now
""")


@dramatiq.actor(queue_name="partner", max_retries=4)
def flow_call(job_id: str, seconds: float) -> None:
    """One call to the fake downstream: in flight for ``seconds``."""
    _ENTER(keys=["fake:inflight", "fake:peak"])
    _client.rpush(f"test:start:{job_id}", f"{os.getpid()} {time.time()}")
    try:
        time.sleep(0.05 if _client.get("fake:short") else seconds)
    finally:
        _client.decr("fake:inflight")
    _client.rpush(f"test:done:{job_id}", f"{os.getpid()} {time.time()}")
'''


@pytest.fixture(scope="session")
def flow_project(bake: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bake_with_actors(bake, tmp_path_factory, "flow", flow_test=FLOW_ACTORS)


@pytest.fixture
def workers(flow_project: Path, redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    yield from workers_of(flow_project, redis_url, tmp_path)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    found = redis.Redis.from_url(redis_url)
    yield found
    found.close()


def send(redis_url: str, queue: str, actor: str, *args: Any) -> None:
    broker = dramatiq.brokers.redis.RedisBroker(url=redis_url)
    try:
        broker.enqueue(dramatiq.Message(queue_name=queue, actor_name=actor, args=args,
                                        kwargs={}, options={}))
    finally:
        broker.close()


def starts(client: redis.Redis, job_id: str) -> list[float]:
    return [float(raw.split()[1]) for raw in client.lrange(f"test:start:{job_id}", 0, -1)]


def done(client: redis.Redis, ids: list[str]) -> int:
    return sum(bool(client.llen(f"test:done:{job_id}")) for job_id in ids)


def cli(project: Path, redis_url: str, *args: str, **env: str) -> Any:
    return run_cli(project, *args, env=project_env(project, REDIS_URL=redis_url, **env))


def held(client: redis.Redis, queue: str) -> int:
    return sum(int(client.scard(key)) for key in client.scan_iter(f"{NS}:__acks__.*.{queue}"))


def metric(text: str, name: str, **labels: str) -> float | None:
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(
                f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
        if not wanted and line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return None


class FetchWatch:
    """The fetches (the FETCH script: KEYS the queue, its bodies, the fetching process's acks
    set) each worker process sends for ``queue``, counted from Redis's ``MONITOR`` while the
    watch is on; ``polls`` maps each process's broker id to its count."""

    def __init__(self, redis_url: str, queue: str) -> None:
        self.queue = queue
        self.polls: collections.Counter[str] = collections.Counter()
        self.counting = False
        self._client = redis.Redis.from_url(redis_url)
        self._monitor = self._client.monitor().__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        # Where FETCH's KEYS name the queue's bodies and the fetching process's acks set
        # (after EVALSHA, the script's sha and the number of keys).
        keys = layout.fetch_keys("BROKER", self.queue)
        bodies = 3 + keys.index(layout.bodies_key(self.queue))
        acks = 3 + keys.index(layout.acks_key("BROKER", self.queue))
        prefix, suffix = layout.acks_key("BROKER", self.queue).split("BROKER")
        try:
            for command in self._monitor.listen():
                words = command["command"].split(" ")
                if (self.counting and words[0].upper() == "EVALSHA" and len(words) > acks
                        and words[bodies] == layout.bodies_key(self.queue)
                        and words[acks].startswith(prefix) and words[acks].endswith(suffix)):
                    self.polls[words[acks][len(prefix):-len(suffix)]] += 1
        except (redis.RedisError, OSError, AttributeError):
            return  # closed at the end

    def count(self, processes: int, polls: int, timeout: float = 30) -> collections.Counter[str]:
        """Count the fetches until each of ``processes`` processes sent ``polls`` at least
        (a process that starts meanwhile: from its first): each one's polls meanwhile."""
        self.polls.clear()
        self.counting = True
        self.window = (time.time(), time.time())
        try:
            wait_for(lambda: len(self.polls) >= processes and min(self.polls.values()) >= polls,
                     timeout, f"{polls} fetches of {self.queue} from each of {processes}")
        finally:
            self.counting = False
            self.window = (self.window[0], time.time())
        return collections.Counter(self.polls)

    def close(self) -> None:
        self._monitor.__exit__()
        self._client.close()


#: Fetches of the paused queue each process is watched sending: the first few come fast
#: (the idle pause grows from 5 ms), the last ones at the steady one-second pace.
POLLS = 10


#: How long the paused queue's pool runs (restarted once) and fetches none of it.
PAUSED_S = 30


def test_a_paused_queue_is_fetched_by_no_worker_while_another_flows_then_resumes(
        flow_project: Path, redis_url: str, client: redis.Redis,
        workers: Callable[..., Worker]) -> None:
    paused = cli(flow_project, redis_url, "pause", "notifications")
    assert paused.returncode == 0, paused.stderr
    assert paused.stdout.strip() == "notifications: paused"
    unknown = cli(flow_project, redis_url, "pause", "nope")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    interactive = workers(WORKER_PROCESSES="2")
    external = workers(WORKER_POOL="external", WORKER_PROCESSES="2")
    since = time.monotonic()  # its pool runs from here on, and must fetch none of it
    waiting = [f"n{i}" for i in range(10)]
    for job_id in waiting:
        send(redis_url, "notifications", "lc_quick", job_id)
    flowing = [f"p{i}" for i in range(20)]
    for job_id in flowing:
        send(redis_url, PARTNER, "flow_call", job_id, 0.05)
    wait_for(lambda: done(client, flowing) == len(flowing), 30, "the partner jobs to run")
    watch = FetchWatch(redis_url, "notifications")
    more = [f"q{i}" for i in range(40)]
    try:
        for job_id in more:  # 5 s of work for the external pool's 2 x 4 threads
            send(redis_url, PARTNER, "flow_call", job_id, 1.0)
        polls = watch.count(2, POLLS)  # while the partner's queue flows
        wait_for(lambda: done(client, more) == len(more), 60, "the partner jobs to run again")
    finally:
        watch.close()
    first, last = watch.window
    flowed = [t for job_id in more for t in starts(client, job_id) if first <= t <= last]
    assert len(flowed) >= 16, f"the partner queue flowed meanwhile: {len(flowed)} started"
    assert len(polls) == 2, f"only the pool's two processes fetch it: {polls}"
    assert client.ttl(f"{NS}:__paused__") == -1, "a pause that never lapses"
    assert not any(starts(client, job_id) for job_id in waiting)
    assert client.llen(f"{NS}:notifications") == len(waiting)
    assert held(client, "notifications") == 0, "nothing fetched, nothing held"
    assert metric(interactive.metrics(), "queue_paused", queue="notifications") == 1.0
    assert metric(external.metrics(), "queue_paused", queue=PARTNER) == 0.0
    found = json.loads(cli(flow_project, redis_url, "status", "--json").stdout)
    rows = {row["queue"]: row for row in found["queues"]}
    assert rows["notifications"]["paused"] and not rows[PARTNER]["paused"]
    assert "paused: notifications" in cli(flow_project, redis_url, "status").stdout

    # A restart of the pool: still paused (the pause lives in Redis, not in a process).
    assert interactive.stop() == 0
    restarted = workers(WORKER_PROCESSES="2")
    wait_for(lambda: len(restarted.children()) == 2, 30, "the restarted pool's processes")
    watch = FetchWatch(redis_url, "notifications")
    try:
        after = watch.count(2, POLLS)
    finally:
        watch.close()
    assert len(after) == 2, f"only the pool's two new processes fetch it: {after}"
    assert not set(after) & set(polls), "the new processes, not the old ones"
    time.sleep(max(0.0, PAUSED_S - (time.monotonic() - since)))
    assert not any(starts(client, job_id) for job_id in waiting), f"within {PAUSED_S} s"
    assert held(client, "notifications") == 0

    resumed = cli(flow_project, redis_url, "resume", "notifications")
    assert resumed.returncode == 0 and resumed.stdout.strip() == "notifications: resumed"
    wait_for(lambda: done(client, waiting) == len(waiting), 20, "the paused jobs to run")
    assert all(len(starts(client, job_id)) == 1 for job_id in waiting)
    assert metric(restarted.metrics(), "queue_paused", queue="notifications") == 0.0


#: The partner's budget in these tests: DOWNSTREAM_PARTNER_API_CAPACITY - _RESERVED.
BUDGET_ENV = {"DOWNSTREAM_PARTNER_API_CAPACITY": "7", "DOWNSTREAM_PARTNER_API_RESERVED": "4",
              "DOWNSTREAM_PARTNER_API_RATE": "1000/s"}


def test_calls_in_flight_never_exceed_the_budget_across_processes_and_no_attempt_is_spent(
        flow_project: Path, redis_url: str, client: redis.Redis,
        workers: Callable[..., Worker]) -> None:
    env = {"WORKER_POOL": "external", "WORKER_PROCESSES": "2", "WORKER_CONCURRENCY": "4",
           **BUDGET_ENV}
    first, second = workers(**env), workers(**env)
    wait_for(lambda: len(first.children()) + len(second.children()) == 4, 30, "4 processes")
    ids = [f"c{i}" for i in range(30)]
    for job_id in ids:
        send(redis_url, PARTNER, "flow_call", job_id, 0.2)
    wait_for(lambda: done(client, ids) == len(ids), 60, "every call to end")
    assert int(client.get("fake:peak") or 0) == 3, "the budget, used in full, never passed"
    assert all(len(starts(client, job_id)) == 1 for job_id in ids), "each job started once"
    assert not client.zcard(f"{NS}:{PARTNER}.XQ") and not client.llen(f"{NS}:{PARTNER}.DQ")
    assert held(client, PARTNER) == 0
    assert not client.zcard(f"{NS}:__downstream__.partner_api"), "every slot freed"
    lines = [json.loads(line) for w in (first, second) for line in w.log().splitlines()
             if line.startswith("{") and '"job_end"' in line]
    assert {line["outcome"] for line in lines} == {"success"}
    assert not any(line.get("retries") for line in lines), "no attempt spent waiting"
    text = first.metrics()
    assert metric(text, "downstream_limit", downstream="partner_api") == 3.0
    assert metric(text, "downstream_in_use", downstream="partner_api") == 0.0
    throttled = sum(metric(w.metrics(), "jobs_throttled_total", queue=PARTNER,
                           reason="budget") or 0 for w in (first, second))
    assert throttled > 0, "the waits were counted"


def test_a_killed_workers_slots_come_back_with_the_recovery_of_its_messages(
        flow_project: Path, redis_url: str, client: redis.Redis,
        workers: Callable[..., Worker]) -> None:
    env = {"WORKER_POOL": "external", "WORKER_CONCURRENCY": "4",
           "WORKER_HEARTBEAT_TIMEOUT_MS": "3000", **BUDGET_ENV}
    first = workers(**env)
    ids = [f"k{i}" for i in range(3)]
    for job_id in ids:
        send(redis_url, PARTNER, "flow_call", job_id, 15)
    wait_for(lambda: all(starts(client, job_id) for job_id in ids), 30, "3 calls in flight")
    assert client.zcard(f"{NS}:__downstream__.partner_api") == 3
    later = [f"m{i}" for i in range(3)]
    for job_id in later:
        send(redis_url, PARTNER, "flow_call", job_id, 0.05)
    killed = first.signal(signal.SIGKILL, group=True)
    first.wait(timeout=10)
    client.set("fake:inflight", 0)  # the killed calls never left the fake downstream
    client.set("fake:short", 1)  # their second run is short
    second = workers(**env)
    # The lease of a slot is 2 x (2 x 20 s + 3 s) = 86 s: only the recovery frees it sooner.
    wait_for(lambda: done(client, later) == len(later), 3 + 20, "the waiting calls to run")
    assert time.monotonic() - killed < 30
    # Recovered, they run again one at a time (a crash suspect runs alone in its process).
    wait_for(lambda: all(len(starts(client, job_id)) == 2 for job_id in ids), 20,
             "the killed calls to run again")
    assert int(client.get("fake:peak") or 0) <= 3
    assert second.process is not None and second.process.poll() is None


def test_starts_never_come_faster_than_the_rate(
        flow_project: Path, redis_url: str, client: redis.Redis,
        workers: Callable[..., Worker]) -> None:
    rate = 20
    workers(WORKER_POOL="external", WORKER_PROCESSES="2", WORKER_CONCURRENCY="4",
            DOWNSTREAM_PARTNER_API_RATE=f"{rate}/s")
    ids = [f"r{i}" for i in range(40)]
    for job_id in ids:
        send(redis_url, PARTNER, "flow_call", job_id, 0.0)
    wait_for(lambda: done(client, ids) == len(ids), 60, "every call to end")
    stamps = sorted(starts(client, job_id)[0] for job_id in ids)
    burst = rate  # default: one second's worth
    slack = 0.05  # the start stamp is taken in the handler, after the admission
    for first in range(len(stamps)):
        for last in range(first + burst + 1, len(stamps)):
            allowed = (last - first - burst) / rate
            assert stamps[last] - stamps[first] >= allowed - slack, (first, last, stamps)


@pytest.mark.parametrize(("env", "line"), [
    ({"DOWNSTREAM_PARTNER_API_RATE": "fast"},
     "DOWNSTREAM_PARTNER_API_RATE='fast': 'fast' is not a rate above 0 such as 100/s"),
    ({"DOWNSTREAM_PARTNER_API_RATE": "0/min"},
     "DOWNSTREAM_PARTNER_API_RATE='0/min': '0/min' is not a rate above 0"),
    ({"DOWNSTREAM_PARTNER_API_CAPACITY": "4"},
     "DOWNSTREAM_PARTNER_API_CAPACITY='4': reserved (4) must be below capacity (4)"),
    ({"DOWNSTREAM_PARTNER_API_RESERVED": "-1"},
     "DOWNSTREAM_PARTNER_API_RESERVED='-1': reserved: Input should be greater than or equal"),
    ({"DOWNSTREAM_PARTNER_API_CAPACITY": "many"},
     "DOWNSTREAM_PARTNER_API_CAPACITY='many': not a whole number"),
])
def test_bad_downstream_overrides_refuse_to_boot_in_one_line(
        flow_project: Path, redis_url: str, env: dict[str, str], line: str) -> None:
    for command in (["config"], ["worker"]):
        refused = cli(flow_project, redis_url, *command, WORKER_POOL="external", **env)
        assert refused.returncode == 78, refused.stdout
        (said,) = refused.stderr.strip().splitlines()
        assert said.startswith("config error: " + line), said
