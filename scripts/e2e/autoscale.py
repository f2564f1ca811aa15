"""The autoscaling step of ``make e2e`` (:mod:`pods`): the real KEDA (:mod:`keda`) scaling
the external pool on a real backlog that Prometheus (:mod:`prom`) scrapes from its pods and the
scheduler, through the HPA of the real controller manager.

The external pool holds a downstream resource (``partner_api``), so its maximum is what that
budget admits: the e2e's stack gives partner_api a budget of exactly
(:data:`MAX_REPLICAS` + 2 draining) x 4 for external plus critical's share, so a fourth
replica would be refused by the capacity guard. Then:

1. ledger jobs are kept waiting (the ready list topped up to :data:`BACKLOG`) until
   Prometheus reports the pool's backlog age (the ScaledObject's own ``age`` query) past
   the pool's target, and on until the pool is at its maximum, Ready;
2. replicas rise to the maximum and never past it (the Deployment and its serving pods read
   every half second; the HPA says ``ScalingLimited``: the backlog asked for more);
3. the backlog drains: every job started once and finished once;
4. Prometheus stopped: the replica count holds (the HPA does not scale down on a metric it
   cannot read, ``ignoreNullValues: false``; the redis triggers alone ask for the floor);
5. Prometheus started again: replicas come down to the floor, each step at most the policy's
   pods and at least its period after the previous one.

The e2e shortens the scale-down stabilization window and period (:data:`SCALE_DOWN_S`, a
Pulumi transform of the ScaledObjects: :func:`quick_scale_down`); what is asserted is read from
the live HPA, whatever its numbers.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import run
from run import check

if TYPE_CHECKING:
    import keda as kd
    import prom as pr

POOL = "external"
QUEUE = "partner"
MAX_REPLICAS = 3
MIN_REPLICAS = 1
#: partner_api's budget in the e2e's stack: external (3 + 2) x 4 + critical (1 + 2) x 4 = 32.
PARTNER_CAPACITY, PARTNER_RESERVED = 34, 2
AGE_TARGET_S = 10
#: The backlog: jobs of 2 s (one replica runs 2 a second), sent up to 10 a second while the
#: ready list holds fewer than :data:`BACKLOG` (a wait of 20 s at one replica, 7 s at three:
#: the triggers ask for 10 replicas; its drain is short).
JOB_S = 2.0
FEED_INTERVAL_S = 0.1
BACKLOG = 40
#: The e2e's scale-down stabilization window and period (the stack's: 900 s and 60 s+).
SCALE_DOWN_S = 15
#: How long Prometheus stays stopped: longer than the window plus an HPA sync (15 s) and
#: KEDA's poll, by when the first step down would have come.
HOLD_S = 40
#: Slack of the period check: the watch reads every half second.
SLACK_S = 2.0


def quick_scale_down(args: Any) -> Any:
    """A Pulumi transform: the ScaledObjects' scale-down window and period of
    :data:`SCALE_DOWN_S` (an e2e cannot wait 15 minutes); everything else as rendered."""
    import pulumi

    if args.type_ != "kubernetes:keda.sh/v1alpha1:ScaledObject":
        return None
    props = copy.deepcopy(dict(args.props))
    down = props["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    down["stabilizationWindowSeconds"] = SCALE_DOWN_S
    for policy in down["policies"]:
        policy["periodSeconds"] = SCALE_DOWN_S
    return pulumi.ResourceTransformResult(props, args.opts)


def stack_config(config: dict[str, Any], prometheus_url: str) -> None:
    """The e2e's dev stack: Prometheus at ``prometheus_url``, the external pool's range and
    age target, partner_api's budget (see the module doc)."""
    config[run.key("prometheusServer")] = prometheus_url
    config[run.key("pools")][POOL].update(
        min_replicas=MIN_REPLICAS,
        max_replicas=MAX_REPLICAS,
        backlog_age_target_s=AGE_TARGET_S,
    )
    config[run.key("downstream")]["partner_api"].update(
        capacity=PARTNER_CAPACITY, reserved=PARTNER_RESERVED
    )


@dataclass
class Reading:
    at: float
    replicas: int
    serving: int
    conditions: dict[str, tuple[str, str]]


@dataclass
class ScaleWatch:
    """The pool's Deployment, serving pods and HPA conditions every half second."""

    cluster: Any
    deployment: str
    hpa: str
    readings: list[Reading] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ns = run.NAMESPACE
        while not self._stop.wait(0.5):
            try:
                d = self.cluster.api("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/"
                                            f"{self.deployment}")
                pods = run.api_list(self.cluster, f"/api/v1/namespaces/{ns}/pods?labelSelector="
                                                  f"{run.POOL_LABEL}={POOL}")
                hpa = self.cluster.api("GET", f"/apis/autoscaling/v2/namespaces/{ns}/"
                                              f"horizontalpodautoscalers/{self.hpa}")
            except Exception:  # noqa: BLE001 (a missed reading; the next one comes)
                continue
            self.readings.append(Reading(
                time.monotonic(),
                int(d["spec"]["replicas"]),
                sum(1 for p in pods if not p["metadata"].get("deletionTimestamp")),
                {c["type"]: (c["status"], c.get("reason", ""))
                 for c in hpa.get("status", {}).get("conditions", [])},
            ))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def replicas(self) -> int:
        return self.readings[-1].replicas if self.readings else -1

    def ready(self) -> int:
        d = self.cluster.api("GET", f"/apis/apps/v1/namespaces/{run.NAMESPACE}/deployments/"
                                    f"{self.deployment}")
        return int(d["status"].get("readyReplicas", 0))

    def steps(self) -> list[tuple[float, int, int]]:
        """(time, from, to) of each change of the Deployment's replicas."""
        out = []
        for a, b in zip(self.readings, self.readings[1:], strict=False):
            if a.replicas != b.replicas:
                out.append((b.at, a.replicas, b.replicas))
        return out

    def seen(self, condition: str, status: str, reason: str = "") -> bool:
        return any(
            r.conditions.get(condition, ("", ""))[0] == status
            and (not reason or r.conditions[condition][1] == reason)
            for r in self.readings
        )


def scenario(s: Any, prometheus: pr.Prometheus, keda: kd.Keda) -> None:
    """The steps of the module doc; ``s`` is the :class:`pods.Scenarios`."""
    cluster, numbers = s.cluster, s.numbers
    name = f"{run.PROJECT}-{POOL}"
    ns = run.NAMESPACE
    so = cluster.api("GET", f"/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects/{name}")
    spec = so["spec"]
    check(spec["maxReplicaCount"] == MAX_REPLICAS, f"maxReplicaCount {spec['maxReplicaCount']}")
    ready = {c["type"]: c["status"] for c in so.get("status", {}).get("conditions", [])}
    check(ready.get("Ready") == "True", f"ScaledObject {name} not Ready: {so.get('status')}")
    hpa_name = so["status"]["hpaName"]
    hpa = cluster.api("GET", f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers/"
                             f"{hpa_name}")
    down = hpa["spec"]["behavior"]["scaleDown"]
    (policy,) = down["policies"]
    check(policy["type"] == "Pods", f"scale-down policy {policy}")
    period, per_step = policy["periodSeconds"], policy["value"]
    age_query = next(t["metadata"]["query"] for t in spec["triggers"] if t.get("name") == "age")
    ready_list = next(t["metadata"]["listName"] for t in spec["triggers"] if t["type"] == "redis")
    numbers["scale-down policy (window, pods per period)"] = [
        down["stabilizationWindowSeconds"], per_step, period]
    watch = ScaleWatch(cluster, name, hpa_name)
    started = time.monotonic()
    feeder = s.h.feeder(FEED_INTERVAL_S, JOB_S, "e2e_partner", "p", (ready_list, BACKLOG))
    try:
        age = run.wait_until(
            "the backlog age past its target",
            lambda: (v := prometheus.value(age_query)) is not None and v > AGE_TARGET_S and v,
            240,
        )
        numbers["backlog age past target (s, after s)"] = [
            round(age, 1), round(time.monotonic() - started, 1)]
        run.wait_until("the pool at its maximum, Ready",
                       lambda: watch.replicas() == MAX_REPLICAS and watch.ready() == MAX_REPLICAS,
                       300)
        numbers["at the maximum after s"] = round(time.monotonic() - started, 1)
        metrics = [m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]
                   if m["type"] == "External"]
        try:  # what the HPA read, as the admin reads it through the aggregator
            numbers["external metrics through the aggregator"] = {
                m: [i["value"] for i in keda.external_metric(ns, m, name)["items"]]
                for m in metrics
            }
        except Exception as error:  # noqa: BLE001 (a number of the report, not a check)
            numbers["external metrics through the aggregator"] = str(error)[:300]
    finally:
        sent = s.h.stop_feeder(feeder)
    try:
        jobs = [f"p-{i}" for i in range(sent)]
        redis = s.h.redis
        run.wait_until("the backlog drained",
                       lambda: sum(1 for j in redis.hmget("e2e:done", jobs) if j) == sent, 300)
        drained = time.monotonic()
        numbers["partner jobs, drained after s"] = [sent, round(drained - started, 1)]
        at_stop = watch.replicas()
        prometheus.stop()
        stopped = time.monotonic()
        time.sleep(HOLD_S)
        restarted = time.monotonic()
        held = [r.replicas for r in watch.readings if stopped <= r.at < restarted]
        prometheus.start()
        run.wait_until("down to the floor", lambda: watch.replicas() == MIN_REPLICAS,
                       2 * SCALE_DOWN_S + (MAX_REPLICAS - MIN_REPLICAS) * period + 120)
        time.sleep(2)
    finally:
        watch.close()
    started_counts = redis.hgetall("e2e:started")
    done_counts = redis.hgetall("e2e:done")
    twice = {j: (started_counts.get(j), done_counts.get(j)) for j in jobs
             if started_counts.get(j) != "1" or done_counts.get(j) != "1"}
    check(not twice, f"partner jobs not run exactly once (started, done): {twice}")
    peak = max(max(r.replicas, r.serving) for r in watch.readings)
    numbers["peak replicas, serving pods / max"] = [
        max(r.replicas for r in watch.readings), max(r.serving for r in watch.readings),
        MAX_REPLICAS]
    check(peak <= MAX_REPLICAS, f"the pool went past its maximum: {peak} > {MAX_REPLICAS}")
    check(watch.seen("ScalingLimited", "True", "TooManyReplicas"),
          "the HPA never said the backlog asked for more than the maximum")
    check(at_stop == MAX_REPLICAS, f"{at_stop} replicas when Prometheus stopped")
    check(held and set(held) == {at_stop},
          f"Prometheus stopped at {at_stop} replicas: then {sorted(set(held))}")
    check(watch.seen("ScalingActive", "False"),
          "the HPA never reported its Prometheus metrics failing")
    numbers["held while Prometheus stopped (replicas, s)"] = [at_stop, round(restarted - stopped)]
    steps = [(at - restarted, a, b) for at, a, b in watch.steps() if at > started]
    downs = [st for st in steps if st[2] < st[1]]
    numbers["scale-down steps (s after Prometheus restarted, from, to)"] = [
        [round(t, 1), a, b] for t, a, b in downs]
    check(all(t > 0 for t, _, _ in downs), f"scaled down while Prometheus was stopped: {downs}")
    check(all(a - b <= per_step for _, a, b in downs), f"a step past {per_step} pods: {downs}")
    gaps = [b[0] - a[0] for a, b in zip(downs, downs[1:], strict=False)]
    check(all(g >= period - SLACK_S for g in gaps),
          f"scale-down steps {gaps} s apart, policy {per_step} pod per {period} s")
