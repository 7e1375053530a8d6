"""The progress bar's tokens/s: what finished in a recent window, not one step's speed."""

from __future__ import annotations

import pytest

from volunteerd.train.progress import Rate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_steps_count_what_finished_per_second() -> None:
    """Four steps of 1 s each, overlapping, finishing a quarter second apart: 4 per s."""
    clock = Clock()
    rate = Rate(window_s=10.0, clock=clock)
    clock.now += 1.0  # the first ones took a second to come back
    for _ in range(40):
        clock.now += 0.25
        rate.add(1000)
    assert rate.per_s() == pytest.approx(4000, rel=0.03)


def test_the_window_forgets_what_came_before() -> None:
    clock = Clock()
    rate = Rate(window_s=10.0, clock=clock)
    for _ in range(10):
        clock.now += 1.0
        rate.add(10_000)  # fast at first
    for _ in range(20):
        clock.now += 1.0
        rate.add(100)  # then slow
    assert rate.per_s() == pytest.approx(100, rel=0.11)


def test_steps_slower_than_the_window_read_as_their_own_rate() -> None:
    """Steps of 12 s with a 10 s window: 1000 tokens per 12 s, not 1000 per window."""
    clock = Clock()
    rate = Rate(window_s=10.0, clock=clock)
    for _ in range(5):
        clock.now += 12.0
        rate.add(1000)
    assert rate.per_s() == pytest.approx(1000 / 12, rel=0.01)
