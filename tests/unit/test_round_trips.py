"""Timeouts and the k_min grace stretched to measured round trips (moe/timing.py)."""

from __future__ import annotations

import pytest

from volunteerd.moe.timing import CAP_FACTOR, REMEMBERED, TIMEOUT_FACTOR, RoundTrips


def test_no_measurement_waits_the_configured_floors() -> None:
    limits = RoundTrips().limits(["a", "b"], "forward", 5.0, 0.5)
    assert (limits.timeout_s, limits.grace_s) == (5.0, 0.5)


def test_the_timeout_follows_the_estimate_between_floor_and_cap() -> None:
    trips = RoundTrips()
    for _ in range(200):  # a steady 0.4 s: rttvar decays to nothing
        trips.observe("a", "forward", 0.4)
    assert trips.srtt("a", "forward") == pytest.approx(0.4)
    limits = trips.limits(["a"], "forward", 0.35, 0.0)  # cap 1.4 s
    assert limits.timeout_s == pytest.approx(TIMEOUT_FACTOR * 0.4, rel=1e-3)
    assert trips.limits(["a"], "forward", 5.0, 0.0).timeout_s == 5.0, "never below the floor"
    assert trips.limits(["a"], "forward", 0.2, 0.0).timeout_s == CAP_FACTOR * 0.2, "capped"


def test_a_peer_that_varies_gets_a_longer_wait_than_its_mean() -> None:
    steady, jumpy = RoundTrips(), RoundTrips()
    for i in range(50):
        steady.observe("a", "forward", 0.3)
        jumpy.observe("a", "forward", 0.1 if i % 2 else 0.5)
    assert jumpy.srtt("a", "forward") == pytest.approx(0.3, abs=0.05)
    assert (
        jumpy.limits(["a"], "forward", 0.5, 0.0).timeout_s
        > steady.limits(["a"], "forward", 0.5, 0.0).timeout_s
    )


def test_the_grace_lets_the_slowest_healthy_peer_answer_after_the_fastest() -> None:
    trips = RoundTrips()
    for _ in range(200):
        trips.observe("near", "forward", 0.05)
        trips.observe("far", "forward", 0.35)
    grace = trips.limits(["near", "far"], "forward", 10.0, 0.1).grace_s
    assert grace == pytest.approx(0.30, rel=1e-3)
    assert trips.limits(["near"], "forward", 10.0, 0.1).grace_s == 0.1, "one peer: the floor"
    assert trips.limits(["near", "far"], "forward", 10.0, 0.05).grace_s == CAP_FACTOR * 0.05


def test_estimates_are_per_peer_and_verb() -> None:
    trips = RoundTrips()
    trips.observe("a", "forward", 2.0)
    assert trips.srtt("a", "backward") is None
    assert trips.srtt("b", "forward") is None
    assert trips.limits(["b"], "forward", 1.0, 0.1).timeout_s == 1.0
    assert trips.limits(["a", "b"], "forward", 1.0, 0.1).timeout_s == CAP_FACTOR * 1.0


def test_a_flood_of_peers_forgets_the_least_recently_measured_first() -> None:
    """A trainer meets thousands of peers over weeks of churn (or a Sybil flood of
    servers): the table stays bounded, and a peer measured again is kept."""
    trips = RoundTrips()
    trips.observe("regular", "forward", 0.2)
    for n in range(REMEMBERED + 500):
        trips.observe(f"stranger-{n}", "forward", 1.0)
        if n % 1000 == 0:
            trips.observe("regular", "forward", 0.2)
    assert len(trips) == REMEMBERED
    assert trips.srtt("regular", "forward") == pytest.approx(0.2)
    assert trips.srtt("stranger-0", "forward") is None
