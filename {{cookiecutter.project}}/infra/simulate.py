"""Simulate each stack's scalers against a queue model (``make simulate``).

    python infra/simulate.py [STACK ...]      (default: dev staging prod)

Renders the stack offline (as ``make manifests`` does) and runs the HPA algorithm exactly
as the rendered ScaledObjects configure it, per pool, for a 10x step, a 20x spike, a
diurnal day and two steady hours (worker_infra.simulate). Prints one table per stack and
exits 1 when a goal is missed: back under the age target within 3 minutes of a 10x step,
never above the replica cap or a downstream budget, at most 2 direction changes per hour
under a steady load.
"""

from __future__ import annotations

import sys

from render import stack_objects
from worker_infra.errors import GuardError
from worker_infra.simulate import report

STACKS = ("dev", "staging", "prod")


def main(argv: list[str] | None = None) -> int:
    failed = False
    for stack in (argv if argv is not None else sys.argv[1:]) or STACKS:
        try:
            objects = stack_objects(stack)
        except (GuardError, FileNotFoundError) as error:
            print(f"simulate: stack {stack!r} refused: {' '.join(str(error).split())}")
            return 1
        failed |= report(f"stack {stack}", objects)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
