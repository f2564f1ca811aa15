"""ArgumentModels: a typed actor's message is validated before its handler runs; a message
whose arguments do not fit is dead-lettered at once, never retried."""

from __future__ import annotations

from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage

from ..layout import SCHEMA_VERSION
from ..settlement import dead_letter_delivery
from ..typed import InvalidArgumentsError, TypedActor, forget, prepare

#: The dead-letter reason's prefix (``dlq list`` shows it).
REASON_PREFIX = "invalid arguments: "


class ArgumentModels(Middleware):
    """Validates each message of a :class:`..typed.TypedActor` against its model (and schema
    version) before the handler runs, and hands the model to it. A message that fails is
    dead-lettered with the reason ``invalid arguments: <field>: <rule> (got ...)``,
    counted as ``dead_letter`` and never retried: the same body would fail again. Messages
    of other actors pass untouched (one dictionary look-up)."""

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        actor = broker.actors.get(message.actor_name)
        if not isinstance(actor, TypedActor):
            return
        try:
            prepare(actor, message.args, message.kwargs, message.options.get(SCHEMA_VERSION))
        except InvalidArgumentsError as error:
            dead_letter_delivery(broker, message, REASON_PREFIX + error.detail)
            raise SkipMessage(str(error)) from None

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        forget()
