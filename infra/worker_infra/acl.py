"""The sandbox pool's own Redis ACL user: its queues' keys and nothing else.

The sandbox pool runs customer code. Should a snippet ever escape into its worker, the
broker credential it finds must not reach other pools' queues (enqueue onto ``payments``,
read their messages) nor the server itself (``FLUSHALL``, ``CONFIG``, ``KEYS``). These pure
functions render the Redis ACL rule of that user (Redis 6.2+ ACL syntax, for an
``aclfile`` line or ``ACL SETUSER``) and the ``REDIS_URL`` that logs in as it.

Keys (Dramatiq's Redis layout, ``<ns>`` = ``dramatiq``), per queue ``q`` of the pool:
``<ns>:q``, ``<ns>:q.msgs``, ``<ns>:q.DQ``, ``<ns>:q.DQ.msgs``, ``<ns>:q.XQ``,
``<ns>:q.XQ.msgs`` (the queue, its delay queue, its dead letters) and the
acknowledgement sets ``<ns>:__acks__.<broker id>.q`` and ``...q.DQ`` (a broker id is a
UUID: 36 characters, matched with ``?``); plus ``<ns>`` itself (the name Dramatiq's Lua
script declares) and ``<ns>:__heartbeats__`` (one sorted set shared by every worker).

Commands: reading, writing and scripting on those keys (a script's ``redis.call`` is
checked against the same rule), ``SCAN`` (crash recovery looks for acknowledgement
sets), connection commands; not ``@dangerous`` (``FLUSHALL``, ``KEYS``, ``CONFIG``,
``DEBUG``, ...), not ``SCRIPT FLUSH``/``KILL``, no ``FUNCTION``, no Pub/Sub channels.
"""

from __future__ import annotations

import hashlib
from urllib.parse import quote

import pulumi

from .args import BrokerSpec

__all__ = ["ACL_COMMANDS", "acl_broker_url", "acl_key_patterns", "acl_rule", "password_sha256"]

#: Command rules of the sandbox user, applied left to right.
ACL_COMMANDS: tuple[str, ...] = (
    "-@all", "+@read", "+@write", "+@scripting", "+@connection", "+@keyspace", "+scan",
    "-@dangerous", "-@admin", "-script|flush", "-script|kill", "-function",
    "-move", "-copy", "-migrate", "-swapdb", "-publish", "-spublish",
)  # fmt: skip

_BROKER_ID = "?" * 36  # str(uuid4())


def password_sha256(password: str) -> str:
    """The ``#<hex>`` form of a password in an ACL rule (the password itself stays out)."""
    return hashlib.sha256(password.encode()).hexdigest()


def acl_key_patterns(queues: tuple[str, ...] | list[str], namespace: str = "dramatiq") -> list[str]:
    """Every key a worker of ``queues`` touches, as ACL key patterns (``~...``).

    Parameters:
      queues: the pool's queue names (canonical, without ``.DQ``/``.XQ``).
      namespace: Dramatiq's key prefix (default ``dramatiq``).
    """
    patterns = [namespace, f"{namespace}:__heartbeats__"]
    for queue in sorted(set(queues)):
        if not queue or any(c in queue for c in "*?[]\\ \t\r\n"):
            raise ValueError(f"queue name {queue!r} cannot be used in an ACL key pattern")
        for suffix in ("", ".msgs", ".DQ", ".DQ.msgs", ".XQ", ".XQ.msgs"):
            patterns.append(f"{namespace}:{queue}{suffix}")
        for suffix in ("", ".DQ"):
            patterns.append(f"{namespace}:__acks__.{_BROKER_ID}.{queue}{suffix}")
    return [f"~{pattern}" for pattern in patterns]


def acl_rule(
    username: str,
    password: str,
    queues: tuple[str, ...] | list[str],
    namespace: str = "dramatiq",
) -> str:
    """The ACL rule of the sandbox user, e.g. for a line of a Redis ``aclfile``.

    Parameters:
      username: the Redis user (e.g. ``orders-worker-sandbox``).
      password: its password (rendered only as its SHA-256).
      queues: the queues of the sandbox pool (``["untrusted"]``).
      namespace: Dramatiq's key prefix.

    Returns:
      str: ``user <name> reset on #<sha256> resetchannels ~<keys>... <commands>...``;
      ``ACL SETUSER`` takes the same words after the name.
    """
    if not username or any(c.isspace() for c in username):
        raise ValueError(f"Redis user name {username!r} must be one word")
    if not password:
        raise ValueError("the sandbox's Redis user needs a password")
    words = ["user", username, "reset", "on", f"#{password_sha256(password)}", "resetchannels"]
    words += acl_key_patterns(queues, namespace)
    words += ACL_COMMANDS
    return " ".join(words)


def acl_broker_url(
    broker: BrokerSpec, username: str, password: pulumi.Input[str]
) -> pulumi.Output[str]:
    """``REDIS_URL`` that logs in as ``username`` (a secret Output)."""
    scheme = "rediss" if broker.tls else "redis"
    return pulumi.Output.secret(password).apply(
        lambda pw: (
            f"{scheme}://{quote(username, safe='')}:{quote(pw, safe='')}"
            f"@{broker.address}/{broker.db}"
        )
    )
