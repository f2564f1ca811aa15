"""Command line of the service.

Run as ``python -m <package>`` or as the console script ``<project>``:

    worker [--watch]                    run the pool (processes, threads, queues from settings);
                                        --watch: restart on source changes (make dev)
    config                              validate and print the effective config, secrets masked
    healthcheck live [--stalled-after S]  exit 0 live, 1 not; local state only
    healthcheck ready                   exit 0 when Redis (and the database) answer
    dlq list|show|replay|purge          dead-letter tooling
    capacity                            throughput against concurrency
    scheduler                           fire the schedules of pools.toml (leader-elected)
    schedules [--json]                  each schedule: next fire times, last run
    status [--json]                     queues and worker processes, from Redis
    pause <queue> / resume <queue>      stop / restart every worker fetching a queue
    console [--host H] [--port P]       the web console (read-only unless CONSOLE_TOKEN)

Imports are local to each command: ``healthcheck live`` must stay fast and must
not import Dramatiq or the actors.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..exitcodes import EX_FAILURE, EX_OK
from ..service import Service, current, use

if TYPE_CHECKING:
    from ..settings import WorkerSettings

#: prctl(2): whether another process of the same uid may open this one's
#: ``/proc/<pid>/environ``, ``mem``, ``cwd`` and ``fd`` (ptrace access).
_PR_SET_DUMPABLE = 4


def _nondumpable() -> None:
    """Make this process non-dumpable, before anything else runs.

    Every process of the service (the supervisor, its worker processes, the probes) holds
    the secrets in its environment, and a sandboxed snippet may have the same uid
    (docs/sandbox.md, "What each configuration guarantees"). Non-dumpable, its ``/proc``
    entries need ``CAP_SYS_PTRACE``, which no snippet has. Costs: no core dumps, and a
    profiler that attaches with ptrace (py-spy) needs ``CAP_SYS_PTRACE``.
    """
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def _worker_process(settings: WorkerSettings) -> int:
    """One worker process, given its collaborators: the broker, its shutdown middleware,
    the process's lifecycle, and the actors to declare once it has booted."""
    from ..broker import middleware_of
    from ..lifecycle import LIFECYCLE
    from ..middleware import CappedTimeLimit, GracefulShutdown
    from ..worker import WorkerProcess

    service = current()
    broker = service.broker()
    return WorkerProcess(
        settings,
        broker,
        shutdown=middleware_of(broker, GracefulShutdown),
        lifecycle=LIFECYCLE,
        load_actors=lambda: importlib.import_module(service.actors_package),
        time_limit=middleware_of(broker, CappedTimeLimit),
    ).run()


def _worker(args: argparse.Namespace) -> int:
    from .. import logs
    from ..settings import load_settings, report_refusals_to, warn_unknown_variables

    if args.boot_report:  # a worker process tells its supervisor why it cannot boot
        report_refusals_to(Path(args.boot_report))
    settings = load_settings()
    if args.process:  # a handler closing fd 1 or 2 leaves the log lines where they go
        logs.own_standard_streams()
    logs.configure(settings.otel_service_name, settings.log_level, settings.log_format)
    if not (args.process or args.watch):  # said once: by the supervisor (a watcher's too)
        warn_unknown_variables(os.environ)
    if args.watch:
        from ..pools import default_pools_path
        from ..watch import Watcher

        service = current()
        command = [sys.executable, "-m", service.package, "worker"]
        return Watcher(command, [service.directory, default_pools_path()]).run()
    if args.process:
        return _worker_process(settings)
    from ..supervisor import Supervisor

    return Supervisor(settings).run()


def _config(args: argparse.Namespace) -> int:
    from ..settings import load_settings

    settings = load_settings()
    shown = settings.masked()
    if args.json:
        print(json.dumps(shown, indent=2))
        return EX_OK
    sources = settings.sources()
    width = max(map(len, shown))
    rows = [(key, json.dumps(value), sources[key]) for key, value in shown.items()]
    value_width = min(40, max(len(value) for _, value, _ in rows))
    for key, value, source in rows:
        print(f"{key:<{width}}  {value:<{value_width}}  {source}")
    return EX_OK


def _live(args: argparse.Namespace) -> int:
    from ..boards import (
        DEFAULT_STALLED_AFTER_S,
        ENV_STALLED_AFTER,
        ENV_STATE_DIR,
        default_state_dir,
    )
    from ..probe import liveness_problems

    state_dir = Path(os.environ.get(ENV_STATE_DIR) or default_state_dir())
    stalled_after = args.stalled_after or float(
        os.environ.get(ENV_STALLED_AFTER) or DEFAULT_STALLED_AFTER_S
    )
    problems = liveness_problems(state_dir, stalled_after)
    for problem in problems:
        print(f"not live: {problem}", file=sys.stderr)
    return EX_FAILURE if problems else EX_OK


def _ready(args: argparse.Namespace) -> int:
    from ..probe import readiness_problems
    from ..settings import load_settings

    problems = readiness_problems(load_settings())
    for problem in problems:
        print(f"not ready: {problem}", file=sys.stderr)
    return EX_FAILURE if problems else EX_OK


def _scheduler(args: argparse.Namespace) -> int:
    from ..scheduling.cli import run

    return run()


def _schedules(args: argparse.Namespace) -> int:
    from ..scheduling.cli import list_schedules

    return list_schedules(as_json=args.json, count=args.next)


#: Commands whose own module adds them (``adder(commands)``): imported only when that command
#: runs, or when the whole list is needed (``--help``, a mistyped command). ``status`` then
#: imports neither capacity's models nor the console's pages.
PLUGGED = {
    "dlq": ("worker_runtime.deadletters.cli", "add_commands"),
    "capacity": ("worker_runtime.capacity", "add_command"),
    "status": ("worker_runtime.status", "add_command"),
    "pause": ("worker_runtime.pausing", "add_pause"),
    "resume": ("worker_runtime.pausing", "add_resume"),
    "console": ("worker_runtime.console.server", "add_command"),
}


def parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; given the ``command`` about to run, only that one of the
    :data:`PLUGGED` commands is imported (default None: all)."""
    root = argparse.ArgumentParser(
        prog=current().project,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = root.add_subparsers(dest="command", required=True)

    worker = commands.add_parser("worker", help="run the pool")
    worker.add_argument(
        "--watch",
        action="store_true",
        help="at a desk: restart (after the drain) when a source file or pools.toml changes",
    )
    worker.add_argument("--process", action="store_true", help=argparse.SUPPRESS)
    worker.add_argument("--boot-report", metavar="PATH", help=argparse.SUPPRESS)
    worker.set_defaults(run=_worker)

    config = commands.add_parser(
        "config",
        help="print the effective config: each value and its source",
        description="Validate the configuration and print each value in effect (secrets "
        "masked) with where it comes from: environment, pool <name> (pools.toml) or default.",
    )
    config.add_argument("--json", action="store_true", help="print JSON (values only)")
    config.set_defaults(run=_config)

    health = commands.add_parser("healthcheck", help="liveness and readiness probes")
    probes = health.add_subparsers(dest="probe", required=True)
    live = probes.add_parser("live", help="exit 1 when a handler is stalled or a process died")
    live.add_argument(
        "--stalled-after",
        type=float,
        metavar="S",
        help="seconds without progress (default HEALTH_STALLED_AFTER_S)",
    )
    live.set_defaults(run=_live)
    probes.add_parser("ready", help="exit 1 when Redis or the DB does not answer").set_defaults(
        run=_ready
    )

    scheduler = commands.add_parser("scheduler", help="fire the schedules of pools.toml")
    scheduler.set_defaults(run=_scheduler)
    listing = commands.add_parser("schedules", help="list schedules, next fire times, last runs")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.add_argument("--next", type=int, default=3, metavar="N", help="fire times shown")
    listing.set_defaults(run=_schedules)

    for name, (module, adder) in PLUGGED.items():  # only the one that runs (all for --help)
        if command not in PLUGGED or command == name:
            getattr(importlib.import_module(module), adder)(commands)
    return root


def main(service: Service, argv: list[str] | None = None) -> int:
    """Run the command of ``argv`` (default: ``sys.argv[1:]``) for ``service``: the bake's
    ``__main__`` calls it (``python -m <package>``, the ``<project>`` script)."""
    _nondumpable()
    use(service)
    words = sys.argv[1:] if argv is None else argv
    args = parser(words[0] if words else None).parse_args(words)
    try:
        code: int = args.run(args)
        sys.stdout.flush()
    except BrokenPipeError:  # `status | head`: the reader has what it wanted; end quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush writes nowhere
        return EX_OK
    return code
