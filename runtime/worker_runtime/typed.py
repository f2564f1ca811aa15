"""Typed actors: an actor's arguments are a pydantic model, checked at send and at receipt.

    from pydantic import Field

    from worker_runtime.typed import JobArguments, actor


    class Notification(JobArguments):
        version = 1                                  # the message schema version (below)
        user_id: int
        template: str
        notification_id: str = Field(min_length=1)   # the idempotency key: never empty


    @actor(queue_name="notifications", max_retries=4)
    def send_notification(job: Notification) -> None: ...


    send_notification.send(user_id=7, template="welcome", notification_id="n-1")
    send_notification.send(Notification(user_id=7, template="welcome", notification_id="n-1"))
    send_notification.send(7, "welcome", "n-1")     # positional: the model's field order

* **At send** the arguments are validated into the model; a bad send raises
  :class:`InvalidArgumentsError` (a ``ValueError``) in one line naming the actor, the field and
  the rule, and nothing is enqueued. The message carries the model's JSON (``kwargs``,
  by alias) and its version (``options.schema_version``).
* **At receipt** the worker validates the message again before the handler runs (the
  ``ArgumentModels`` middleware): a message that fails (a buggy or foreign producer, a
  hand-edited replay) is dead-lettered at once with the reason ``invalid arguments: ...``,
  never retried. The handler gets the model instance.

Schema versions across a rolling deploy (old and new workers and producers side by side):
a worker reads messages of its model's ``version``, the previous one (through
:meth:`JobArguments.upgrade`) and the next one (fields it does not know are ignored), and
dead-letters any other with the reason. A message without a version (sent before the
actor was typed) is version 1. The upgrade path, one release per step:

1. *Add a field*: give it a default (old messages lack it), bump ``version``.
2. *Rename a field*: read both names, write the old one for a release
   (``Field(validation_alias=AliasChoices("new", "old"), serialization_alias="old")``);
   once no old worker runs, write the new name; then drop the old name.
3. *Remove a field*: give it a default and stop reading it; a release later, delete it.

A model whose change is no rename and no default (a field's meaning changes) bumps
``version`` and overrides :meth:`JobArguments.upgrade` to turn the previous version's
fields into this one's.

Declaring a typed actor whose function does not take exactly one argument annotated with
a :class:`JobArguments` model raises ``TypeError`` at import, so the worker refuses to
boot (exit 78, one line naming the module).
"""

from __future__ import annotations

import functools
import inspect
import threading
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Final

import dramatiq
from dramatiq import Message
from pydantic import BaseModel, ConfigDict, ValidationError

from .layout import ACTOR_KEY_OPTION, FAIRNESS_KEY_OPTION, SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "InvalidArgumentsError", "JobArguments", "TypedActor", "actor"]

#: The version of a message sent before its actor was typed (it carries none).
FIRST_VERSION: Final = 1


class JobArguments(BaseModel):
    """The arguments of a typed actor. Fields unknown to the model are refused at send.

    Class attributes:
      version: the message schema version this model writes (default 1); bump it with
        each change of the fields (see the module docstring).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: ClassVar[int] = FIRST_VERSION

    @classmethod
    def upgrade(cls, version: int, fields: dict[str, Any]) -> dict[str, Any]:
        """The fields of a message of the previous ``version`` as this version reads them
        (default: as they are; aliases and defaults do the usual renames and additions)."""
        return fields


class InvalidArgumentsError(ValueError):
    """Arguments that do not fit an actor's model: one line naming the actor, the field and
    the rule (:attr:`detail` without the actor's name)."""

    def __init__(self, actor_name: str, detail: str) -> None:
        super().__init__(f"{actor_name}: invalid arguments: {detail}")
        self.actor_name = actor_name
        self.detail = detail


def _one_line(error: ValidationError) -> str:
    """Each of pydantic's errors as ``field: rule (got value)``, joined on one line."""
    parts = []
    for each in error.errors(include_url=False):
        where = ".".join(str(part) for part in each["loc"]) or "arguments"
        got = each.get("input")
        shown = repr(got)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        parts.append(f"{where}: {each['msg']} (got {shown})")
    return "; ".join(parts)


class TypedActor(dramatiq.Actor[Any, Any]):
    """A Dramatiq actor whose function takes one :class:`JobArguments` model (see the module
    docstring). Declared with :func:`actor`."""

    def __init__(self, fn: Callable[..., Any], **parameters: Any) -> None:
        self.model = model_of(fn, parameters["actor_name"])
        self._lenient: type[JobArguments] | None = None
        super().__init__(fn, **parameters)

    # -- send ---------------------------------------------------------------------------

    def message_with_options(
        self, *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, **options: Any
    ) -> Message[Any]:
        """Dramatiq's, with ``args``/``kwargs`` validated into the model: the message carries
        its JSON (by alias) and ``options.schema_version``, and, when the actor names a
        ``fair_key`` field, that field's value as its fairness key
        (:mod:`.layout.queuelanes`). Raises :class:`InvalidArgumentsError`."""
        model = self.validate(args, kwargs or {}, self.model.version, strict=True)
        options[SCHEMA_VERSION] = self.model.version
        key_field = self.options.get(ACTOR_KEY_OPTION)
        if key_field is not None:
            options[FAIRNESS_KEY_OPTION] = str(getattr(model, key_field))
        return super().message_with_options(
            args=(), kwargs=model.model_dump(mode="json", by_alias=True), **options
        )

    # -- receive --------------------------------------------------------------------------

    def validate(
        self, args: Any, kwargs: Any, version: Any, *, strict: bool = False
    ) -> JobArguments:
        """The model of a message's ``args``/``kwargs`` written at schema ``version`` (None:
        :data:`FIRST_VERSION`). ``strict``: a send, where only this version is written.
        Raises :class:`InvalidArgumentsError`."""
        model = self.model
        if len(args) == 1 and not kwargs and isinstance(args[0], model):
            return args[0]
        version = FIRST_VERSION if version is None else version
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidArgumentsError(
                self.actor_name, f"schema version {version!r} is not a number"
            )
        if not strict and not model.version - 1 <= version <= model.version + 1:
            raise InvalidArgumentsError(
                self.actor_name,
                f"schema version {version} is not read here (this worker reads "
                f"{max(model.version - 1, FIRST_VERSION)} to {model.version + 1}): replay it "
                "from the dead letters once a worker of its version runs",
            )
        if not isinstance(kwargs, dict):
            raise InvalidArgumentsError(self.actor_name, "keyword arguments are not an object")
        names = list(model.model_fields)
        if len(args) > len(names):
            raise InvalidArgumentsError(
                self.actor_name,
                f"{len(args)} positional arguments, the model has {len(names)} fields "
                f"({', '.join(names)})",
            )
        positional = dict(zip(names, args, strict=False))
        both = sorted(set(positional) & set(kwargs))
        if both:
            raise InvalidArgumentsError(
                self.actor_name,
                f"{', '.join(both)}: given both by position and by name (a pipeline's "
                "previous result? a typed stage is sent with pipe_ignore=True)",
            )
        fields = {**positional, **kwargs}
        reader: type[JobArguments] = model
        if version < model.version:
            fields = model.upgrade(version, fields)
        elif version > model.version:
            reader = self._lenient_model()
        try:
            return reader.model_validate(fields)
        except ValidationError as error:
            raise InvalidArgumentsError(self.actor_name, _one_line(error)) from None

    def _lenient_model(self) -> type[JobArguments]:
        """The model, ignoring fields it does not know (a newer version's additions)."""
        if self._lenient is None:
            config = ConfigDict(extra="ignore")
            self._lenient = type(self.model.__name__, (self.model,), {"model_config": config})
        return self._lenient

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the function with the model: the one the ``ArgumentModels`` middleware
        validated for this delivery (:func:`prepared`), else ``args``/``kwargs`` validated
        here as this version (a direct call, a test)."""
        prepared = _PREPARED.__dict__.pop("model", None)
        if prepared is not None and prepared[0] is self:
            return super().__call__(prepared[1])
        return super().__call__(self.validate(args, kwargs, self.model.version))

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The model's fields as a function's parameters (what a schedule's ``args`` and
        ``kwargs`` must fit)."""
        return inspect.Signature(
            [
                inspect.Parameter(
                    name,
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    default=inspect.Parameter.empty if field.is_required() else field.default,
                )
                for name, field in self.model.model_fields.items()
            ]
        )


#: The model validated for the current thread's delivery, handed to :meth:`TypedActor.__call__`.
_PREPARED = threading.local()


def prepare(actor: TypedActor, args: Any, kwargs: Any, version: Any) -> None:
    """Validate a received message for ``actor`` and keep its model for the handler that runs
    next on this thread. Raises :class:`InvalidArgumentsError`."""
    _PREPARED.model = (actor, actor.validate(args, kwargs, version))


def forget() -> None:
    """Drop a model :func:`prepare` kept that no handler took (the delivery was skipped)."""
    _PREPARED.__dict__.pop("model", None)


def model_of(fn: Callable[..., Any], actor_name: str) -> type[JobArguments]:
    """The :class:`JobArguments` model ``fn`` takes as its one argument; ``TypeError``
    naming the actor when it takes something else."""
    parameters = list(inspect.signature(fn).parameters.values())
    hints = typing.get_type_hints(fn) if parameters else {}
    found = hints.get(parameters[0].name) if len(parameters) == 1 else None
    if not (isinstance(found, type) and issubclass(found, JobArguments)):
        raise TypeError(
            f"typed actor {actor_name!r} must take one argument annotated with a "
            f"JobArguments model, e.g. def {actor_name}(job: MyArguments)"
        )
    return found


def signature_of(declared: dramatiq.Actor[Any, Any]) -> inspect.Signature:
    """What a sender's ``args``/``kwargs`` must fit: a typed actor's model fields, another
    actor's function parameters."""
    if isinstance(declared, TypedActor):
        return declared.signature
    return inspect.signature(declared.fn)


#: ``@actor(queue_name=..., ...)``: Dramatiq's ``@dramatiq.actor`` declaring a :class:`TypedActor`.
actor: Final = functools.partial(dramatiq.actor, actor_class=TypedActor)
