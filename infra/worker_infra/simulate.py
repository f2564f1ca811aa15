"""Simulation: the rendered scalers against a queue model, before any cluster sees them.

Everything the scaler does is read from the rendered objects of a stack (the ScaledObject
of each pool and the pools file its pods mount), never from worker_infra's arguments:

- KEDA: ``pollingInterval`` (activation from and to zero), ``cooldownPeriod``,
  ``minReplicaCount``, ``maxReplicaCount``, every trigger with its metric type and target;
- the HPA controller, as Kubernetes implements it (``pkg/controller/podautoscaler``): a
  sync every 15 s; per metric ``AverageValue`` -> ceil(value / target) and ``Value`` ->
  ceil(ready pods x value / target), each left alone within the tolerance 0.1; the
  largest proposal wins; stabilization windows (scale up: the lowest recommendation of the
  window, scale down: the highest); scale policies over their periods with their
  ``selectPolicy``; then the replica bounds;
- Prometheus: the load and age series are the state at the last scrape (every 15 s);
  the Redis list lengths are live.

The queue model: arrivals from a load curve (Poisson, seeded), a fixed job time per pool,
``replicas x processes x concurrency`` handler slots, pods ready ``pod_start_s`` (20 s)
after they are created, and a removed pod that stops fetching and holds its downstream
connections until its last job ends. Retries (the delay list) are not modelled.

Per case it reports the p95 backlog age against the pool's target, the time back under
the target after a step, the peak replicas against the capped maximum, the scale events
and direction changes, and the peak downstream connections (this pool's, plus every other
pool's worst case from the capacity formula) against each budget.

    python -m worker_infra.simulate build/manifests/prod.yaml
"""

from __future__ import annotations

import itertools
import math
import random
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker_runtime import contract

from .args import DownstreamSpec, derived_value
from .capacity import Share, share
from .keys import is_delay_queue
from .policy import of_kind, pod_env, pod_pools_file, workers

TOLERANCE = 0.1
HPA_SYNC_S = 15
SCRAPE_INTERVAL_S = 15
POD_START_S = 20
#: Typical job time of a pool, as a fraction of its job timeout (a job that ran to its
#: timeout would be a failure): 1/10.
JOB_TIME_FRACTION = 0.1
Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Policy:
    kind: str  # "Pods" or "Percent"
    value: int
    period_s: int


@dataclass(frozen=True)
class Rules:
    """One direction of the HPA behaviour."""

    window_s: int
    select: str  # "Max", "Min" or "Disabled"
    policies: tuple[Policy, ...]


@dataclass(frozen=True)
class Trigger:
    name: str
    source: str  # "load", "age", "ready", "delayed"
    metric_type: str  # "AverageValue" or "Value"
    target: float
    activation: float


@dataclass(frozen=True)
class Scaler:
    """What the rendered ScaledObject configures."""

    polling_s: int
    cooldown_s: int
    min_replicas: int
    max_replicas: int
    triggers: tuple[Trigger, ...]
    up: Rules
    down: Rules


@dataclass(frozen=True)
class PoolModel:
    """One pool as rendered: its scaler, its shape and what one pod holds downstream."""

    name: str
    scaler: Scaler
    processes: int
    concurrency: int
    job_time_s: float
    age_target_s: float
    per_pod: Mapping[str, int]  # resource -> connections one pod holds (probe included)
    budgets: Mapping[str, int]  # resource -> capacity - reserved
    others: Mapping[str, int]  # resource -> the other pools' worst case (capacity formula)

    @property
    def slots(self) -> int:
        return self.processes * self.concurrency

    @property
    def rate_per_replica(self) -> float:
        """Messages per second one replica completes when busy."""
        return self.slots / self.job_time_s


def _rules(behavior: Obj, key: str) -> Rules:
    rules = behavior.get(key, {})
    return Rules(
        window_s=int(rules.get("stabilizationWindowSeconds", 0 if key == "scaleUp" else 300)),
        select=str(rules.get("selectPolicy", "Max")),
        policies=tuple(
            Policy(str(p["type"]), int(p["value"]), int(p["periodSeconds"]))
            for p in rules.get("policies", [])
        ),
    )


def _trigger(raw: Obj) -> Trigger:
    meta = raw["metadata"]
    name = str(raw.get("name", raw["type"]))
    if raw["type"] == "redis":
        source = "delayed" if is_delay_queue(str(meta["listName"])) else "ready"
        target, activation = float(meta["listLength"]), float(meta.get("activationListLength", 0))
    elif raw["type"] == "prometheus":
        query = str(meta["query"])
        source = "age" if contract.QUEUE_OLDEST_MESSAGE in query else "load"
        target = float(meta["threshold"])
        activation = float(meta.get("activationThreshold", 0))
    else:
        raise ValueError(f"trigger {name}: type {raw['type']!r} is not simulated")
    return Trigger(name, source, str(raw.get("metricType", "AverageValue")), target, activation)


def scaler_of(scaled_object: Obj) -> Scaler:
    """The scaler a rendered ScaledObject configures (KEDA's defaults where unset)."""
    spec = scaled_object["spec"]
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
    return Scaler(
        polling_s=int(spec.get("pollingInterval", 30)),
        cooldown_s=int(spec.get("cooldownPeriod", 300)),
        min_replicas=int(spec.get("minReplicaCount", 0)),
        max_replicas=int(spec.get("maxReplicaCount", 100)),
        triggers=tuple(_trigger(t) for t in spec["triggers"]),
        up=_rules(behavior, "scaleUp"),
        down=_rules(behavior, "scaleDown"),
    )


@dataclass(frozen=True)
class _Shape:
    """A rendered pool as the capacity formula reads it (:class:`.capacity.PoolShape`)."""

    name: str
    processes: int
    concurrency: int
    db_pool_size: int
    max_replicas: int


def pools_of(objects: Sequence[Obj]) -> list[PoolModel]:
    """Every pool of a rendered stack, as the simulation sees it."""
    scaled = {
        (s["metadata"]["namespace"], s["spec"]["scaleTargetRef"]["name"]): s
        for s in of_kind(objects, "ScaledObject")
    }
    rendered = []
    for deployment in workers(objects):
        meta = deployment["metadata"]
        pools_file = pod_pools_file(objects, deployment)
        name = pod_env(deployment)["WORKER_POOL"]
        rendered.append((name, pools_file, scaler_of(scaled[meta["namespace"], meta["name"]])))
    # Each pool's pods read their own entry and the resources they use (``for_pool``).
    entries = {name: pools_file["pools"][name] for name, pools_file, _ in rendered}
    raw: dict[str, Any] = {
        resource: budget
        for _, pools_file, _ in rendered
        for resource, budget in pools_file.get("downstream", {}).items()
    }
    resources = {
        name: DownstreamSpec(name, int(d["capacity"]), int(d["reserved"]), d["per_process"])
        for name, d in raw.items()
    }

    def shape(name: str, pool: Mapping[str, Any], max_replicas: int) -> _Shape:
        return _Shape(
            name,
            int(pool["processes"]),
            int(pool["concurrency"]),
            int(derived_value(pool, "db_pool_size")),
            max_replicas,
        )

    def shares(name: str, pool: Mapping[str, Any], replicas: int) -> dict[str, Share]:
        """The capacity formula's share of each resource ``pool`` uses, at ``replicas``."""
        return {r: share(shape(name, pool, replicas), resources[r], replicas) for r in pool["uses"]}

    models = []
    for name, _, scaler in rendered:
        pool = entries[name]
        others: dict[str, int] = {}
        for other, _, other_scaler in rendered:
            if other == name:
                continue
            for resource, worst in shares(other, entries[other], other_scaler.max_replicas).items():
                others[resource] = others.get(resource, 0) + worst.total
        models.append(
            PoolModel(
                name=name,
                scaler=scaler,
                processes=int(pool["processes"]),
                concurrency=int(pool["concurrency"]),
                job_time_s=max(1.0, pool["job_timeout_ms"] / 1000 * JOB_TIME_FRACTION),
                age_target_s=float(pool["backlog_age_target_s"]),
                per_pod={r: s.per_pod for r, s in shares(name, pool, scaler.max_replicas).items()},
                budgets={r: resource.budget for r, resource in resources.items()},
                others=others,
            )
        )
    return models


# ---- the HPA controller -------------------------------------------------------------------


@dataclass
class Hpa:
    """Kubernetes' HPA controller for one target, with KEDA's 0 <-> 1 activation."""

    scaler: Scaler
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    events: list[tuple[float, int]] = field(default_factory=list)  # (time, +/- replicas)
    inactive_since: float | None = None

    def proposal(self, metrics: Mapping[str, float], replicas: int, ready: int) -> int:
        """The largest desired count over the triggers (tolerance applied per metric)."""
        best = 0
        for trigger in self.scaler.triggers:
            value = metrics[trigger.source]
            if trigger.metric_type == "AverageValue":
                ratio = value / (trigger.target * max(replicas, 1))
                desired = (
                    replicas if abs(ratio - 1) <= TOLERANCE else math.ceil(value / trigger.target)
                )
            else:  # Value
                ratio = value / trigger.target
                desired = (
                    replicas if abs(ratio - 1) <= TOLERANCE else math.ceil(ratio * max(ready, 1))
                )
            best = max(best, desired)
        return best

    def _limit(self, now: float, replicas: int, rules: Rules, up: bool) -> int:
        limits = []
        for policy in rules.policies:
            changed = sum(
                delta for t, delta in self.events if t > now - policy.period_s and (delta > 0) == up
            )
            start = replicas - changed
            if up:
                limits.append(
                    start + policy.value
                    if policy.kind == "Pods"
                    else math.ceil(start * (1 + policy.value / 100))
                )
            else:
                limits.append(
                    start - policy.value
                    if policy.kind == "Pods"
                    else math.floor(start * (1 - policy.value / 100))
                )
        if not limits or rules.select == "Disabled":
            return replicas
        if up:
            return max(limits) if rules.select == "Max" else min(limits)
        return min(limits) if rules.select == "Max" else max(limits)

    def sync(self, now: float, metrics: Mapping[str, float], replicas: int, ready: int) -> int:
        """One HPA sync: the new replica count (for a target with at least one replica)."""
        s = self.scaler
        desired = self.proposal(metrics, replicas, ready)
        self.recommendations.append((now, desired))
        horizon = max(s.up.window_s, s.down.window_s)
        self.recommendations = [(t, r) for t, r in self.recommendations if t > now - horizon - 1]
        up_rec = min([r for t, r in self.recommendations if t > now - s.up.window_s] + [desired])
        down_rec = max(
            [r for t, r in self.recommendations if t > now - s.down.window_s] + [desired]
        )
        target = replicas
        target = max(target, up_rec)
        target = min(target, down_rec)
        if target > replicas:
            target = min(target, self._limit(now, replicas, s.up, up=True))
        elif target < replicas:
            target = max(target, self._limit(now, replicas, s.down, up=False))
        return max(max(s.min_replicas, 1), min(s.max_replicas, target))

    def keda(self, now: float, metrics: Mapping[str, float], replicas: int) -> int | None:
        """KEDA's activation for ``minReplicaCount: 0``: a new count, or None."""
        if self.scaler.min_replicas > 0:
            return None
        active = any(metrics[t.source] > t.activation for t in self.scaler.triggers)
        if active:
            self.inactive_since = None
            return 1 if replicas == 0 else None
        if self.inactive_since is None:
            self.inactive_since = now
        if replicas > 0 and now - self.inactive_since >= self.scaler.cooldown_s:
            return 0
        return None


# ---- the queue ----------------------------------------------------------------------------


@dataclass
class Result:
    """What one case measured."""

    pool: str
    case: str
    age_target_s: float
    p95_age_s: float
    max_age_s: float
    recovery_s: float | None  # after the step: seconds until the age stays under target (p95)
    peak_replicas: int
    cap: int
    floor: int
    scale_events: int
    direction_changes: int
    hours: float
    peak_connections: Mapping[str, int]  # resource -> this pool's peak + others' worst case
    budgets: Mapping[str, int]

    @property
    def changes_per_hour(self) -> float:
        return self.direction_changes / self.hours


def simulate(
    pool: PoolModel,
    load: Callable[[float], float],
    duration_s: int,
    case: str,
    step_at_s: float | None = None,
    measure_from_s: float = 0.0,
    seed: int = 1,
) -> Result:
    """Run one pool for ``duration_s`` seconds under ``load`` (messages per second)."""
    rng = random.Random(seed)
    s = pool.scaler
    hpa = Hpa(s)
    replicas = max(s.min_replicas, 0)
    starting: deque[float] = deque()  # ready times of pods being started
    ready = replicas
    draining: list[float] = []  # exit times of removed pods
    waiting: deque[list[float]] = deque()  # [arrival time, count]
    depth = 0
    inflight: deque[list[float]] = deque()  # [finish time, count]
    running = 0
    scraped = {"load": 0.0, "age": 0.0}
    ages: list[float] = []
    over_target: list[bool] = []  # per second after the step: age above the target
    peak_replicas = replicas
    peak_holding = replicas
    events: list[tuple[float, int]] = []
    for second in range(duration_s):
        now = float(second)
        # arrivals
        arrived = _poisson(rng, load(now))
        if arrived:
            waiting.append([now, arrived])
            depth += arrived
        # pods become ready; drained pods exit
        while starting and starting[0] <= now:
            starting.popleft()
            ready += 1
        if draining and draining[0] <= now:
            draining = [t for t in draining if t > now]
        # jobs end
        while inflight and inflight[0][0] <= now:
            running -= int(inflight.popleft()[1])
        # free slots take the oldest messages
        free = ready * pool.slots - running
        while free > 0 and waiting:
            batch = waiting[0]
            take = min(free, int(batch[1]))
            batch[1] -= take
            free -= take
            depth -= take
            running += take
            inflight.append([now + pool.job_time_s, take])
            if batch[1] == 0:
                waiting.popleft()
        age = now - waiting[0][0] if waiting else 0.0
        # Prometheus scrapes the pods (none when the pool is at zero)
        if second % SCRAPE_INTERVAL_S == 0 and ready > 0:
            scraped = {"load": float(depth + running), "age": age}
        # KEDA activation, then the HPA
        new = replicas
        polls, syncs = second % s.polling_s == 0, second % HPA_SYNC_S == 0
        if polls or syncs:
            metrics = {
                "load": scraped["load"],
                "age": scraped["age"],
                "ready": float(depth),
                "delayed": 0.0,
            }
            if polls:
                activated = hpa.keda(now, metrics, replicas)
                if activated is not None:
                    new = activated
            if syncs and replicas > 0 and new == replicas:
                new = hpa.sync(now, metrics, replicas, ready)
        if new != replicas:
            delta = new - replicas
            hpa.events.append((now, delta))
            events.append((now, delta))
            if delta > 0:
                for _ in range(delta):
                    starting.append(now + POD_START_S)
            else:
                for _ in range(-delta):
                    if starting:
                        starting.pop()
                    else:
                        ready -= 1
                        draining.append(now + pool.job_time_s)
                draining.sort()
            replicas = new
        # measurements
        if now >= measure_from_s:
            ages.append(age)
        if step_at_s is not None and now >= step_at_s:
            over_target.append(age > pool.age_target_s)
        holding = replicas + len(draining)
        if replicas > peak_replicas or holding > peak_holding:
            peak_replicas = max(peak_replicas, replicas)
            peak_holding = max(peak_holding, holding)
    ages.sort()
    recovery = None
    if step_at_s is not None:
        recovery = _recovery(over_target)
    directions = [1 if d > 0 else -1 for t, d in events if t >= measure_from_s]
    changes = sum(1 for a, b in itertools.pairwise(directions) if a != b)
    return Result(
        pool=pool.name,
        case=case,
        age_target_s=pool.age_target_s,
        p95_age_s=ages[int(0.95 * (len(ages) - 1))] if ages else 0.0,
        max_age_s=ages[-1] if ages else 0.0,
        recovery_s=recovery,
        peak_replicas=peak_replicas,
        cap=s.max_replicas,
        floor=s.min_replicas,
        scale_events=len(events),
        direction_changes=changes,
        hours=max(1e-9, (duration_s - measure_from_s) / 3600),
        peak_connections={
            r: peak_holding * per + pool.others.get(r, 0) for r, per in pool.per_pod.items()
        },
        budgets={r: pool.budgets[r] for r in pool.per_pod},
    )


def _recovery(over_target: Sequence[bool], window_s: int = 60) -> float:
    """Seconds after the step until the age stays under the target: the end of the last
    minute (counted from the step) in which it was above the target for more than 5 % of
    the seconds (one noisy second is not a miss; three in a minute are)."""
    last_bad_end = 0
    for start in range(0, len(over_target), window_s):
        window = over_target[start : start + window_s]
        if sum(window) > 0.05 * len(window):
            last_bad_end = start + len(window)
    return float(last_bad_end)


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth for small means, a rounded normal for large ones)."""
    if mean <= 0:
        return 0
    if mean > 50:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


# ---- the cases ----------------------------------------------------------------------------

#: Base load: 6 % of what the pool serves at its capped maximum, so a 10x step needs 60 %
#: (a pool at its cap has no headroom left to absorb the arrivals' noise beyond that).
BASE_UTILISATION = 0.06


def cases(pool: PoolModel) -> list[Result]:
    """The four cases of a pool: a 10x step, a spike, a diurnal day and two steady hours."""
    base = BASE_UTILISATION * pool.scaler.max_replicas * pool.rate_per_replica
    warm = 900  # a quarter of an hour at the base load first
    step = simulate(
        pool,
        lambda t: base * (10 if t >= warm else 1),
        warm + 3600,
        "10x step",
        step_at_s=warm,
        measure_from_s=warm,
    )
    spike = simulate(
        pool,
        lambda t: base * (20 if warm <= t < warm + 60 else 1),
        warm + 3600,
        "spike 20x 60s",
        measure_from_s=warm,
    )
    day = 86_400
    diurnal = simulate(
        pool,
        lambda t: base * (1 + 4.5 * (1 - math.cos(2 * math.pi * t / day)) / 2),
        day,
        "diurnal 1x-5.5x",
    )
    settle = 2700  # the first scale-up and the slow scale-down after it
    steady = simulate(pool, lambda t: base * 5, settle + 7200, "steady 5x", measure_from_s=settle)
    return [step, spike, diurnal, steady]


def run(objects: Sequence[Obj]) -> list[Result]:
    """Every case of every pool of a rendered stack."""
    return [result for pool in pools_of(objects) for result in cases(pool)]


def table(results: Sequence[Result]) -> str:
    """A markdown table of the results."""
    header = (
        "| pool | case | p95 age / target (s) | back under target | peak replicas / cap "
        "| scale events | direction changes / h | peak connections / budget |"
    )
    lines = [
        header,
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        conns = ", ".join(
            f"{name} {r.peak_connections[name]}/{r.budgets[name]}" for name in r.peak_connections
        )
        recovery = "" if r.recovery_s is None else f"{r.recovery_s:.0f} s"
        lines.append(
            f"| {r.pool} | {r.case} | {r.p95_age_s:.1f} / {r.age_target_s:.0f} | {recovery} "
            f"| {r.peak_replicas} / {r.cap} | {r.scale_events} | {r.changes_per_hour:.1f} "
            f"| {conns or '-'} |"
        )
    return "\n".join(lines)


def problems(results: Sequence[Result]) -> list[str]:
    """Where the goals fail: back under target within 3 minutes of a 10x step (for a pool
    the scaler can grow: cap above its floor); never above the cap or a budget; at most 2
    direction changes per hour under steady load."""
    out = []
    for r in results:
        where = f"{r.pool} / {r.case}"
        if r.recovery_s is not None and r.recovery_s > 180 and r.cap > r.floor:
            out.append(f"{where}: back under target after {r.recovery_s:.0f} s (> 180 s)")
        if r.peak_replicas > r.cap:
            out.append(f"{where}: {r.peak_replicas} replicas above the cap {r.cap}")
        for name, peak in r.peak_connections.items():
            if peak > r.budgets[name]:
                out.append(f"{where}: {name} {peak} connections above the budget")
        if r.case.startswith("steady") and r.changes_per_hour > 2:
            out.append(f"{where}: {r.changes_per_hour:.1f} direction changes per hour")
    return out


def report(title: str, objects: Sequence[Obj]) -> bool:
    """Simulate ``objects``; print the table under ``## <title>`` and a ``goal missed:`` line
    per missed goal. True when a goal is missed."""
    results = run(objects)
    print(f"## {title}\n\n{table(results)}\n")
    missed = problems(results)
    for problem in missed:
        print(f"goal missed: {problem}")
    return bool(missed)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m worker_infra.simulate <rendered stack YAML>...``: print the table of each;
    exit 1 when a goal fails."""
    import yaml

    failed = False
    for path in argv if argv is not None else sys.argv[1:]:
        objects = list(yaml.safe_load_all(Path(path).read_text(encoding="utf-8")))
        failed |= report(path, objects)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "PoolModel",
    "Result",
    "cases",
    "pools_of",
    "problems",
    "report",
    "run",
    "simulate",
    "table",
]
