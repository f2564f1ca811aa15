"""Job results: Dramatiq's Results ``RedisBackend`` on the broker's Redis, with a size cap.

An actor declared with ``store_results=True`` has its return value stored for
``RESULT_TTL_MS`` (default 10 minutes), and read by any process with
``message.get_result(block=True, timeout=ms)``; a message dead-lettered (retries used up, an
error listed in ``throws``, invalid arguments) stores its error instead, which
``get_result`` raises as ``dramatiq.results.ResultFailure``.

``get_result(block=True, timeout=ms)`` waits the whole ``timeout`` (Dramatiq's Redis backend
waits in whole seconds, and one wait longer than the client's 10 s socket timeout raised a
``TimeoutError``).

A result whose JSON is bigger than ``RESULT_MAX_BYTES`` (default 1 MiB) is not stored:
:class:`ResultTooLargeError` is stored in its place (``get_result`` raises it as a
``ResultFailure`` naming the size), so one huge return value cannot fill the broker's Redis.
Store big outputs elsewhere (a bucket, a table) and return their key.

A result that is not JSON (a set, bytes, an object) cannot be stored: the job fails (outcome
``failure``, dead-lettered with the reason, in one ``job_end`` line) and
:class:`ResultNotStorableError` is stored in its place, so the caller's ``get_result`` raises
it at once as a ``ResultFailure`` naming the type, instead of waiting for a result that never
comes (:class:`.middleware.StoredResults`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from dramatiq.results import ResultTimeout
from dramatiq.results.backend import DEFAULT_TIMEOUT
from dramatiq.results.backends.redis import RedisBackend
from dramatiq.results.result import wrap_exception

from . import layout

logger = logging.getLogger(__name__)

#: Longest single wait (s) of a blocking ``get_result``: below the broker client's socket
#: timeout (10 s), which would otherwise end a longer wait with a ``TimeoutError``.
WAIT_SLICE_S = 5.0


class ResultTooLargeError(Exception):
    """Stored in place of a result over ``RESULT_MAX_BYTES``."""


class ResultNotStorableError(TypeError):
    """A result that is not JSON; ``str()`` names the type (json's own words)."""


class CappedResults(RedisBackend):
    """Dramatiq's Redis result backend on ``client``, keys under
    :data:`.layout.RESULTS_NAMESPACE`, refusing results over ``max_bytes``.

    Parameters:
      client: the broker's Redis client (Sentinel-aware: it follows the primary).
      max_bytes: ``RESULT_MAX_BYTES``; None (a producer, which only reads): no cap.
    """

    def __init__(self, client: redis.Redis, max_bytes: int | None = None) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            client=client, namespace=layout.RESULTS_NAMESPACE, use_namespace_prefix_keys=True
        )
        self.max_bytes = max_bytes

    def get_result(self, message: Any, *, block: bool = False, timeout: int | None = None) -> Any:
        """Dramatiq's, waiting (``block``) in slices of :data:`WAIT_SLICE_S` until ``timeout``
        ms (default 10 s) have passed, to the millisecond: Dramatiq's waits in whole seconds,
        in one call that the client's socket timeout cuts at 10 s."""
        if not block:
            return super().get_result(message, block=False)  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + (DEFAULT_TIMEOUT if timeout is None else timeout) / 1000
        key = self.build_message_key(message)
        while (left := deadline - time.monotonic()) > 0:
            data = self.client.brpoplpush(key, key, round(min(left, WAIT_SLICE_S), 3) or 0.001)
            if isinstance(data, bytes):
                return self.unwrap_result(self.encoder.decode(data))  # type: ignore[no-untyped-call]
        raise ResultTimeout(message)

    def _store(self, message_key: str, result: Any, ttl: int) -> None:
        """Store ``result`` (Dramatiq's ``Result`` wrapping); :class:`ResultNotStorableError`
        when it is not JSON (nothing stored)."""
        try:
            data = self.encoder.encode(result)
        except (TypeError, ValueError) as error:  # json: a type it cannot encode, a cycle
            raise ResultNotStorableError(str(error)) from None
        if self.max_bytes is not None and len(data) > self.max_bytes:
            problem = f"result of {len(data)} bytes is over RESULT_MAX_BYTES ({self.max_bytes})"
            logger.warning("result not stored: %s", problem, extra={"result_key": message_key})
            data = self.encoder.encode(wrap_exception(ResultTooLargeError(problem)))
        with self.client.pipeline() as pipe:  # Dramatiq's _store, without encoding again
            pipe.delete(message_key)
            pipe.lpush(message_key, data)
            pipe.pexpire(message_key, ttl)
            pipe.execute()
