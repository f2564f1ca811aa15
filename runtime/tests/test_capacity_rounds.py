"""``capacity``'s decisions, proven on measurements fed to them.

Where throughput stops rising, which levels were disturbed, the advice for a CPU-bound
handler and the steady-state rate are pure functions of the measurements: these tests
hold them to numbers like those real runs produce (quiet and loaded), so no verdict here
depends on the machine. The template's tests run the command itself with real worker
processes; ``bench/capacity_bench.py`` measures a real CPU-bound handler.
"""

from __future__ import annotations

import pytest

from worker_runtime.capacity import (
    NOISY_SPREAD,
    CapacityError,
    Level,
    noise_warning,
    noisy,
    steady_rate,
    stops_rising_at,
    verdict,
    with_gains,
)


def levels_of(*rounds: tuple[float, ...], first: int = 1) -> list[Level]:
    """Levels 1, 2, 4, ... (from ``first``) with these rounds each."""
    return with_gains({first * 2**index: list(r) for index, r in enumerate(rounds)})


def test_a_level_is_its_best_round_with_its_gain_over_the_level_before() -> None:
    one, two = levels_of((40.0, 50.0, 45.0), (90.0, 99.0, 80.0))
    assert (one.concurrency, one.jobs_per_s, one.gain, one.rounds) == (
        1,
        50.0,
        None,
        (40.0, 50.0, 45.0),
    )
    assert two.jobs_per_s == 99.0 and two.gain == pytest.approx(0.98)
    assert one.spread == pytest.approx(0.25)


def test_cpu_bound_measurements_stop_at_one_with_the_processes_advice() -> None:
    # A quiet two-core run of a ~20 ms loop under the GIL (76 / 76 / 77 jobs/s).
    levels = levels_of((76.1, 75.7, 75.6), (74.1, 75.9, 74.7), (75.7, 76.6, 73.2))
    assert stops_rising_at(levels, 0.1) == 1
    text = verdict(levels, 0.1, configured=8)
    assert text.startswith(
        "throughput stops rising at concurrency 1: no higher level gains "
        "10% over it (best: concurrency 4, +1%)"
    ), text
    assert "scale it with WORKER_PROCESSES or replicas, not WORKER_CONCURRENCY" in text
    assert noisy(levels) == [] and noise_warning(levels) is None


def test_io_bound_measurements_still_rise_at_the_highest_level() -> None:
    levels = levels_of((48.0, 49.0, 47.5), (96.0, 97.0, 95.0), (190.0, 188.0, 191.0))
    assert stops_rising_at(levels, 0.1) is None
    assert verdict(levels, 0.1, configured=8) == (
        "throughput still rises at concurrency 4, the highest level measured; measure higher levels"
    )


def test_a_knee_below_the_configured_concurrency_says_so() -> None:
    levels = levels_of((50.0,), (98.0,), (101.0,), (99.0,))
    assert stops_rising_at(levels, 0.1) == 2
    text = verdict(levels, 0.1, configured=8)
    assert text.splitlines()[-1] == "the pool runs concurrency 8, above that level"
    assert "WORKER_PROCESSES" not in text
    assert verdict(levels, 0.1, configured=2).count("\n") == 0


def test_one_low_level_does_not_hide_a_rise() -> None:
    # Level 2 was slowed by a burst of other load; level 4 still beats level 1 by far.
    levels = levels_of((50.0,), (45.0,), (180.0,))
    assert stops_rising_at(levels, 0.1) is None


def test_min_gain_decides_what_counts_as_flat() -> None:
    # The loaded CI run of the CPU-bound handler: 24 / 25 / 29 jobs/s.
    levels = levels_of((24.0,), (25.0,), (29.0,))
    assert stops_rising_at(levels, 0.1) is None  # +21 %: rising at a 10 % bar
    assert stops_rising_at(levels, 0.3) == 1  # flat at a 30 % bar


def test_rounds_that_disagree_are_reported_with_the_worst_spread() -> None:
    levels = levels_of((42.1, 36.8, 67.7), (75.0, 74.0, 76.0), (60.0, 80.0, 79.0))
    assert noisy(levels) == [1, 4]
    assert noise_warning(levels) == (
        "the rounds of concurrency 1, 4 differ by up to 84%: something else ran on this "
        "machine, and the verdict may be wrong; measure again where nothing else runs"
    )


def test_a_spread_at_the_bound_is_not_noise() -> None:
    levels = levels_of((100.0, 100.0 * (1 + NOISY_SPREAD)))
    assert noisy(levels) == []
    assert noisy(levels_of((100.0, 100.0 * (1 + NOISY_SPREAD) + 0.01))) == [1]


def test_steady_rate_leaves_out_the_first_and_last_waves() -> None:
    # 16 jobs at concurrency 4: a slow boot (0.5 s), then a wave of 4 every 0.1 s.
    samples = [(0.0, 0), (0.5, 0), (0.6, 4), (0.7, 8), (0.8, 12), (0.9, 16)]
    assert steady_rate(samples, jobs=16, concurrency=4) == pytest.approx(8 / 0.2)
    # Timing from the first job done would count the jobs already under way as done in
    # the window; starting at the 4th job done does not, whatever the boot took.
    slow_boot = [(t + 5.0 if t else t, done) for t, done in samples]
    assert steady_rate(slow_boot, jobs=16, concurrency=4) == pytest.approx(8 / 0.2)


def test_jobs_done_too_fast_to_time_are_refused() -> None:
    samples = [(0.0, 0), (0.01, 4), (0.02, 12), (0.03, 16)]
    with pytest.raises(CapacityError, match=r"the 8 timed jobs of 16 were done in 0\.010 s"):
        steady_rate(samples, jobs=16, concurrency=4)
