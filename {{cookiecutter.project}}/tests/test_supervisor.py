"""The supervisor's restart pause: doubling, capped, reset after a stable run."""

from __future__ import annotations

from {{ cookiecutter.package }}.supervisor import (
    RESTART_BACKOFF_S,
    STABLE_AFTER_S,
    next_backoff,
)


def test_restart_pause_doubles_up_to_its_cap() -> None:
    backoff, pauses = RESTART_BACKOFF_S[0], []
    for _ in range(12):
        pause, backoff = next_backoff(backoff, ran_for_s=1.0)
        pauses.append(pause)
    assert pauses[:5] == [0.2, 0.4, 0.8, 1.6, 3.2]
    assert max(pauses) == RESTART_BACKOFF_S[1] == 30.0
    assert pauses[-3:] == [30.0, 30.0, 30.0]


def test_restart_pause_starts_over_after_a_stable_run() -> None:
    pause, backoff = next_backoff(30.0, ran_for_s=STABLE_AFTER_S + 1)
    assert (pause, backoff) == (0.2, 0.4)
