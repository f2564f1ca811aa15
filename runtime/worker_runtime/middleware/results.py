"""StoredResults: Dramatiq's Results, acting only for a job that stores or returns a result."""

from __future__ import annotations

from typing import Any

from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.results import Results

from ..resultstore import ResultNotStorableError
from ..settlement import dead_letter_delivery


class StoredResults(Results):
    """Dramatiq's :class:`~dramatiq.results.Results` (``store_results=True``; the backend is
    :class:`..resultstore.CappedResults`), whose per-job hook returns at once for a job that
    returned None and does not store results: most jobs. Dramatiq's looks its options up for
    every job.

    A result that is not JSON fails the job instead of vanishing (Dramatiq logs a CRITICAL
    from its hook and counts a success, and the caller waits its whole timeout): the
    delivery is dead-lettered with the reason (outcome ``failure``), and the error is stored
    as its result when Dramatiq's ``after_nack`` stores a failed job's exception.

    Parameters:
      backend: the result backend.
      result_ttl: ``RESULT_TTL_MS`` (None: Dramatiq's default, 10 minutes).
    """

    def __init__(self, *, backend: Any, result_ttl: int | None = None) -> None:
        super().__init__(backend=backend, result_ttl=result_ttl)  # type: ignore[no-untyped-call]
        #: Actor name -> its ``store_results`` (actors do not change once declared).
        self._stores: dict[str, bool] = {}

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        if result is None:
            name = message.actor_name
            stores = self._stores.get(name)
            if stores is None:
                actor = broker.actors.get(name)
                stores = self._stores[name] = bool(
                    actor is not None and actor.options.get("store_results", self.store_results)
                )
            if not stores and "store_results" not in message.options:
                return
        try:
            super().after_process_message(broker, message, result=result, exception=exception)  # type: ignore[no-untyped-call]
        except ResultNotStorableError as error:
            reason = (
                f"result not stored: actor {message.actor_name!r} returned a value that is not "
                f"JSON ({error}); return a dict, list, str, number, bool or None"
            )
            message.stuff_exception(ResultNotStorableError(reason))
            dead_letter_delivery(broker, message, reason)
