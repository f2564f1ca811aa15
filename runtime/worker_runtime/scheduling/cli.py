"""The scheduler's commands: ``scheduler`` (runs the leader loop, :mod:`.loop`) and
``schedules`` (each schedule of pools.toml, its next fire times and its last run)."""

from __future__ import annotations

import time

import redis

from .. import redisclient
from ..exitcodes import EX_FAILURE, EX_OK
from ..layout import read_states
from . import schedules as sched
from .loop import Scheduler, check_actors, load_scheduler_settings, load_schedules


def run() -> int:
    """The ``scheduler`` command."""
    from .. import logs

    settings = load_scheduler_settings()
    logs.configure(settings.otel_service_name, settings.log_level, settings.log_format)
    schedules = load_schedules()
    targets = check_actors(schedules)
    from ..actors import load
    from ..settings import pools

    broker = load()
    queues = {q: name for name, pool in pools().pools.items() for q in pool.queues}
    return Scheduler(settings, schedules, targets, broker, pools=queues).run()


def list_schedules(as_json: bool = False, count: int = 3) -> int:
    """The ``schedules`` command: each schedule, its next fire times and its last run."""
    import json

    settings = load_scheduler_settings()
    schedules = load_schedules()
    now = time.time()
    client = redisclient.connect(
        settings.redis_url.get_secret_value(), socket_timeout=2, socket_connect_timeout=2
    )
    problem = None
    try:
        states = read_states(client, schedules)
    except redis.RedisError as error:
        states, problem = {}, f"redis: {error}"
    finally:
        client.close()
    rows = sched.schedule_rows(schedules, states, now, count)
    lines: list[str] = []
    for row in rows:
        lines += [
            f"{row['schedule']}: {row['actor']} at {row['cron']!r} {row['timezone']}, "
            f"missed={row['missed']} dst={row['dst']}",
            f"  next:         {', '.join(row['next'])}",
            f"  last fired:   {row['last_fired'] or 'never'}"
            + (" (running)" if row["running"] else ""),
            f"  last success: {row['last_success'] or 'never'}",
        ]
        if row["runs"] is not None:
            lines.append("  runs:         " + ", ".join(f"{k}={v}" for k, v in row["runs"].items()))
    if as_json:
        print(json.dumps({"schedules": rows, "problem": problem}, indent=2))
    else:
        print("\n".join(lines or ["no schedules in pools.toml"]))
        if problem:
            print(f"last runs unknown: {problem}")
    return EX_FAILURE if problem else EX_OK
