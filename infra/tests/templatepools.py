"""The template's default pools.toml, and specs built by the runtime's pool model.

worker_infra takes its pools from that model (:meth:`PoolSpec.of`), so the tests build
them the same way: every pool here passed the model's bounds and defaults. The service the
component tests deploy is the template's own ``{{cookiecutter.project}}/pools.toml``,
rendered with cookiecutter.json's defaults (every option on), not a copy of it.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import tomli_w
from worker_runtime import pools

from worker_infra import DownstreamSpec, PoolSpec, Timing

TEMPLATE = Path(__file__).resolve().parents[2]
POOLS_TOML = TEMPLATE / "{{cookiecutter.project}}" / "pools.toml"


def default_context() -> dict[str, Any]:
    """cookiecutter.json's defaults as a bake without answers gets them (a list's first
    choice; each value rendered with the values before it, as cookiecutter does)."""
    context: dict[str, Any] = {}
    for key, value in json.loads((TEMPLATE / "cookiecutter.json").read_text()).items():
        if key.startswith("_"):
            continue
        first = value[0] if isinstance(value, list) else value
        if isinstance(first, str):
            first = jinja2.Template(first).render(cookiecutter=context)
        context[key] = first
    return context


def default_pools_toml() -> str:
    """The text of a default bake's pools.toml."""
    template = jinja2.Template(POOLS_TOML.read_text(), keep_trailing_newline=True)
    return template.render(cookiecutter=default_context())


#: A default bake's pools.toml, as data (``[schedules.*]`` included).
SERVICE_POOLS: dict[str, Any] = tomllib.loads(default_pools_toml())

#: The variables a pool shapes, as the model names them.
POOL_ENV: frozenset[str] = frozenset(pools.pool_env_fields().values())
#: The runtime's timing rule and the supervisor's kill-after, as the infra program hands them.
TIMING = Timing(pools.timing_problems, pools.KILL_AFTER_DRAIN_S)


def pool(name: str, queues: Sequence[str] = ("q",), **fields: Any) -> PoolSpec:
    """A pool validated by the runtime's model, as worker_infra receives it."""
    return PoolSpec.of(name, pools.Pool(queues=list(queues), **fields))


def downstream(
    name: str, capacity: int, reserved: int = 0, per_process: str = "db_pool_size"
) -> DownstreamSpec:
    """A downstream resource validated by the runtime's model."""
    model = pools.Downstream(capacity=capacity, reserved=reserved, per_process=per_process)
    return DownstreamSpec.of(name, model)


def pools_file_text() -> str:
    """A small pools file, as the pods would mount it."""
    return '[pools.interactive]\nqueues = ["notifications", "emails"]\n'


def pools_file(
    data: dict[str, Any],
) -> tuple[tuple[PoolSpec, ...], tuple[DownstreamSpec, ...], str]:
    """Specs and TOML text of a whole pools file validated by the model (as the infra
    program hands them to worker_infra)."""
    model = pools.PoolsFile.model_validate(data)
    return (
        tuple(PoolSpec.of(n, p) for n, p in model.pools.items()),
        tuple(DownstreamSpec.of(n, d) for n, d in model.downstream.items()),
        tomli_w.dumps(model.model_dump(mode="json", exclude_none=True)),
    )


def pool_files(data: dict[str, Any]) -> dict[str, str]:
    """Pool -> the TOML text its pods read (the model's ``PoolsFile.for_pool``), as the
    infra program hands them to worker_infra (``ServiceSpec.pool_files``)."""
    model = pools.PoolsFile.model_validate(data)
    return {
        name: tomli_w.dumps(
            model.for_pool(name).model_dump(mode="json", exclude_none=True, exclude_unset=True)
        )
        for name in model.pools
    }
