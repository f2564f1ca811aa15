"""Every Redis client of the service is made here, from ``REDIS_URL``.

``REDIS_URL`` is one of:

* ``redis://[user:password@]host:port/<db>``, ``rediss://...`` (TLS) or
  ``unix:///path/to/socket?db=<db>``: one node;
* ``redis+sentinel://[user:password@]host:port[,host:port...]/<service>[/<db>]``
  ``[?sentinel_password=<password>[&sentinel_username=<user>]]``: the primary of
  ``<service>`` as the Sentinels name it, through redis-py's own
  :class:`redis.sentinel.Sentinel` (a failover moves every client to the promoted
  replica). The userinfo is the Redis nodes' credentials; Sentinels that need a password
  (``requirepass`` in sentinel.conf) get ``sentinel_password`` (and ``sentinel_username``
  for an ACL user) through redis-py's ``sentinel_kwargs``; without it they are asked
  without credentials.

At boot, :func:`credentials_problem` turns credentials that Redis or the Sentinels refuse
into one line (the worker exits 78), instead of a worker that retries a refused AUTH for
ever.

A node that was demoted to a replica answers writes with ``READONLY``: nothing was written,
so the command is sent again on a new connection (redis-py's :class:`~redis.retry.Retry`,
:data:`READONLY_RETRIES` times), which asks the Sentinels for the primary, or resolves the
host name again (a managed Redis whose primary endpoint is a DNS name that moves on a
failover). Lost connections are not retried here: a command whose reply was lost may have
run, and the callers (the consumer, the settlement) know what is safe to send again.
Readiness says when the node is a replica (:func:`role_problem`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

#: The scheme of a Sentinel ``REDIS_URL``.
SENTINEL_SCHEME = "redis+sentinel"
#: The schemes of one node.
NODE_SCHEMES = ("redis", "rediss", "unix")
#: Times a command refused with READONLY is sent again on a new connection; with the
#: backoff below (0.1 s doubling to 1 s) it waits up to about 3 s for the Sentinels (or
#: the DNS name) to point at the promoted primary.
READONLY_RETRIES = 5
READONLY_BACKOFF_S = (0.1, 1.0)
#: A Sentinel's port when the URL gives none (Redis's own default).
SENTINEL_PORT = 26379
#: The query options of a ``redis+sentinel://`` URL: the Sentinels' own credentials.
SENTINEL_OPTIONS = ("sentinel_password", "sentinel_username")


@dataclass(frozen=True)
class SentinelAddress:
    """A parsed ``redis+sentinel://`` URL.

    Parameters:
      sentinels: the Sentinels' (host, port), in the URL's order.
      service: the name the Sentinels monitor the primary under (``sentinel monitor <name>``).
      db: the database number (default 0).
      username, password: the Redis nodes' credentials (None: none).
      sentinel_username, sentinel_password: the Sentinels' own (``?sentinel_username=``,
        ``?sentinel_password=``; None: the Sentinels are asked without credentials).
    """

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    def sentinel_kwargs(self, **timeouts: float) -> dict[str, Any]:
        """redis-py's ``sentinel_kwargs``: how each Sentinel is connected to."""
        found: dict[str, Any] = dict(timeouts)
        if self.sentinel_password is not None:
            found["password"] = self.sentinel_password
        if self.sentinel_username is not None:
            found["username"] = self.sentinel_username
        return found


def parse_sentinel_url(url: str) -> SentinelAddress:
    """``url`` (``redis+sentinel://...``) parsed; ``ValueError`` with one line when it is not
    ``redis+sentinel://[user:password@]host:port[,host:port...]/<service>[/<db>]`` with at
    most the query options of :data:`SENTINEL_OPTIONS`."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ValueError(f"must start with {SENTINEL_SCHEME}://")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = []
    for entry in (host.strip() for host in hosts.split(",")):
        name, colon, port = entry.rpartition(":") if ":" in entry else (entry, "", "")
        if not name.strip("[]"):
            raise ValueError(f"needs host:port of each Sentinel, got {entry!r}")
        if colon and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"has a malformed port in {entry!r}")
        sentinels.append((name.strip("[]"), int(port) if colon else SENTINEL_PORT))
    path = [segment for segment in parts.path.split("/") if segment]
    if not path or len(path) > 2:
        raise ValueError("needs the service name: redis+sentinel://host:port,.../<service>[/<db>]")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise ValueError(f"database must be a number, got {path[1]!r}")
        db = int(path[1])
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in SENTINEL_OPTIONS:
            raise ValueError(
                f"has an unknown option {name!r} (known: {', '.join(SENTINEL_OPTIONS)})"
            )
        options[name] = value
    return SentinelAddress(
        tuple(sentinels),
        unquote(path[0]),
        db,
        username,
        password,
        sentinel_username=options.get("sentinel_username") or None,
        sentinel_password=options.get("sentinel_password") or None,
    )


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a ``REDIS_URL`` this service can use, or None (the rule of
    ``REDIS_URL``: one line, the value's problem)."""
    parts = urlsplit(url)
    if parts.scheme == SENTINEL_SCHEME:
        try:
            parse_sentinel_url(url)
        except ValueError as error:
            return str(error)
        return None
    if parts.scheme not in NODE_SCHEMES:
        return f"must start with redis://, rediss://, unix:// or {SENTINEL_SCHEME}://"
    if parts.scheme == "unix" and not parts.path:
        return "unix:// URL needs a socket path"
    if parts.scheme != "unix" and not parts.hostname:
        return "needs a host, e.g. redis://redis:6379/0"
    try:
        parts.port  # noqa: B018  (raises on a malformed port)
    except ValueError:
        return "has a malformed port"
    return None


class _FailoverConnection(SentinelManagedConnection):
    """redis-py's Sentinel connection, except that READONLY stays ``ReadOnlyError`` (redis-py
    turns it into a ``ConnectionError``, which is not retried here: see the module
    docstring) after the disconnect that makes the next connect ask the Sentinels again."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return redis.Connection.read_response(self, *args, **kwargs)
        except redis.ReadOnlyError:
            self.disconnect()  # type: ignore[no-untyped-call]
            raise


def _retry() -> Retry:
    """A new READONLY retry policy (each client gets its own: redis-py copies it per
    connection)."""
    base, cap = READONLY_BACKOFF_S
    return Retry(
        ExponentialWithJitterBackoff(base=base, cap=cap),
        READONLY_RETRIES,
        supported_errors=(redis.ReadOnlyError,),
    )


def connect(
    url: str,
    *,
    socket_timeout: float,
    socket_connect_timeout: float,
    health_check_interval: int = 0,
    max_connections: int | None = None,
) -> redis.Redis:
    """A client of ``url`` (a ``REDIS_URL`` that :func:`url_problem` accepts).

    Parameters:
      socket_timeout, socket_connect_timeout: seconds, for the nodes and the Sentinels.
      health_check_interval: PING a connection idle this many seconds before using it
        (0: never).
      max_connections: the most connections its pool makes (None: redis-py's default, 100).
    """
    options: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_connect_timeout,
        "health_check_interval": health_check_interval,
        "retry": _retry(),
    }
    if max_connections is not None:
        options["max_connections"] = max_connections
    if urlsplit(url).scheme != SENTINEL_SCHEME:
        return redis.Redis.from_url(url, **options)
    address = parse_sentinel_url(url)
    kwargs = address.sentinel_kwargs(
        socket_timeout=socket_timeout, socket_connect_timeout=socket_connect_timeout
    )
    sentinels = list(address.sentinels)
    sentinel = Sentinel(sentinels, sentinel_kwargs=kwargs)  # type: ignore[no-untyped-call]
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        address.service,
        redis_class=redis.Redis,
        connection_class=_FailoverConnection,
        db=address.db,
        username=address.username,
        password=address.password,
        **options,
    )
    return client


def bound_timeouts(client: redis.Redis, seconds: float, more: Iterable[Any] = ()) -> None:
    """From now on no command of ``client`` (nor of the connections ``more``, made by its
    pool) waits longer than ``seconds`` for Redis, to connect or for a reply: the drain's
    bound on a Redis that stopped answering (a blackholed path answers nothing, and each
    call would wait the whole ``socket_timeout``). A call already waiting keeps its own.

    redis-py sets a connection's timeouts when it is made: the pool's arguments are changed
    for the connections it makes next, and each connection it made (and ``more``) is changed
    in place, its socket's timeout too."""
    pool = client.connection_pool
    for option in ("socket_timeout", "socket_connect_timeout"):
        current = pool.connection_kwargs.get(option)
        pool.connection_kwargs[option] = seconds if current is None else min(current, seconds)
    made = [*getattr(pool, "_available_connections", ()), *getattr(pool, "_in_use_connections", ())]
    for connection in [*made, *more]:
        connection.socket_timeout = min(connection.socket_timeout or seconds, seconds)
        connection.socket_connect_timeout = min(
            connection.socket_connect_timeout or seconds, seconds
        )
        sock = getattr(connection, "_sock", None)
        if sock is not None:  # closed meanwhile: it reconnects with the new timeouts
            with contextlib.suppress(OSError):
                sock.settimeout(connection.socket_timeout)


def role_problem(client: redis.Redis) -> str | None:
    """Why the node ``client`` talks to cannot take this service's writes, or None: it is a
    replica (a failover demoted it, or ``REDIS_URL`` names a replica). Raises
    ``redis.RedisError`` when the node does not answer."""
    replication: dict[str, Any] = client.info("replication")
    role = str(replication.get("role", "master"))
    if role == "master":
        return None
    primary = f"{replication.get('master_host', '?')}:{replication.get('master_port', '?')}"
    return (
        f"connected to a replica (role {role}, of {primary}): writes are refused; point "
        f"REDIS_URL at the primary, or use {SENTINEL_SCHEME}:// to follow failovers"
    )


#: The starts of Redis's replies to a refused AUTH or to a command sent without one.
AUTH_REFUSALS = ("WRONGPASS", "NOAUTH", "invalid password", "invalid username-password")


def _refused_auth(error: redis.RedisError) -> bool:
    text = str(error)
    return isinstance(error, redis.AuthenticationError) or any(
        text.startswith(prefix) for prefix in AUTH_REFUSALS
    )


def credentials_problem(url: str, client: redis.Redis, timeout_s: float = 2.0) -> str | None:
    """Why Redis, or the Sentinels of a ``redis+sentinel://`` ``url``, refuse its credentials:
    one line for the refusal at boot; None when they take them, and when nothing answers
    (an outage is not a configuration error: the worker waits for Redis).

    Parameters:
      url: ``REDIS_URL``.
      client: a client of ``url`` (:func:`connect`).
      timeout_s: seconds each Sentinel gets to answer.
    """
    if urlsplit(url).scheme == SENTINEL_SCHEME:
        address = parse_sentinel_url(url)
        refusals = []
        for host, port in address.sentinels:
            kwargs = address.sentinel_kwargs(
                socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
            try:
                with redis.Redis(host=host, port=port, **kwargs) as sentinel:
                    sentinel.ping()
            except redis.RedisError as error:
                if _refused_auth(error):
                    refusals.append(f"{host}:{port}: {error}")
                continue
            refusals = []
            break  # one Sentinel takes them: a wrong one elsewhere is that one's problem
        if refusals:
            given = (
                "the sentinel_password given"
                if address.sentinel_password
                else "a connection without sentinel_password"
            )
            return (
                f"REDIS_URL: the Sentinels refuse {given} ({len(refusals)} of "
                f"{len(address.sentinels)}; {refusals[0]}); set ?sentinel_password= to their "
                "requirepass"
            )
    try:
        client.ping()
    except redis.RedisError as error:
        if _refused_auth(error):
            return (
                f"REDIS_URL: Redis refuses its credentials ({error}); set the user and "
                "password of the URL to an ACL user's or requirepass"
            )
    return None
