"""Unique jobs: at most one job of an actor per key is queued, delayed or running.

Declare it on the actor, or per send::

    from worker_runtime.unique import DuplicateJob, Unique

    @actor(queue_name="reports", unique=Unique(key="account_id", ttl_ms=3_600_000))
    def build_report(job: Report) -> None: ...

    try:
        build_report.send(account_id=7, month="2026-11")
    except DuplicateJob as error:
        ...  # error.holder: the message id of the equal job already queued or running

    enqueue("build_report", 7, "2026-11", unique=Unique(id="report-7", ttl_ms=600_000))

Semantics (:class:`Unique`):

* **Equal jobs**: the same actor and the same key: the values of the named argument fields
  (``key=("account_id", "month")``; a typed actor's model fields, another actor's
  parameters), or a unique id you give (``id="report-7"``).
* **Skip** (default): a send while an equal job is queued, delayed or running (retries and
  their backoff included) enqueues nothing and raises :class:`DuplicateJob`. Once that job
  is settled (done, dead-lettered, cancelled) the next send is accepted.
* **Debounce** (``debounce=True``, with a ``delay_ms``): a send while an equal job is still
  *delayed* replaces it: the pending job is dropped and this one (its arguments, its new
  eta, its message id) waits in its place; the call returns the new message. Once the
  pending job is due (queued) or running, a send is skipped as above (:class:`DuplicateJob`).
* **TTL** (``ttl_ms``, required): the lock's last-resort expiry, counted from the send that
  took it. A job still queued or running when it lapses no longer holds it: an equal send is
  then accepted and the two may run side by side. The older one's end leaves the newer
  one's lock alone. Choose a TTL above the longest wait plus run plus retries you expect.

The lock is taken in the Lua call that stores the job and freed in the Lua call that
settles it (an ack, a dead letter, recovery's dead letter); a retry, a requeue (shutdown)
and the recovery of a killed worker's job keep it. A resend of the same ``message_id``
after :class:`.brokerstate.EnqueueUncertain` is judged again (a skipped send left no mark).

Not covered: a replayed dead letter runs without the lock (an equal job may be admitted
beside it); a message whose body does not decode is dead-lettered without freeing it (the
TTL does); a scheduled run's overlap is the schedule's own run lock (``ScheduleLock``), and
a group's callbacks are enqueued by the group's completion, not by a send. On a Redis
failover, a lock written to the old primary and not yet copied to the replica is lost with
the jobs written with it (Redis replication is asynchronous): the jobs it guarded are lost
too when they were written together, but a lock taken by an enqueue the replica had while
the job's ack was lost (or the reverse) may admit a duplicate (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Final

import dramatiq
from dramatiq import Message
from dramatiq.middleware import MiddlewareError

from . import layout
from .typed import TypedActor, signature_of

__all__ = ["OPTION", "DuplicateJob", "Unique", "UniqueError", "lock_for"]

#: The actor option and the send option (``send_with_options(unique=...)``).
OPTION: Final = "unique"
#: Keys longer than this (bytes) are stored as their SHA-256.
KEY_BYTES: Final = 200


class UniqueError(MiddlewareError, ValueError):
    """A unique job declared or sent wrong: one line naming the actor and the fix (a
    ``MiddlewareError``: raised through the broker's hooks at an actor's declaration)."""


class DuplicateJob(Exception):  # noqa: N818  # the name a Celery or Sidekiq user looks for
    """Not enqueued: an equal job (``holder``, its message id) is queued, delayed or
    running under the lock ``key``."""

    def __init__(self, actor_name: str, key: str, holder: str) -> None:
        super().__init__(
            f"{actor_name}: not enqueued: an equal job ({holder}) is queued, delayed or "
            f"running (unique key {key!r})"
        )
        self.actor_name = actor_name
        self.key = key
        self.holder = holder


@dataclasses.dataclass(frozen=True)
class Unique:
    """At most one job of an actor per key (see the module docstring).

    Parameters:
      key: the argument field(s) whose values make the key (a name or a tuple of names).
      id: the key itself, given by the sender (instead of ``key``).
      ttl_ms: the lock's last-resort expiry, ms (> 0).
      debounce: replace a pending delayed equal job instead of skipping this send.
    """

    key: tuple[str, ...] | str = ()
    id: str | None = None
    ttl_ms: int = 0
    debounce: bool = False

    def __post_init__(self) -> None:
        fields = (self.key,) if isinstance(self.key, str) else tuple(self.key)
        object.__setattr__(self, "key", fields)
        if isinstance(self.ttl_ms, bool) or not isinstance(self.ttl_ms, int) or self.ttl_ms <= 0:
            raise UniqueError(
                f"unique: ttl_ms must be a whole number of ms above 0, got {self.ttl_ms!r}"
            )
        if bool(fields) == (self.id is not None):
            raise UniqueError(
                "unique: give key=<argument field(s)> or id=<your unique id>, one of them"
            )
        if self.id is not None and (not isinstance(self.id, str) or not self.id):
            raise UniqueError(f"unique: id must be a non-empty string, got {self.id!r}")

    @property
    def fields(self) -> tuple[str, ...]:
        return self.key if isinstance(self.key, tuple) else (self.key,)


def check_fields(actor: dramatiq.Actor[Any, Any], spec: Unique) -> None:
    """Raise :class:`UniqueError` when ``spec`` names a field ``actor`` does not take."""
    known = list(signature_of(actor).parameters)
    for field in spec.fields:
        if field not in known:
            raise UniqueError(
                f"{actor.actor_name}: unique key field {field!r} is not one of its arguments "
                f"({', '.join(known) or 'none'})"
            )


def _key_of(actor: dramatiq.Actor[Any, Any], message: Message[Any], spec: Unique) -> str:
    """The key of ``message``: the unique id, or the named fields' values."""
    if spec.id is not None:
        key = spec.id
    else:
        check_fields(actor, spec)
        if isinstance(actor, TypedActor) and not message.args:
            # A typed send's kwargs are its model's JSON, by alias (validated at the send).
            declared = actor.model.model_fields
            values = {
                field: message.kwargs.get(
                    declared[field].serialization_alias or declared[field].alias or field
                )
                for field in spec.fields
            }
        elif isinstance(actor, TypedActor):
            model = actor.validate(message.args, message.kwargs, actor.model.version)
            values = model.model_dump(mode="json", include=set(spec.fields))
        else:
            bound = signature_of(actor).bind(*message.args, **message.kwargs)
            bound.apply_defaults()
            values = {field: bound.arguments[field] for field in spec.fields}
        key = ",".join(f"{field}={_json(values[field])}" for field in spec.fields)
    if len(key.encode()) > KEY_BYTES:
        key = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
    return key


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def lock_for(
    actor: dramatiq.Actor[Any, Any] | None, message: Message[Any], delay: int | None
) -> tuple[Message[Any], layout.UniqueLock | None]:
    """``message`` as it is stored (the send option ``unique`` replaced by the lock's name,
    :data:`.layout.UNIQUE_LOCK`) and the lock its enqueue takes (None: not a unique job).
    The send's option wins over the actor's; ``unique=None`` sends one without it.
    Raises :class:`UniqueError` (a debounce without a delay, an unknown field)."""
    options = dict(message.options)
    spec = (
        options.pop(OPTION) if OPTION in options else (actor.options.get(OPTION) if actor else None)
    )
    if spec is None:
        if OPTION in message.options:
            return dataclasses.replace(message, options=options), None
        return message, None
    if not isinstance(spec, Unique):
        raise UniqueError(f"{message.actor_name}: unique= takes a Unique(...), got {spec!r}")
    if spec.debounce and not delay:
        raise UniqueError(f"{message.actor_name}: unique debounce needs a delay (delay_ms > 0)")
    if actor is None:
        raise UniqueError(f"{message.actor_name}: unique jobs need the actor declared here")
    name = layout.unique_key(
        actor.actor_name, _key_of(actor, message, spec), layout.namespace_of(message.queue_name)
    )
    options[layout.UNIQUE_LOCK] = name
    return dataclasses.replace(message, options=options), layout.UniqueLock(
        name, spec.ttl_ms, spec.debounce
    )
