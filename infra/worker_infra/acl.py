"""The sandbox pool's own Redis ACL user: its broker namespace's keys and nothing else.

The sandbox pool runs customer code. Should a snippet ever escape into its worker, the
broker credential it finds must not reach other pools' keys (enqueue onto ``payments``,
read their messages, forge or remove their heartbeats, empty their acks sets, delay or
dead-letter queues) nor the server itself (``FLUSHALL``, ``CONFIG``, ``KEYS``). These pure
functions render the Redis ACL rule of that user (Redis 6.2+ ACL syntax, for an
``aclfile`` line or ``ACL SETUSER``) and the ``REDIS_URL`` that logs in as it.

Keys: the sandbox pool's queue lives in a broker namespace of its own (the service's
``layout.SANDBOX_NAMESPACE``, ``dramatiq-sandbox``; the pool's ``broker_namespace``):
its queue, delay queue, dead letters, acknowledgement sets and heartbeat set are all
``<ns>:...``, disjoint from every other pool's ``dramatiq:...`` keys. The user gets
``~<ns>:*`` and ``~<ns>`` (the name Dramatiq's Lua script declares as its key).

Commands: reading, writing and scripting on those keys (a script's ``redis.call`` is
checked against the same rule), ``SCAN`` (crash recovery looks for acknowledgement
sets), ``TIME`` (heartbeats and recovery judge time by Redis's clock), connection
commands; not ``@dangerous`` (``FLUSHALL``, ``KEYS``, ``CONFIG``, ``INFO``, ``DEBUG``,
...), not ``SCRIPT FLUSH``/``KILL``, no ``FUNCTION``, no Pub/Sub channels.
"""

from __future__ import annotations

import hashlib
from urllib.parse import quote

import pulumi

from .args import BrokerSpec
from .keys import NAMESPACE, namespace_glob

__all__ = ["ACL_COMMANDS", "acl_broker_url", "acl_key_patterns", "acl_rule", "password_sha256"]

#: Command rules of the sandbox user, applied left to right.
ACL_COMMANDS: tuple[str, ...] = (
    "-@all", "+@read", "+@write", "+@scripting", "+@connection", "+@keyspace", "+scan", "+time",
    "-@dangerous", "+info", "-@admin", "-script|flush", "-script|kill", "-function",
    "-move", "-copy", "-migrate", "-swapdb", "-publish", "-spublish",
)  # fmt: skip

_GLOB = "*?[]\\"


def password_sha256(password: str) -> str:
    """The ``#<hex>`` form of a password in an ACL rule (the password itself stays out)."""
    return hashlib.sha256(password.encode()).hexdigest()


def acl_key_patterns(namespace: str) -> list[str]:
    """Every key a worker of the broker namespace ``namespace`` touches, as ACL key
    patterns: ``~<namespace>`` and ``~<namespace>:*``.

    Parameters:
      namespace: the pool's broker namespace (``dramatiq-sandbox``); never ``dramatiq``,
        which every other pool shares.
    """
    if not namespace or any(c in namespace for c in _GLOB + ": \t\r\n"):
        raise ValueError(f"broker namespace {namespace!r} cannot be used in an ACL key pattern")
    if namespace == NAMESPACE:
        raise ValueError(f"the sandbox user cannot share the broker namespace {NAMESPACE!r}")
    return [f"~{namespace}", f"~{namespace_glob(namespace)}"]


def acl_rule(username: str, password: str, namespace: str) -> str:
    """The ACL rule of the sandbox user, e.g. for a line of a Redis ``aclfile``.

    Parameters:
      username: the Redis user (e.g. ``orders-worker-sandbox``).
      password: its password (rendered only as its SHA-256).
      namespace: the sandbox pool's broker namespace (``dramatiq-sandbox``).

    Returns:
      str: ``user <name> reset on #<sha256> resetchannels ~<keys>... <commands>...``;
      ``ACL SETUSER`` takes the same words after the name.
    """
    if not username or any(c.isspace() for c in username):
        raise ValueError(f"Redis user name {username!r} must be one word")
    if not password:
        raise ValueError("the sandbox's Redis user needs a password")
    words = ["user", username, "reset", "on", f"#{password_sha256(password)}", "resetchannels"]
    words += acl_key_patterns(namespace)
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
