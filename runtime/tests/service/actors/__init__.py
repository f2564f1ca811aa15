"""Actors: every module in this package is imported by the worker (autodiscovery).

Add a module here and its actors are served by the pool that owns their queue
(pools.toml). Importing this package refuses to boot (exit 78) when an actor's queue
belongs to no pool, or a schedule of pools.toml cannot run.
"""

from worker_runtime.actors import discover

MODULES = discover(__name__)
