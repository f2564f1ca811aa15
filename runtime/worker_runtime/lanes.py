"""The settle lanes: each handler thread's own Redis connection for the settlement's Lua
call (:class:`SettleLanes`), used by the consumer's broker (:mod:`.consumer`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import hiredis
import redis

logger = logging.getLogger(__name__)


class SettleLanes:
    """Each thread's own Redis connection for the settlement's Lua call (one *lane*).

    A settlement is one command per job on the hot path. Through the client, each one
    checks a connection out of the pool and back in (a lock, a ``poll(2)`` that checks
    the connection holds no stray reply, redis-py's connection-count records) and goes
    through its retry wrapper: about 125 µs per job, a tenth of a no-op job's time, with
    8 threads on a 2-core machine (``bench/`` in the template). A lane is used by its
    thread alone, one command and its reply at a time, so no stray reply can wait on it:
    any failure between the command and its reply disconnects it. What fails on a lane
    (a lost connection, a script cache flushed by a restarted Redis, a primary demoted by a
    failover) is sent again
    through the client, whose pool and retries handle it as for any other command; when
    Redis had run it, the outcome is not stored twice (its removal from the acks set guards it)
    and the first call's refill is requeued by :meth:`SettlingConsumer.reclaim_orphans`.

    Parameters:
      client: the broker's client; a lane is made by its pool (same address,
        credentials, TLS, timeouts and health checks), but never returned to it.
    """

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._mine = threading.local()
        self._made: list[Any] = []
        self._made_lock = threading.Lock()

    def call(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run ``script`` (a registered :class:`redis.commands.core.Script`) with ``keys``
        and ``args`` on this thread's lane; through the client if that fails."""
        connection = getattr(self._mine, "connection", None)
        if connection is None:
            connection = self._mine.connection = self._pool.make_connection()
            with self._made_lock:
                self._made.append(connection)
        self._mine.resent = False
        sent = False
        try:
            # Packed by hiredis itself: redis-py's packer walks every argument in Python
            # first (a settlement has about 35), some 4 µs per job.
            command = ("EVALSHA", script.sha, len(keys), *keys, *args)
            connection.send_packed_command([hiredis.pack_command(command)])
            sent = True
            return connection.read_response()
        except redis.exceptions.NoScriptError:
            pass  # a restarted Redis lost its script cache: the client's call loads it
        except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
            # READONLY: the node was demoted and wrote nothing; the client's call finds the
            # primary (:mod:`.redisclient`).
            connection.disconnect()
            self._mine.resent = sent  # sent, no reply: Redis may have run it
        except BaseException:
            # Anything else: a Redis error reply, or an exception raised in this thread
            # (by a signal) between the command and its reply, which must not be read as
            # the next command's.
            connection.disconnect()
            raise
        return script(keys=keys, args=args)

    def resent(self) -> bool:
        """Whether this thread's last :meth:`call` was sent again through the client after
        its lane sent it and got no reply (then Redis may have run it twice: its guard
        made the second a no-op)."""
        return bool(getattr(self._mine, "resent", False))

    def close(self) -> None:
        """Disconnect every thread's lane (they reconnect if used again)."""
        with self._made_lock:
            made, self._made = self._made, []
        for connection in made:
            connection.disconnect()

    def connections(self) -> list[Any]:
        """Every thread's lane (a connection of the client's pool, not in it)."""
        with self._made_lock:
            return list(self._made)
