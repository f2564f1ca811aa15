"""Write ops/alerts.yaml from pools.toml; check it and prove it with promtool.

    python infra/alerts.py           (``make alerts``)        rewrite ops/alerts.yaml
    python infra/alerts.py --check   (``make alerts-check``)  exit 1 when it is stale or a
                                                             ``promtool test rules`` case fails

The rules are worker_infra's (``worker_infra.alerts``), the very ones ``pulumi up``
deploys as a PrometheusRule: per pool (and per queue: its backlog-age alert at the
pool's ``backlog_age_target_s``), so a new queue or pool needs ``make alerts``, no hand
edit. ``--check`` also derives ``promtool test rules`` cases for every rule of every pool
(``worker_infra.ruletests``: a wedged pool beside a busy one, a pool at zero pods with
overdue messages, another service's broken pools, every scheduler gone...) and runs
them on ops/alerts.yaml with promtool (Debian/Ubuntu: ``apt-get install prometheus``);
``--write-tests DIR`` writes them next to a copy of the rules, to run or read.
ops/alerts.yaml uses pools.toml as is; a stack's overrides apply to its PrometheusRule.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from worker_infra.alerts import alert_groups
from worker_infra.ruletests import rule_tests
from worker_runtime import contract, pools

INFRA = Path(__file__).resolve().parent
ROOT = INFRA.parent
OUTPUT = ROOT / "ops" / "alerts.yaml"
HEADER = """\
# Prometheus alert rules of {project}: GENERATED from pools.toml by `make alerts`
# (worker_infra.alerts; `pulumi up` deploys the same rules as a PrometheusRule). Do not edit:
# change pools.toml and run `make alerts`. Load with rule_files. How to read each alert:
# docs/operations.md of worker-template.
"""
TESTS = "alerts.test.yaml"


def program() -> ModuleType:
    """infra/__main__.py as a module (its main() runs only as Pulumi's program)."""
    spec = importlib.util.spec_from_file_location("_infra_program", INFRA / "__main__.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {INFRA / '__main__.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def arguments() -> tuple[dict[str, Any], list[str]]:
    """What worker_infra derives the rules and their cases from: pools.toml as committed."""
    infra = program()
    pools_file = pools.load_pools(ROOT / "pools.toml")
    pool_specs, downstream = infra.specs(pools_file)
    return {
        "project": infra.PROJECT,
        "pools": pool_specs,
        "database": any(d.per_process == contract.PER_PROCESS_DB_POOL for d in downstream),
        "namespace": infra.NAMESPACE,
    }, sorted(pools_file.schedules)


def rules() -> dict[str, Any]:
    """The rule file for pools.toml as committed."""
    args, _ = arguments()
    return {"groups": alert_groups(**args)}


def tests() -> dict[str, Any]:
    """The promtool cases of :func:`rules`."""
    args, schedules = arguments()
    return rule_tests(**args, schedules=schedules, rule_file=OUTPUT.name)


def dump(data: dict[str, Any]) -> str:
    # Never wrapped: a wrap point would move with the project name's length, and a bake must
    # regenerate byte for byte what the template ships.
    return yaml.safe_dump(data, sort_keys=False, width=2**31, allow_unicode=True)


def render() -> str:
    return HEADER.format(project=program().PROJECT) + dump(rules())


def write_tests(folder: Path) -> Path:
    """ops/alerts.yaml and its promtool cases in ``folder``; the cases' path."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(OUTPUT, folder / OUTPUT.name)
    path = folder / TESTS
    path.write_text(dump(tests()), encoding="utf-8")
    return path


def promtool() -> int:
    """``promtool test rules`` on the cases of ops/alerts.yaml: 0 when every case passes."""
    tool = shutil.which("promtool")
    if tool is None:
        print(
            "promtool not found: install it (Debian/Ubuntu: apt-get install prometheus) "
            "to run the alert rules' cases",
            file=sys.stderr,
        )
        return 1
    with tempfile.TemporaryDirectory() as folder:
        path = write_tests(Path(folder))
        done = subprocess.run(  # noqa: S603 (promtool found on PATH, a fixed argument list)
            [tool, "test", "rules", path.name],
            cwd=folder,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
        print("ops/alerts.yaml: promtool test rules failed (cases above)", file=sys.stderr)
        return 1
    print(f"ops/alerts.yaml: {len(tests()['tests'])} promtool cases pass")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write ops/alerts.yaml from pools.toml.")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when stale or when a promtool case fails"
    )
    parser.add_argument("--no-promtool", action="store_true", help="with --check: staleness only")
    parser.add_argument(
        "--write-tests", metavar="DIR", help="write the rules and their promtool cases to DIR"
    )
    args = parser.parse_args(argv)
    if args.write_tests:
        print(f"wrote {write_tests(Path(args.write_tests))}")
        return 0
    if args.check:
        if yaml.safe_load(OUTPUT.read_text()) != rules():
            print("ops/alerts.yaml is stale: run `make alerts` and commit it", file=sys.stderr)
            return 1
        print("ops/alerts.yaml matches pools.toml")
        return 0 if args.no_promtool else promtool()
    OUTPUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
