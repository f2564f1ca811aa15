"""worker_runtime.contract: what worker_infra relies on is what the runtime does."""

from __future__ import annotations

import ast
from pathlib import Path

import worker_runtime
from worker_runtime import contract, settlement
from worker_runtime.exporter import POOL_SERIES_LABEL
from worker_runtime.settings import DEFAULT_METRICS_PORT

PACKAGE = Path(worker_runtime.__file__).resolve().parent


def literals() -> set[str]:
    """Every string literal of the runtime's code but the contract's own."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name != "contract.py":
            tree = ast.parse(path.read_text())
            found |= {
                n.value
                for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            }
    return found


def test_every_metric_of_the_contract_is_defined_by_the_runtime() -> None:
    defined = literals()
    missing = [
        name
        for name in contract.METRICS
        if name not in defined and name.removesuffix("_total") not in defined
    ]
    assert missing == []


def test_the_runtime_uses_the_contracts_numbers() -> None:
    assert settlement.OUTCOMES == contract.OUTCOMES
    assert POOL_SERIES_LABEL == contract.POOL_SERIES_LABEL
    assert DEFAULT_METRICS_PORT == contract.METRICS_PORT
    assert contract.liveness_threshold_s(30_000) == 60
    assert contract.liveness_threshold_s(30_001) == 61
