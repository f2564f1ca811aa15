"""UniqueJobs: declares the ``unique`` actor option (:mod:`..unique`) and checks it when the
actor is declared: an option that is not a ``Unique(...)``, or a key field the actor does not
take, raises :class:`..unique.UniqueError` at import (the worker refuses to boot, one line).
The lock itself is taken by the broker's enqueue and freed by the settlement."""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq import Broker, Middleware

from ..unique import OPTION, Unique, UniqueError, check_fields


class UniqueJobs(Middleware):
    """The ``unique`` actor option, checked at declaration."""

    @property
    def actor_options(self) -> set[str]:
        return {OPTION}

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        spec = actor.options.get(OPTION)
        if spec is None:
            return
        if not isinstance(spec, Unique):
            raise UniqueError(f"{actor.actor_name}: unique= takes a Unique(...), got {spec!r}")
        if spec.id is not None:
            raise UniqueError(
                f"{actor.actor_name}: an actor's unique option names key fields; a unique id "
                "is given per send (send_with_options(unique=Unique(id=...)))"
            )
        check_fields(actor, spec)
