"""The console's actions: what a form posted to it asks, done once it passed every check.

* ``POST /dead/act``: replay or purge the selected dead letters, every one matching the
  page's filter (``replay-matching``, ``purge-matching``), or replay a whole group of the
  summary (``replay-group``);
* ``POST /jobs/act``: cancel the selected jobs, waiting or delayed (``/jobs``) or running
  (the overview, ``kind=running``): ``producer.cancel``'s record;
* ``POST /queues/act``: pause or resume a queue (:func:`.layout.pause`, as ``pause`` and
  ``resume`` do: decided in the fetch script, for every worker of every pool).

Each needs the console's token typed into the form, the confirmation ticked and the
operator's name (:func:`refusal` says which is missing: 403 for the token, 400 for the
rest; nothing changes), and is logged as one ``console_action`` line: who, from where,
the action, its queue and ids, its outcome and how many it moved.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import layout
from ..deadletters import store as dlq
from .chrome import e
from .pages import Console

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)

#: The dead-letter actions (``POST /dead/act``).
DEAD_ACTIONS = ("replay", "purge", "replay-group", "replay-matching", "purge-matching")
#: The queue actions (``POST /queues/act``).
QUEUE_ACTIONS = ("pause", "resume")


def _logged(action: str, queue: str, ids: list[str], who: str, remote: str) -> dict[str, Any]:
    """What an action's ``console_action`` line records (refused or done)."""
    return {"action": action, "queue": queue, "ids": ids, "who": who, "remote": remote}


def dead(console: Console, form: dict[str, list[str]], remote: str) -> tuple[int, bytes]:
    """Replay or purge the selected dead letters or those matching the filter, or replay a
    whole group of the summary; (HTTP status, page)."""
    queue = console.queue_of({"queue": one(form, "queue")})
    action = one(form, "action")
    ids = list(dict.fromkeys(form.get("id", [])))
    who = one(form, "who").strip()[:80]
    sought = one(form, "find").strip()[:200]
    group = _group(one(form, "group"), queue) if action == "replay-group" else None
    if action == "replay-group":
        chosen, needs = group is not None, "a group"
    elif action.endswith("-matching"):
        chosen, needs = bool(sought), "a filter"
    else:
        chosen, needs = bool(ids), "at least one dead letter"
    logged = _logged(action, queue, ids, who, remote)
    if group is not None:
        logged["group"] = list(group)
    if sought and action.endswith("-matching"):
        logged["find"] = sought
    params = {"queue": queue}
    if action == "replay-group":
        page = console.summary
    else:
        page = console.dead
        params.update({"find": sought} if sought else {})
    problem = refusal(console, form, action, DEAD_ACTIONS, chosen, who, needs)
    if problem:
        return _refused(problem, logged, lambda notice: page(params, notice=notice))
    problems: list[str] = []
    if group is not None:
        done, problems = dlq.replay_group(console.client, group, console.max_bytes)
        verb, what = "replayed", f"dead letters of the group {' / '.join(group[1:])}"
    elif action.endswith("-matching"):

        def matching(letter: dlq.DeadLetter) -> bool:
            return dlq.matches(letter, sought)

        if action == "replay-matching":
            done, problems = dlq.replay_where(console.client, queue, matching, console.max_bytes)
        else:
            done = dlq.purge_where(console.client, queue, matching, console.max_bytes)
        verb = "replayed" if action == "replay-matching" else "purged"
        what = f"dead letters matching {sought!r}"
        params.pop("find", None)
    else:
        letters = [
            letter
            for redis_id in ids
            for letter in _found(console.client, queue, redis_id, console.max_bytes)
        ]
        if action == "replay":
            done, problems = dlq.replay_page(console.client, queue, letters)
        else:
            done = layout.purge_dead_letters(
                console.client, queue, [letter.redis_id for letter in letters]
            )
        verb = "replayed" if action == "replay" else "purged"
        what = f"of {len(ids)} selected dead letters"
    logger.info(
        "console %s %d %s of %s for %s",
        verb,
        done,
        what,
        queue,
        who,
        extra=record(logged, verb, count=done),
    )
    said = f"{verb.capitalize()} {done} {what}" + "".join(f"; {p}" for p in problems)
    return 200, page(params, notice=f'<p class="ok">{e(said)}.</p>')


def jobs(console: Console, form: dict[str, list[str]], remote: str) -> tuple[int, bytes]:
    """Cancel the selected jobs of ``/jobs`` (waiting or delayed, of its ``queue``) or of
    the overview (``kind=running``: running now, on any queue): ``producer.cancel``'s
    record, so skipped when taken, interrupted when running, counted ``cancelled``, never
    retried; (HTTP status, page: the one the form was on)."""
    kind = one(form, "kind") or "waiting"
    ids = list(dict.fromkeys(form.get("id", [])))
    who = one(form, "who").strip()[:80]
    action = one(form, "action")
    page: Callable[..., bytes]
    if kind == "running":
        running = {job.message_id: job.queue for p in console.status().processes for job in p.jobs}
        queue = ", ".join(sorted({running[i] for i in ids if i in running})) or "-"
        params: dict[str, str] = {}
        page = console.overview
    else:
        queue = console.queue_of({"queue": one(form, "queue")})
        sought = one(form, "find").strip()[:200]
        params = {"queue": queue, "kind": kind, **({"find": sought} if sought else {})}
        page = console.jobs
    logged = _logged(action, queue, ids, who, remote)
    if kind == "running":
        logged["kind"] = kind
    problem = refusal(console, form, action, ("cancel",), bool(ids), who, "at least one job")
    if problem:
        return _refused(problem, logged, lambda notice: page(params, notice=notice))
    found = sum(layout.record_cancel(console.client, message_id) for message_id in ids)
    logger.info(
        "console cancelled %d %sjobs of %s (%d found queued, delayed or running) for %s",
        len(ids),
        "running " if kind == "running" else "",
        queue,
        found,
        who,
        extra=record(logged, "cancelled", count=len(ids), found=found),
    )
    said = f"Cancelled {len(ids)} selected jobs ({found} found queued, delayed or running)"
    return 200, page(params, notice=f'<p class="ok">{e(said)}.</p>')


def queues(console: Console, form: dict[str, list[str]], remote: str) -> tuple[int, bytes]:
    """Pause or resume the queue chosen on the overview (as ``pause``/``resume`` do: no
    worker of any pool fetches a paused queue; a resumed one's idle consumers are woken);
    (HTTP status, page)."""
    queue = one(form, "queue")
    action = one(form, "action")
    who = one(form, "who").strip()[:80]
    logged = _logged(action, queue, [], who, remote)
    chosen = queue in console.queues
    problem = refusal(console, form, action, QUEUE_ACTIONS, chosen, who, "a queue of pools.toml")
    if problem:
        return _refused(problem, logged, lambda notice: console.overview(notice=notice))
    if action == "pause":
        changed = layout.pause(console.client, queue)
    else:
        changed = layout.resume(console.client, queue, layout.WAKE_CHANNEL)
    state = "paused" if action == "pause" else "resumed"
    outcome = state if changed else f"already {state}"
    logger.info(
        "console %s queue %s for %s",
        outcome,
        queue,
        who,
        extra=record(logged, outcome, count=int(changed)),
    )
    said = f"Queue {queue}: {outcome}" + (
        " (no worker of any pool fetches it; its running jobs finish)"
        if changed and action == "pause"
        else ""
    )
    return 200, console.overview(notice=f'<p class="ok">{e(said)}.</p>')


def refusal(
    console: Console,
    form: dict[str, list[str]],
    action: str,
    actions: tuple[str, ...],
    chosen: bool,
    who: str,
    needs: str,
) -> tuple[int, str] | None:
    """Why an action is refused (HTTP status, one line), None when it may run: the token, a
    known action (of ``actions``), the confirmation, a name, and something chosen (``needs``
    says what)."""
    if not console.token:
        return 403, "the console is read-only (CONSOLE_TOKEN is not set)"
    if not hmac.compare_digest(one(form, "token").encode(), console.token.encode()):
        return 403, "wrong or missing token; nothing was changed"
    if action not in actions:
        return 400, "unknown action"
    if one(form, "confirm") != "yes":
        return 400, "tick the confirmation box; nothing was changed"
    if not who:
        return 400, "give your name (the action is logged with it); nothing was changed"
    if not chosen:
        return 400, f"select {needs}; nothing was changed"
    return None


def record(logged: dict[str, Any], outcome: str, **more: Any) -> dict[str, Any]:
    """The ``extra`` of a ``console_action`` log line: ``logged`` (action, queue, ids, who,
    remote), its ``outcome`` and ``more``."""
    return {"event": "console_action", **logged, "outcome": outcome, **more}


def one(form: dict[str, list[str]], name: str) -> str:
    """The first value of ``name`` in ``form`` ('' when absent)."""
    values = form.get(name) or [""]
    return values[0]


def _refused(
    problem: tuple[int, str], logged: dict[str, Any], page: Callable[[str], bytes]
) -> tuple[int, bytes]:
    """Log a refused action (``console_action``, outcome ``refused``) and answer with
    ``page`` saying why."""
    status, why = problem
    logger.warning("console action refused: %s", why, extra=record(logged, "refused"))
    return status, page(f'<p class="bad">Refused: {e(why)}</p>')


def _group(value: str, queue: str) -> tuple[str, str, str, str] | None:
    """The group a form names (a summary row's JSON: queue, actor, exception, reason) when
    it is one of ``queue``'s."""
    try:
        group = json.loads(value)
    except ValueError:
        return None
    if not (isinstance(group, list) and len(group) == 4 and all(isinstance(g, str) for g in group)):
        return None
    return (group[0], group[1], group[2], group[3]) if group[0] == queue else None


def _found(
    client: redis.Redis, queue: str, redis_id: str, max_bytes: int | None
) -> list[dlq.DeadLetter]:
    try:
        return [dlq.find(client, [queue], redis_id, max_bytes)]
    except dlq.DeadLetterError:
        return []
