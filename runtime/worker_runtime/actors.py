"""A service's actors: every module of its ``actors`` package is imported (autodiscovery).

The service's ``actors/__init__.py`` calls :func:`discover` with its own name: a module
added there is served by the pool that owns its actors' queue (pools.toml). Discovery
refuses to boot (exit 78) when an actor's queue belongs to no pool, or a schedule of
pools.toml cannot run (:mod:`.scheduling.schedules`).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

import dramatiq
from dramatiq import Actor

from . import layout
from .scheduling.schedules import actor_problems
from .service import current
from .settings import pools, refuse
from .typed import signature_of


def discover(package: str) -> list[str]:
    """Import every module of the actors package ``package`` (after the service's broker, on
    which they declare), check them (:func:`check_queues`); return their names.

    A module that cannot be imported (a syntax error, a missing dependency, an error at
    import time) refuses to boot with exit 78 and one line naming it: a restart would
    fail the same way.
    """
    broker = current().broker()
    path = importlib.import_module(package).__path__
    names = [info.name for info in pkgutil.iter_modules(path) if not info.name.startswith("_")]
    for name in names:
        try:
            importlib.import_module(f"{package}.{name}")
        except Exception as error:  # any error at import: the code itself is broken
            refuse([f"actor module {package}.{name} cannot be imported: {_one_line(error)}"])
    check_queues(broker)
    return names


def load() -> dramatiq.Broker:
    """The service's broker with every actor of the service declared on it (its actors
    package imported: :func:`discover`)."""
    service = current()
    importlib.import_module(service.actors_package)
    broker: dramatiq.Broker = service.broker()
    return broker


def _one_line(error: Exception) -> str:
    """``error`` in one line, with the file and line of a syntax error."""
    if isinstance(error, SyntaxError):
        where = f"{error.filename}, line {error.lineno}"
        return f"SyntaxError: {error.msg} ({where})"
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def check_queues(broker: dramatiq.Broker) -> None:
    """Every actor's queue must belong to exactly one pool of pools.toml, every schedule
    must name an actor whose queue a pool serves, with arguments that fit it, and no actor of
    the sandbox's queue may declare what its pool cannot do (:func:`sandbox_problems`)."""
    declared = pools()
    problems = actor_problems(
        declared.schedules,
        {name: (actor.queue_name, signature_of(actor)) for name, actor in broker.actors.items()},
        declared.pool_of_queue,
    )
    problems += [
        f"actor {name!r} uses queue {actor.queue_name!r}, which no pool in pools.toml serves"
        for name, actor in broker.actors.items()
        if declared.pool_of_queue(actor.queue_name) is None
    ]
    problems += [
        problem
        for name, actor in broker.actors.items()
        if layout.namespace_of(actor.queue_name) != layout.NAMESPACE
        for problem in sandbox_problems(broker, name, actor)
    ]
    if problems:
        refuse(problems)


def sandbox_problems(broker: dramatiq.Broker, name: str, actor: Actor[Any, Any]) -> list[str]:
    """What an actor of the sandbox's queue declares that its pool cannot do: its Redis
    user reaches its own namespace alone, and its handler is interrupted as a thread."""
    problems = []
    if actor.options.get("store_results"):
        problems.append(
            f"actor {name!r} sets store_results=True, but its queue {actor.queue_name!r} runs "
            "under the sandbox's Redis user, which may not write results: return nothing, or "
            "send the result to an actor of another queue"
        )
    if inspect.iscoroutinefunction(inspect.unwrap(actor.fn)):  # Dramatiq wraps async def
        problems.append(
            f"actor {name!r} is async def, but its queue {actor.queue_name!r} runs untrusted "
            "code in a child process it waits for: on the event loop that wait blocks every "
            "other job, and neither the time limit nor a cancel can stop it: declare it def"
        )
    for option in ("on_success", "on_failure"):
        target = actor.options.get(option)
        if target is None:
            continue
        callback = broker.actors.get(getattr(target, "actor_name", target))
        if callback is not None and layout.namespace_of(callback.queue_name) == layout.NAMESPACE:
            problems.append(
                f"actor {name!r} sets {option}={target!r}, but its queue {actor.queue_name!r} "
                "runs under the sandbox's Redis user, which may enqueue only on its own queue: "
                "the callback would be lost; send it from an actor of another queue"
            )
    return problems
