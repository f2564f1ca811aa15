"""Command line of the service: ``python -m service`` and the
``test-service`` script (``--help`` lists the commands: worker, config,
healthcheck, dlq, capacity, scheduler, schedules, status, console, ...). The commands live
in the runtime (:mod:`worker_runtime.cli`); they run this service (:data:`SERVICE`)."""

from __future__ import annotations

import sys

from worker_runtime.cli import main as run

from . import SERVICE


def main() -> int:
    return run(SERVICE)


if __name__ == "__main__":
    sys.exit(main())
