"""The sandbox pool's Redis ACL user, against a real redis-server with the real credential.

The sandbox pool's keys live in a broker namespace of their own (``dramatiq-sandbox:``,
the template's ``layout.SANDBOX_NAMESPACE``), disjoint from every other pool's
(``dramatiq:``); its ACL user reaches only that namespace. Proven here: the baked
sandbox worker, logged in as that user, processes, retries, recovers and dead-letters its
own jobs without one refusal in ``ACL LOG`` and without touching any key of the other
pools (their heartbeats included); producers with the full credential still enqueue onto
it (``producer.enqueue`` and ``.send()``); and the same credential is refused on every key
of another pool (queue, bodies, delay queue, dead letters, acks sets, the shared heartbeat
set), by command, by script and through Dramatiq's own dispatch script, and on the
server (FLUSHALL, KEYS, ...).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import dramatiq
import pytest
import redis
from bakery import package_of, project_env
from worker_runtime.layout import keys as LAYOUT
from worker_runtime import testing
from dramatiq import Message
from worker_infra.acl import acl_key_patterns, acl_rule

USER, PASSWORD = "orders-worker-sandbox", "s3cret/with:odd@chars"
NS = "dramatiq"


SNS = LAYOUT.SANDBOX_NAMESPACE
QUEUE = LAYOUT.SANDBOX_QUEUE


def as_user(redis_url: str) -> str:
    parts = urlsplit(redis_url)
    netloc = f"{quote(USER, safe='')}:{quote(PASSWORD, safe='')}@{parts.hostname}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@pytest.fixture
def sandbox_user(redis_url: str) -> Iterator[redis.Redis]:
    admin = redis.Redis.from_url(redis_url)
    words = acl_rule(USER, PASSWORD, SNS).split()
    assert words[:2] == ["user", USER]
    admin.execute_command("ACL", "SETUSER", USER, *words[2:])
    admin.execute_command("ACL", "LOG", "RESET")
    yield admin
    admin.execute_command("ACL", "DELUSER", USER)


def denials(admin: redis.Redis) -> list[dict[str, object]]:
    return [
        {k.decode() if isinstance(k, bytes) else k: v for k, v in entry.items()}
        if isinstance(entry, dict)
        else entry
        for entry in admin.acl_log()
    ]


def test_rule_names_only_the_sandbox_namespace() -> None:
    assert SNS == "dramatiq-sandbox" and LAYOUT.namespace_of(QUEUE) == SNS
    assert LAYOUT.namespace_of(f"{QUEUE}.DQ") == SNS and LAYOUT.namespace_of("payments") == NS
    rule = acl_rule(USER, PASSWORD, SNS)
    assert PASSWORD not in rule
    assert "~*" not in rule.split() and "allkeys" not in rule and "+@all" not in rule
    assert acl_key_patterns(SNS) == [f"~{SNS}", f"~{SNS}:*"]
    for bad in ("dramatiq", "dramatiq*", "a:b", ""):
        with pytest.raises(ValueError, match="namespace"):
            acl_key_patterns(bad)
    with pytest.raises(ValueError, match="one word"):
        acl_rule("two words", PASSWORD, SNS)


def body(queue: str, actor: str, args: tuple[Any, ...], redis_id: str) -> bytes:
    message: Message[Any] = Message(queue_name=queue, actor_name=actor, args=args, kwargs={},
                                    options={"redis_message_id": redis_id})  # fmt: skip
    return message.encode()


def plant_other_pools(admin: redis.Redis) -> tuple[str, dict[str, Any]]:
    """A dead worker of another pool and that pool's keys; returns its id and a snapshot."""
    dead = str(uuid.uuid4())
    admin.zadd(f"{NS}:__heartbeats__", {dead: 1000})
    admin.sadd(f"{NS}:__acks__.{dead}.payments", "p1")
    admin.hset(f"{NS}:payments.msgs", "p1", body("payments", "capture_payment", ("x", 1), "p1"))
    admin.rpush(f"{NS}:payments.DQ", "p2")
    admin.hset(f"{NS}:payments.DQ.msgs", "p2", body("payments.DQ", "capture_payment", (), "p2"))
    admin.zadd(f"{NS}:payments.XQ", {"p3": 1000})
    admin.hset(f"{NS}:payments.XQ.msgs", "p3", b"{}")
    return dead, snapshot(admin)


def snapshot(admin: redis.Redis) -> dict[str, Any]:
    """Every key outside the sandbox namespace with its value (and TTL)."""
    found = {}
    for key in sorted(admin.scan_iter(count=1000)):
        name = key.decode()
        if name.startswith(f"{SNS}:") or name == SNS:
            continue
        found[name] = (admin.dump(key), admin.pttl(key))
    return found


def wait_for(condition: Callable[[], object], timeout: float, what: str,
             worker: subprocess.Popen[str]) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout
    while not condition():
        if worker.poll() is not None:
            pytest.fail(f"the worker exited ({worker.returncode}) waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)



def started(project: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """``project``'s worker with ``env``, in a session of its own (:func:`stopped` ends it
    all), its output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", package_of(project), "worker"], env=env, cwd=project,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def stopped(worker: subprocess.Popen[str]) -> str:
    """SIGTERM the worker's process group (SIGKILL after 60 s); its whole output."""
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        output, _ = worker.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        output, _ = worker.communicate()
    return output


PRODUCE = """
from {package}.actors.sandbox import run_customer_code
from {package}.producer import enqueue
run_customer_code.send("def main(p):\\n    return p + 1\\n", 41)
enqueue("run_customer_code", "def main(p):\\n    while True:\\n        pass\\n", None,
        {{"cpu_seconds": 1}})
# Limits(cpu_seconds=0) raises in the actor: retried once, then dead-lettered
run_customer_code.send_with_options(args=("def main(p):\\n    return 1\\n", None,
                                          {{"cpu_seconds": 0}}), min_backoff=50, max_backoff=100)
"""


def test_sandbox_worker_runs_its_own_jobs_as_the_acl_user(
    default_project: Path, redis_url: str, sandbox_user: redis.Redis, tmp_path: Path
) -> None:
    """The real `worker` command of the sandbox pool, logged in as the ACL user: it runs,
    retries, dead-letters and recovers its jobs; the other pools' keys stay as they were."""
    admin = sandbox_user
    package = package_of(default_project)
    producer = project_env(default_project, REDIS_URL=redis_url)  # a producer: full credential
    sent = subprocess.run([sys.executable, "-c", PRODUCE.format(package=package)], env=producer,
                          cwd=default_project, capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip
    assert sent.returncode == 0, sent.stderr[-2000:]
    assert admin.llen(f"{SNS}:{QUEUE}") == 3
    assert not list(admin.scan_iter(match=f"{NS}:{QUEUE}*")), "enqueued in the shared namespace"

    # A sandbox worker that died holding a job (its heartbeat is stale): recovered by ours.
    dead_sandbox, held = str(uuid.uuid4()), str(uuid.uuid4())
    source = "def main(p):\n    return 'recovered'\n"
    admin.hset(f"{SNS}:{QUEUE}.msgs", held, body(QUEUE, "run_customer_code", (source,), held))
    admin.sadd(f"{SNS}:__acks__.{dead_sandbox}.{QUEUE}", held)
    admin.zadd(f"{SNS}:__heartbeats__", {dead_sandbox: 1000})
    dead_other, before = plant_other_pools(admin)

    port = testing.free_port()
    env = project_env(
        default_project,
        WORKER_POOL="sandbox",
        REDIS_URL=as_user(redis_url),
        METRICS_PORT=str(port),
        WORKER_STATE_DIR=str(tmp_path / "state"),
        WORKER_PROCESSES="1",
        WORKER_HEARTBEAT_TIMEOUT_MS="2000",  # a recovery pass every 0.4 s
    )
    worker = started(default_project, env)
    try:
        wait_for(lambda: admin.zcard(f"{SNS}:{QUEUE}.XQ") == 1, 120, "the dead letter", worker)
        wait_for(
            lambda: admin.llen(f"{SNS}:{QUEUE}") == 0
            and admin.llen(f"{SNS}:{QUEUE}.DQ") == 0
            and admin.hlen(f"{SNS}:{QUEUE}.msgs") == 0
            and admin.zscore(f"{SNS}:__heartbeats__", dead_sandbox) is None,
            120, "every sandbox job settled and the dead sandbox worker recovered", worker,
        )  # fmt: skip
        # the exporter reads the backlog of its queue as the ACL user too
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            metrics = page.read().decode()
        assert f'queue_dead_letters{{queue="{QUEUE}"}} 1.0' in metrics, metrics[-2000:]
        # a worker process killed: its supervisor recovers it and forgets its heartbeat
        (child,) = Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text().split()
        # the producer's heartbeat (from its enqueue) is stale and forgotten: one is left
        wait_for(lambda: admin.zcard(f"{SNS}:__heartbeats__") == 1, 60,
                 "the worker process's heartbeat alone", worker)  # fmt: skip
        (killed,) = admin.zrange(f"{SNS}:__heartbeats__", 0, -1)
        os.kill(int(child), signal.SIGKILL)
        wait_for(lambda: admin.zscore(f"{SNS}:__heartbeats__", killed) is None, 60,
                 "the supervisor to forget the killed process", worker)  # fmt: skip
    finally:
        output = stopped(worker)
    assert worker.returncode == 0, output[-3000:]
    statuses = sorted(json.loads(line).get("sandbox_status") for line in output.splitlines()
                      if line.startswith("{") and '"sandbox run finished"' in line)  # fmt: skip
    assert statuses == ["cpu", "ok", "ok"], output[-3000:]
    (dead_letter,) = admin.hvals(f"{SNS}:{QUEUE}.XQ.msgs")
    options = json.loads(dead_letter)["options"]
    assert "cpu_seconds" in options["dead_letter_reason"]
    assert options["retries"] == 2, options  # delivered, retried through the delay queue, failed
    assert not list(admin.scan_iter(match=f"{SNS}:__acks__.{dead_sandbox}.*"))
    # The one refusal expected: the boot's check of maxmemory-policy (CONFIG is @dangerous),
    # which the worker then reads from INFO (allowed), as on a managed Redis.
    refused = [entry for entry in denials(admin) if entry.get("object") != "config|get"]
    assert refused == [], "the sandbox worker needed more than its ACL allows"
    assert "redis_config_from_info" in output, output[-3000:]
    assert "redis_config_unchecked" not in output, output[-3000:]
    assert snapshot(admin) == before, "the sandbox worker changed a key of another pool"
    assert admin.zrange(f"{NS}:__heartbeats__", 0, -1, withscores=True) == [
        (dead_other.encode(), 1000.0)
    ]


CANCEL_PRODUCE = """
from {package}.actors.sandbox import run_customer_code
from {package}.producer import cancel
queued = run_customer_code.send("def main(p):\\n    return 'cancelled, never run'\\n", None)
run_customer_code.send("def main(p):\\n    import time\\n    time.sleep(600)\\n", None,
                       {{"wall_seconds": 900, "cpu_seconds": 900}})
print(cancel(queued.message_id), queued.message_id)
"""


def test_sandbox_jobs_are_cancelled_queued_or_running_as_the_acl_user(
    default_project: Path, redis_url: str, sandbox_user: redis.Redis, tmp_path: Path
) -> None:
    """A queued sandbox job cancelled never runs; a running one stops; the sandbox worker,
    logged in as its ACL user, reads its namespace's cancellations without one refusal."""
    admin = sandbox_user
    package = package_of(default_project)
    producer = project_env(default_project, REDIS_URL=redis_url)  # a producer: full credential
    sent = subprocess.run([sys.executable, "-c", CANCEL_PRODUCE.format(package=package)],
                          env=producer, cwd=default_project, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert sent.returncode == 0, sent.stderr[-2000:]
    found, _ = sent.stdout.split()
    assert found == "True"  # found in the sandbox's message index
    port = testing.free_port()
    env = project_env(
        default_project, WORKER_POOL="sandbox", REDIS_URL=as_user(redis_url),
        METRICS_PORT=str(port), WORKER_STATE_DIR=str(tmp_path / "state"), WORKER_PROCESSES="1",
    )  # fmt: skip
    worker = started(default_project, env)

    def metrics() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            return str(page.read().decode())

    def cancelled() -> float:
        lines = [line for line in metrics().splitlines()
                 if line.startswith("jobs_processed_total{") and 'outcome="cancelled"' in line]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    try:
        wait_for(lambda: admin.scard(next(iter(admin.scan_iter(
            match=f"{SNS}:__acks__.*.{QUEUE}")), "none")) == 1 and admin.llen(f"{SNS}:{QUEUE}")
            == 0, 120, "the sleeping job running", worker)  # fmt: skip
        time.sleep(1)  # its snippet started
        (held,) = admin.hvals(f"{SNS}:{QUEUE}.msgs")
        running = json.loads(held)["message_id"]
        stop = subprocess.run([sys.executable, "-c", (
            f"from {package}.producer import cancel\nprint(cancel({running!r}))\n")],
            env=producer, cwd=default_project, capture_output=True, text=True, timeout=60,
            check=False)  # fmt: skip
        assert stop.stdout.strip() == "True", stop.stderr[-2000:]
        wait_for(lambda: cancelled() == 2, 60, "both jobs counted cancelled", worker)
        assert admin.hlen(f"{SNS}:{QUEUE}.msgs") == 0 and admin.llen(f"{SNS}:{QUEUE}.DQ") == 0
        assert admin.zcard(f"{SNS}:{QUEUE}.XQ") == 0
        assert admin.hlen(f"{SNS}:__where__") == 0  # the index follows the messages out
    finally:
        output = stopped(worker)
    assert worker.returncode == 0, output[-3000:]
    assert '"sandbox run finished"' not in output, output[-3000:]  # neither snippet finished
    refused = [entry for entry in denials(admin) if entry.get("object") != "config|get"]
    assert refused == [], "the sandbox worker needed more than its ACL allows"


def test_a_sandbox_group_member_sent_past_the_refusal_runs_once(
    default_project: Path, redis_url: str, sandbox_user: redis.Redis, tmp_path: Path
) -> None:
    """A group member on the sandbox's queue (pushed raw: producers refuse it) cannot record
    the group's completion as the ACL user: it runs once and is acked, not requeued."""
    admin = sandbox_user
    member = str(uuid.uuid4())
    raw = json.loads(body(QUEUE, "run_customer_code", ("def main(p):\n    return 1\n",), member))
    raw["options"].update(group_completion_uuid=str(uuid.uuid4()), group_completion_callbacks=[])
    admin.hset(f"{SNS}:{QUEUE}.msgs", member, json.dumps(raw))
    admin.rpush(f"{SNS}:{QUEUE}", member)
    env = project_env(
        default_project, WORKER_POOL="sandbox", REDIS_URL=as_user(redis_url),
        METRICS_PORT=str(testing.free_port()), WORKER_STATE_DIR=str(tmp_path / "state"),
        WORKER_PROCESSES="1",
    )  # fmt: skip
    worker = started(default_project, env)
    try:
        wait_for(lambda: admin.hlen(f"{SNS}:{QUEUE}.msgs") == 0, 60, "the member acked", worker)
        time.sleep(2)  # a requeued member would run again now
    finally:
        output = stopped(worker)
    assert output.count('"sandbox run finished"') == 1, output[-3000:]
    assert output.count("group completion not recorded") == 1, output[-3000:]
    assert admin.llen(f"{SNS}:{QUEUE}") == 0 and admin.zcard(f"{SNS}:{QUEUE}.XQ") == 0


DISPATCH = Path(dramatiq.__file__).parent / "brokers" / "redis" / "dispatch.lua"


def test_the_acl_user_cannot_touch_another_pools_keys(
    redis_url: str, sandbox_user: redis.Redis
) -> None:
    admin = sandbox_user
    dead, before = plant_other_pools(admin)
    acks = f"{NS}:__acks__.{dead}.payments"
    heartbeats = f"{NS}:__heartbeats__"
    user = redis.Redis.from_url(as_user(redis_url))
    assert user.ping()
    dispatch = DISPATCH.read_text()
    attempts: dict[str, Callable[[], object]] = {
        "enqueue (Lua declaring its own key)": lambda: user.eval(
            f"redis.call('hset', '{NS}:payments.msgs', 'm2', 'x');"
            f"return redis.call('rpush', '{NS}:payments', 'm2')", 1, SNS),
        "enqueue (Dramatiq's dispatch script)": lambda: user.eval(
            dispatch, 1, NS, "enqueue", 1, "payments", "w", 30000, 1, 0, 1000, "m4", "{}"),
        "fetch (Dramatiq's dispatch script)": lambda: user.eval(
            dispatch, 1, NS, "fetch", 1, "payments", "w", 30000, 1, 0, 1000, 10),
        "enqueue (direct)": lambda: user.rpush(f"{NS}:payments", "m3"),
        "read the queue": lambda: user.lrange(f"{NS}:payments", 0, -1),
        "read a message": lambda: user.hgetall(f"{NS}:payments.msgs"),
        "read via a script": lambda: user.eval("return redis.call('hgetall', KEYS[1])", 1,
                                               f"{NS}:payments.msgs"),
        "delete the queue": lambda: user.delete(f"{NS}:payments"),
        "forge a heartbeat": lambda: user.zadd(heartbeats, {dead: time.time() * 1000}),
        "remove a heartbeat": lambda: user.zrem(heartbeats, dead),
        "read the heartbeats": lambda: user.zrange(heartbeats, 0, -1),
        "forge a heartbeat by script": lambda: user.eval(
            "return redis.call('zadd', string.gsub(KEYS[1], '-sandbox', '') .. "
            "':__heartbeats__', 1, 'x')", 1, SNS),
        "empty an acks set": lambda: user.srem(acks, "p1"),
        "read an acks set": lambda: user.smembers(acks),
        "delay queue": lambda: user.rpush(f"{NS}:payments.DQ", "m5"),
        "delayed bodies": lambda: user.hgetall(f"{NS}:payments.DQ.msgs"),
        "dead letters": lambda: user.zrange(f"{NS}:payments.XQ", 0, -1),
        "dead-letter bodies": lambda: user.hdel(f"{NS}:payments.XQ.msgs", "p3"),
        "rename out of its namespace": lambda: user.rename(f"{SNS}:x", f"{NS}:payments"),
        "flush everything": lambda: user.flushall(),
        "list keys": lambda: user.keys("*"),
        "reconfigure": lambda: user.config_get("*"),
        "flush scripts": lambda: user.script_flush(),
    }  # fmt: skip
    user.set(f"{SNS}:x", "x")
    allowed = []
    for name, attempt in attempts.items():
        try:
            attempt()
        except (redis.exceptions.NoPermissionError, redis.exceptions.ResponseError) as exc:
            assert "permission" in str(exc).lower() or "can't access" in str(exc), (
                name, exc)  # fmt: skip
        else:
            allowed.append(name)
    assert allowed == []
    assert snapshot(admin) == before
    # while its own namespace works, Dramatiq's dispatch script included
    assert user.eval(dispatch, 1, SNS, "enqueue", 1, QUEUE, "w", 30000, 1, 0, 1000, "u1", "{}") \
        is None  # fmt: skip
    assert user.lrange(f"{SNS}:{QUEUE}", 0, -1) == [b"u1"]
    assert user.zscore(f"{SNS}:__heartbeats__", "w") == 1


def test_rendered_sandbox_pool_logs_in_as_its_own_user(default_project: Path) -> None:
    """`make manifests`: the sandbox namespace's Secret and KEDA's TriggerAuthentication
    carry the ACL user (the password stays a secret), never the shared password alone; its
    scaler watches the lists of the sandbox namespace, the others' their own."""
    import yaml
    from bakery import PYTHON

    done = subprocess.run(["make", "-s", "manifests", "STACK=prod", f"PYTHON={PYTHON}"],
                          cwd=default_project, capture_output=True, text=True, timeout=180,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = (default_project / "build" / "manifests" / "prod.yaml").read_text()
    objects = [o for o in yaml.safe_load_all(text) if o]
    sandbox_ns = f"{default_project.name}-sandbox"
    (secret,) = [o for o in objects if o["kind"] == "Secret"
                 and o["metadata"]["namespace"] == sandbox_ns]  # fmt: skip
    assert set(secret["stringData"]) == {"redis-url", "redis-username", "redis-password"}
    assert set(secret["stringData"].values()) == {"<secret>"}
    (auth,) = [o for o in objects if o["kind"] == "TriggerAuthentication"
               and o["metadata"]["namespace"] == sandbox_ns]  # fmt: skip
    params = {ref["parameter"]: ref["key"] for ref in auth["spec"]["secretTargetRef"]}
    assert params == {"password": "redis-password", "username": "redis-username"}
    lists = {
        o["metadata"]["namespace"] == sandbox_ns: sorted(
            t["metadata"]["listName"] for t in o["spec"]["triggers"] if t["type"] == "redis"
        )
        for o in objects
        if o["kind"] == "ScaledObject" and o["metadata"]["namespace"] == sandbox_ns
    }
    # The ready list and its priority lanes' only: a due delayed message wakes a pool
    # through the age query (#30), and a delay-list trigger woke pools at zero replicas
    # for messages not yet due.
    assert lists == {True: [f"{SNS}:{QUEUE}", f"{SNS}:{QUEUE}.high", f"{SNS}:{QUEUE}.low"]}
    others = [t["metadata"]["listName"] for o in objects if o["kind"] == "ScaledObject"
              and o["metadata"]["namespace"] != sandbox_ns
              for t in o["spec"]["triggers"] if t["type"] == "redis"]  # fmt: skip
    assert others and all(name.startswith(f"{NS}:") for name in others)
