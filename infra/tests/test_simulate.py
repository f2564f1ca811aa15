"""The simulation's HPA against the rules Kubernetes documents, and its queue model."""

from __future__ import annotations

from worker_infra.simulate import Hpa, Policy, PoolModel, Rules, Scaler, Trigger, simulate


def scaler(**changes: object) -> Scaler:
    base = {
        "polling_s": 15,
        "cooldown_s": 300,
        "min_replicas": 1,
        "max_replicas": 50,
        "triggers": (
            Trigger("load", "load", "AverageValue", 10, 0),
            Trigger("age", "age", "Value", 5, 0),
        ),
        "up": Rules(0, "Max", (Policy("Percent", 100, 15), Policy("Pods", 4, 15))),
        "down": Rules(300, "Min", (Policy("Pods", 1, 60),)),
    }
    base.update(changes)
    return Scaler(**base)  # type: ignore[arg-type]


def test_average_value_is_total_over_target_within_the_tolerance() -> None:
    hpa = Hpa(scaler())
    assert hpa.proposal({"load": 89, "age": 0}, replicas=10, ready=10) == 9
    # 105 / (10 x 10) = 1.05: inside the tolerance 0.1, so no change
    assert hpa.proposal({"load": 105, "age": 0}, replicas=10, ready=10) == 10
    assert hpa.proposal({"load": 111, "age": 0}, replicas=10, ready=10) == 12


def test_value_scales_the_ready_pods_by_value_over_target() -> None:
    hpa = Hpa(scaler())
    # age 20 s against 5 s with 3 ready pods: ceil(3 x 4) = 12 (AverageValue would say 4)
    assert hpa.proposal({"load": 0, "age": 20}, replicas=5, ready=3) == 12


def test_scale_up_policies_and_the_larger_one_wins() -> None:
    hpa = Hpa(scaler())
    # from 3: 100 % -> 6, 4 pods -> 7; Max selects 7
    assert hpa.sync(0, {"load": 500, "age": 0}, replicas=3, ready=3) == 7
    hpa.events.append((0, 4))
    # within the same 15 s period nothing more is allowed
    assert hpa.sync(10, {"load": 500, "age": 0}, replicas=7, ready=3) == 7


def test_scale_down_waits_out_the_window_then_one_pod_per_period() -> None:
    hpa = Hpa(scaler())
    assert hpa.sync(0, {"load": 100, "age": 0}, replicas=10, ready=10) == 10
    # a lower proposal is held back while a higher one is inside the 300 s window
    assert hpa.sync(15, {"load": 10, "age": 0}, replicas=10, ready=10) == 10
    assert hpa.sync(301, {"load": 10, "age": 0}, replicas=10, ready=10) == 9
    hpa.events.append((301, -1))
    assert hpa.sync(316, {"load": 10, "age": 0}, replicas=9, ready=9) == 9


def test_scale_up_window_needs_two_high_readings() -> None:
    hpa = Hpa(scaler(up=Rules(30, "Max", (Policy("Pods", 8, 15),))))
    assert hpa.sync(0, {"load": 10, "age": 0}, replicas=1, ready=1) == 1
    assert hpa.sync(15, {"load": 50, "age": 0}, replicas=1, ready=1) == 1
    assert hpa.sync(30, {"load": 50, "age": 0}, replicas=1, ready=1) == 5


def test_keda_wakes_a_pool_at_zero_and_sends_it_back_after_the_cooldown() -> None:
    hpa = Hpa(scaler(min_replicas=0))
    assert hpa.keda(0, {"load": 0, "age": 0}, replicas=0) is None
    assert hpa.keda(15, {"load": 1, "age": 0}, replicas=0) == 1
    assert hpa.keda(30, {"load": 0, "age": 0}, replicas=1) is None
    assert hpa.keda(330, {"load": 0, "age": 0}, replicas=1) == 0


def test_a_queue_served_below_capacity_never_ages() -> None:
    pool = PoolModel(
        name="p",
        scaler=scaler(min_replicas=2, max_replicas=2),
        processes=1,
        concurrency=4,
        job_time_s=1,
        age_target_s=5,
        per_pod={"db": 5},
        budgets={"db": 100},
        others={},
    )
    result = simulate(pool, lambda t: 4.0, 600, "steady")
    assert result.p95_age_s <= 1 and result.peak_replicas == 2
    assert result.peak_connections == {"db": 10}
    overloaded = simulate(pool, lambda t: 16.0, 300, "overload")
    assert overloaded.max_age_s > 100  # 8 slots, 16 per second: the backlog grows
