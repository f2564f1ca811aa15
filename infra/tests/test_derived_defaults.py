"""One rule for "defaults to concurrency" (``prefetch``, ``db_pool_size``), in both owners.

The service's pool model states it (``pools.derived_defaults()``, from its fields'
metadata); worker_infra needs it where no model is at hand, in a rendered pools file
(``args.DERIVED_DEFAULTS``, ``derived_value``). Here the two are compared, and every path
that resolves the rule (the model's ``effective``, :meth:`PoolSpec.of`, ``derived_value``
over the dumped file the pods mount, the simulation's per-pod usage against the capacity
formula) gives the same numbers: a change of the rule in one place fails here.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from templatepools import SERVICE_POOLS, pool_files, pools_file
from worker_runtime import pools

from worker_infra import ServiceSpec, WorkerService
from worker_infra.args import DERIVED_DEFAULTS, MODEL_ATTRIBUTE, PoolSpec, derived_value
from worker_infra.capacity import per_replica_usage
from worker_infra.render import render
from worker_infra.simulate import pools_of

SHAPES: list[dict[str, Any]] = [
    {"concurrency": 6},
    {"concurrency": 6, "prefetch": 9},
    {"concurrency": 6, "db_pool_size": 7},
    {"concurrency": 3, "processes": 2, "prefetch": 3, "db_pool_size": 3},
]


def test_worker_infra_states_the_models_derived_defaults() -> None:
    assert pools.derived_defaults() == DERIVED_DEFAULTS
    assert set(MODEL_ATTRIBUTE) == set(DERIVED_DEFAULTS)


@pytest.mark.parametrize("fields", SHAPES)
def test_every_path_resolves_the_same_value(fields: dict[str, Any]) -> None:
    model = pools.Pool(queues=["q"], **fields)
    spec = PoolSpec.of("p", model)
    dumped = model.model_dump(mode="json", exclude_none=True)
    for field, source in DERIVED_DEFAULTS.items():
        expected = fields.get(field, fields[source])
        assert model.effective(field) == expected
        assert getattr(model, MODEL_ATTRIBUTE[field]) == expected
        assert getattr(spec, field) == expected
        assert derived_value(dumped, field) == expected


@pytest.mark.parametrize("critical_db_pool_size", [None, 12])
def test_the_simulation_uses_the_capacity_formula_on_what_the_pods_mount(
    service: ServiceSpec, critical_db_pool_size: int | None
) -> None:
    """Per pod, the simulation's usage of each resource (read from the rendered pools file:
    db_pool_size unset means the concurrency) is the capacity guard's own formula on the
    model's specs."""
    data = copy.deepcopy(SERVICE_POOLS)
    if critical_db_pool_size is not None:
        data["pools"]["critical"]["db_pool_size"] = critical_db_pool_size
    pools, downstream, text = pools_file(data)
    spec = dataclasses.replace(
        service,
        pools=pools,
        downstream=downstream,
        pools_file=text,
        pool_files=pool_files(data),
    )
    objects = render(lambda: WorkerService("orders-worker", spec), project="p", stack="s")
    simulated = {model.name: model for model in pools_of(objects)}
    resources = {r.name: r for r in downstream}
    checked = 0
    for pool in pools:
        if pool.sandbox:
            continue
        expected = {r: per_replica_usage(pool, resources[r]) for r in pool.uses}
        assert simulated[pool.name].per_pod == expected, pool.name
        checked += len(expected)
    assert checked == 4
    critical = next(p for p in pools if p.name == "critical")
    assert critical.db_pool_size == (critical_db_pool_size or critical.concurrency)
