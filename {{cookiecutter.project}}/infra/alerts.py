"""Write ops/alerts.yaml: the service's Prometheus alert rules, derived from pools.toml.

    python infra/alerts.py           (``make alerts``)        rewrite ops/alerts.yaml
    python infra/alerts.py --check   (``make alerts-check``)  exit 1 when it is stale

The rules are worker_infra's (``worker_infra.alerts``), the very ones ``pulumi up``
deploys as a PrometheusRule: one backlog-age alert per queue at its pool's
``backlog_age_target_s``, so a new queue or pool needs ``make alerts``, no hand edit.
ops/alerts.yaml uses pools.toml as is; a stack's overrides apply to its PrometheusRule.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from worker_infra.alerts import alert_groups

INFRA = Path(__file__).resolve().parent
ROOT = INFRA.parent
OUTPUT = ROOT / "ops" / "alerts.yaml"
HEADER = """\
# Prometheus alert rules of {project}: GENERATED from pools.toml by `make alerts`
# (worker_infra.alerts; `pulumi up` deploys the same rules as a PrometheusRule). Do not edit:
# change pools.toml and run `make alerts`. Load with rule_files. How to read each alert:
# docs/operations.md of worker-template.
"""


def program() -> ModuleType:
    """infra/__main__.py as a module (its main() runs only as Pulumi's program)."""
    spec = importlib.util.spec_from_file_location("_infra_program", INFRA / "__main__.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {INFRA / '__main__.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rules() -> dict[str, Any]:
    """The rule file for pools.toml as committed."""
    infra = program()
    pools, downstream = infra.specs(infra.pools_module().load_pools(ROOT / "pools.toml"))
    namespaces = [infra.NAMESPACE]
    if any(pool.sandbox for pool in pools):
        namespaces.append(f"{infra.NAMESPACE}-sandbox")
    groups = alert_groups(
        infra.PROJECT,
        pools,
        database=any(d.per_process == "db_pool_size" for d in downstream),
        namespaces=namespaces,
    )
    return {"groups": groups}


def render() -> str:
    text = yaml.safe_dump(rules(), sort_keys=False, width=100, allow_unicode=True)
    return HEADER.format(project=program().PROJECT) + text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write ops/alerts.yaml from pools.toml.")
    parser.add_argument("--check", action="store_true", help="exit 1 when ops/alerts.yaml is stale")
    args = parser.parse_args(argv)
    if args.check:
        if yaml.safe_load(OUTPUT.read_text()) != rules():
            print("ops/alerts.yaml is stale: run `make alerts` and commit it", file=sys.stderr)
            return 1
        print("ops/alerts.yaml matches pools.toml")
        return 0
    OUTPUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
