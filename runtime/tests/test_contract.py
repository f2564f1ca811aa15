"""worker_runtime.contract: what worker_infra relies on is what the runtime does."""

from __future__ import annotations

import ast
from pathlib import Path

import worker_runtime
from worker_runtime import contract, settlement
from worker_runtime.exporter import POOL_SERIES_LABEL
from worker_runtime.settings import DEFAULT_METRICS_PORT

PACKAGE = Path(worker_runtime.__file__).resolve().parent


#: The prometheus-client constructors a metric is defined with.
DEFINERS = {"Counter", "Gauge", "Histogram", "CounterMetricFamily", "GaugeMetricFamily"}


def definitions() -> tuple[set[str], list[str]]:
    """The contract names the runtime defines its metrics by (``Counter(contract.X, ...)``),
    and each metric defined by a literal name instead (``path:line: name``)."""
    named: set[str] = set()
    literal: list[str] = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name not in DEFINERS:
                continue
            first = node.args[0]
            if isinstance(first, ast.Attribute) and getattr(first.value, "id", None) == "contract":
                named.add(getattr(contract, first.attr))
            elif isinstance(first, ast.Constant):
                literal.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {first.value!s}")
    return named, literal


def test_every_metric_of_the_contract_is_defined_by_the_runtime_by_its_contract_name() -> None:
    named, _ = definitions()
    assert sorted(set(contract.METRICS) - named) == []


def test_a_metric_worker_infra_reads_is_never_defined_by_a_literal_name() -> None:
    """The runtime's other metrics (queue_paused, downstream_in_use: no alert reads them) may be
    literals; a contract name spelled as one is a second owner."""
    _, literal = definitions()
    names = set(contract.METRICS) | {m.removesuffix("_total") for m in contract.METRICS}
    assert [line for line in literal if line.rpartition(": ")[2] in names] == []


def test_the_runtime_uses_the_contracts_numbers() -> None:
    assert settlement.OUTCOMES == contract.OUTCOMES
    assert POOL_SERIES_LABEL == contract.POOL_SERIES_LABEL
    assert DEFAULT_METRICS_PORT == contract.METRICS_PORT
    assert contract.liveness_threshold_s(30_000) == 60
    assert contract.liveness_threshold_s(30_001) == 61
