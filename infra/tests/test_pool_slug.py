"""A pool's slug, one rule in both owners: the service labels the backlog series of a pool
(the scheduler's exporter, ``pools.pool_slug``) with the value worker_infra gives its pods'
``worker-template/pool`` label and its Kubernetes names (``PoolSpec.slug``). If they
differed, the per-pool alerts and the KEDA age trigger would select no series of that pool
at zero pods. A change in either fails here."""

from __future__ import annotations

import pytest
from templatepools import pool
from worker_runtime import pools

from worker_infra.args import dns_label


@pytest.mark.parametrize("name", ["interactive", "big_jobs", "a_b_c", "x-y_z", "q1"])
def test_the_services_slug_is_worker_infras(name: str) -> None:
    assert pool(name).slug == pools.pool_slug(name) == dns_label(name)
    assert "_" not in pool(name).slug
