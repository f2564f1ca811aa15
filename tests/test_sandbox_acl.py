"""The sandbox pool's Redis ACL user, against a real redis-server: the baked sandbox worker
runs its `untrusted` queue as that user without one refusal, and the same credential is
refused on another pool's queue (enqueue, read) and on the server (FLUSHALL, KEYS, ...)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from bakery import BAKED_FIXTURES, package_of, project_env
from worker_infra.acl import acl_key_patterns, acl_rule

USER, PASSWORD = "orders-worker-sandbox", "s3cret/with:odd@chars"
NS = "dramatiq"


def as_user(redis_url: str) -> str:
    from urllib.parse import quote

    parts = urlsplit(redis_url)
    netloc = f"{quote(USER, safe='')}:{quote(PASSWORD, safe='')}@{parts.hostname}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@pytest.fixture
def sandbox_user(redis_url: str) -> redis.Redis:
    admin = redis.Redis.from_url(redis_url)
    words = acl_rule(USER, PASSWORD, ["untrusted"]).split()
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


def test_rule_names_only_the_pools_keys() -> None:
    rule = acl_rule(USER, PASSWORD, ["untrusted"])
    assert PASSWORD not in rule
    assert "~*" not in rule.split() and "allkeys" not in rule and "+@all" not in rule
    assert all("untrusted" in p or p in ("~dramatiq", "~dramatiq:__heartbeats__")
               for p in acl_key_patterns(["untrusted"]))  # fmt: skip
    with pytest.raises(ValueError, match="pattern"):
        acl_key_patterns(["untrusted*"])
    with pytest.raises(ValueError, match="one word"):
        acl_rule("two words", PASSWORD, ["untrusted"])


def test_sandbox_worker_runs_as_the_acl_user(
    default_project: Path, redis_url: str, sandbox_user: redis.Redis, tmp_path: Path
) -> None:
    """The real `worker` command of the sandbox pool, logged in as the ACL user."""
    admin = sandbox_user
    env = project_env(
        default_project,
        WORKER_POOL="sandbox",
        REDIS_URL=as_user(redis_url),
        METRICS_PORT=str(BAKED_FIXTURES.free_port()),
        WORKER_STATE_DIR=str(tmp_path / "state"),
        WORKER_PROCESSES="1",
    )
    package = package_of(default_project)
    send = (
        f"from {package}.actors.sandbox import run_customer_code\n"
        "run_customer_code.send('def main(p):\\n    return p + 1\\n', 41)\n"
        "run_customer_code.send('def main(p):\\n    while True:\\n        pass\\n', None,"
        " {'cpu_seconds': 1})\n"
    )
    sent = subprocess.run([sys.executable, "-c", send], env=env, cwd=default_project,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert sent.returncode == 0, sent.stderr[-2000:]
    assert admin.llen(f"{NS}:untrusted") == 2
    worker = subprocess.Popen(
        [sys.executable, "-m", package, "worker"], env=env, cwd=default_project,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if admin.llen(f"{NS}:untrusted") == 0 and admin.hlen(f"{NS}:untrusted.msgs") == 0:
                break
            assert worker.poll() is None, worker.stdout.read() if worker.stdout else ""
            time.sleep(0.2)
        else:
            pytest.fail("the sandbox worker did not process the untrusted queue")
        time.sleep(1.5)  # a heartbeat and a recovery round as the ACL user
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            output, _ = worker.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            output, _ = worker.communicate()
    assert worker.returncode == 0, output[-3000:]
    assert '"sandbox_status": "ok"' in output or "sandbox run finished" in output, output[-3000:]
    assert admin.hlen(f"{NS}:untrusted.XQ.msgs") == 0, "a sandbox job was dead-lettered"
    assert denials(admin) == [], "the sandbox worker needed more than its ACL allows"


def test_the_acl_user_cannot_touch_another_pools_queue(
    default_project: Path, redis_url: str, sandbox_user: redis.Redis
) -> None:
    admin = sandbox_user
    admin.hset(f"{NS}:payments.msgs", "m1", b'{"secret": "card 4242"}')
    admin.rpush(f"{NS}:payments", "m1")
    user = redis.Redis.from_url(as_user(redis_url))
    assert user.ping()
    denied = redis.exceptions.NoPermissionError
    attempts = {
        "enqueue (Dramatiq's Lua)": lambda: user.eval(
            "redis.call('hset', KEYS[1] .. ':payments.msgs', 'm2', 'x');"
            "return redis.call('rpush', KEYS[1] .. ':payments', 'm2')", 1, NS),
        "enqueue (direct)": lambda: user.rpush(f"{NS}:payments", "m3"),
        "read the queue": lambda: user.lrange(f"{NS}:payments", 0, -1),
        "read a message": lambda: user.hgetall(f"{NS}:payments.msgs"),
        "read via a script": lambda: user.eval("return redis.call('hgetall', KEYS[1])", 1,
                                               f"{NS}:payments.msgs"),
        "fetch (Dramatiq's Lua)": lambda: user.eval(
            "return redis.call('lpop', KEYS[1] .. ':payments')", 1, NS),
        "delete the queue": lambda: user.delete(f"{NS}:payments"),
        "flush everything": lambda: user.flushall(),
        "list keys": lambda: user.keys("*"),
        "reconfigure": lambda: user.config_get("*"),
        "flush scripts": lambda: user.script_flush(),
    }  # fmt: skip
    allowed = []
    for name, attempt in attempts.items():
        try:
            attempt()
        except (denied, redis.exceptions.ResponseError) as exc:
            assert "permission" in str(exc).lower() or "can't access" in str(exc), (
                name, exc)  # fmt: skip
        else:
            allowed.append(name)
    assert allowed == []
    assert admin.lrange(f"{NS}:payments", 0, -1) == [b"m1"]
    assert admin.hkeys(f"{NS}:payments.msgs") == [b"m1"]
    # while its own queue works
    user.hset(f"{NS}:untrusted.msgs", "u1", "x")
    user.rpush(f"{NS}:untrusted", "u1")
    assert user.lpop(f"{NS}:untrusted") == b"u1"


def test_rendered_sandbox_pool_logs_in_as_its_own_user(default_project: Path) -> None:
    """`make manifests`: the sandbox namespace's Secret and KEDA's TriggerAuthentication
    carry the ACL user (the password stays a secret), never the shared password alone."""
    import yaml
    from bakery import PYTHON

    done = subprocess.run(["make", "-s", "manifests", "STACK=prod", f"PYTHON={PYTHON}"],
                          cwd=default_project, capture_output=True, text=True, timeout=180)  # fmt: skip
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
