"""ProgressRecorder: records on the process's progress board when each handler starts and ends."""

from __future__ import annotations

import itertools
from typing import Any

from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.worker import WorkerThread

from ..layout import REDIS_MESSAGE_ID
from ..lifecycle import LIFECYCLE, Lifecycle


class ProgressRecorder(Middleware):
    """Gives each handler thread a slot on the board; marks job starts and ends.

    ``healthcheck live`` reads the board: a slot busy with no progress for longer
    than ``HEALTH_STALLED_AFTER_S`` is a wedged handler. ``checkpoint()`` records
    progress on the same slot.

    Parameters:
      lifecycle: holds the board the runtime attaches (default: this process's).
    """

    def __init__(self, lifecycle: Lifecycle = LIFECYCLE) -> None:
        self.lifecycle = lifecycle
        self._slots = itertools.count()

    def after_worker_thread_boot(self, broker: Broker, thread: WorkerThread) -> None:
        self.lifecycle.bind_slot(next(self._slots))

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self.lifecycle.clear_report()
        board, slot = self.lifecycle.board, self.lifecycle.current_slot()
        if board is not None and slot is not None:
            board.start(slot, message.options.get(REDIS_MESSAGE_ID, ""), message.queue_name)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self.lifecycle.clear_report()
        board, slot = self.lifecycle.board, self.lifecycle.current_slot()
        if board is not None and slot is not None:
            board.finish(slot)

    after_skip_message = after_process_message
