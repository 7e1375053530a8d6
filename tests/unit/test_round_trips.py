"""Timeouts and the k_min grace stretched to measured round trips (moe/timing.py)."""

from __future__ import annotations

import pytest

from volunteerd.config import TimeoutsConfig
from volunteerd.moe.layer import RemoteMixtureOfExperts
from volunteerd.moe.timing import (
    CAP_FACTOR,
    REMEMBERED,
    REPLY_WINDOW_S,
    STRAGGLER_FACTOR,
    TIMEOUT_FACTOR,
    RoundTrips,
)


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
        trips.observe("near", "forward", 0.1)
        trips.observe("far", "forward", 0.25)  # 2.5x: slower, not a straggler
    grace = trips.limits(["near", "far"], "forward", 10.0, 0.1).grace_s
    assert grace == pytest.approx(0.15, rel=1e-3)
    assert trips.limits(["near"], "forward", 10.0, 0.1).grace_s == 0.1, "one peer: the floor"
    assert trips.limits(["near", "far"], "forward", 10.0, 0.03).grace_s == CAP_FACTOR * 0.03


def test_a_peer_far_slower_than_the_median_does_not_stretch_the_round() -> None:
    """The outside audit's swarm: three peers answer in 0.1 s, one (a 1 Mbit/s uplink)
    in 2 s. The round's waits follow the three (expected at most STRAGGLER_FACTOR x
    the median's), not the one: its 2 s used to stretch every grace to the cap and the
    timeout to 3 x 2 s."""
    trips = RoundTrips()
    for _ in range(200):
        for peer in ("a", "b", "c"):
            trips.observe(peer, "forward", 0.1)
        trips.observe("slow", "forward", 2.0)
    limits = trips.limits(["a", "b", "c", "slow"], "forward", 0.3, 0.1)
    assert limits.timeout_s == pytest.approx(TIMEOUT_FACTOR * STRAGGLER_FACTOR * 0.1, rel=1e-3)
    assert limits.grace_s == pytest.approx(STRAGGLER_FACTOR * 0.1 - 0.1, rel=1e-3)
    # of two, the faster sets the pace; alone, a slow peer is waited for at its own
    pair = trips.limits(["a", "slow"], "forward", 0.3, 0.1)
    assert pair.timeout_s == limits.timeout_s
    alone = trips.limits(["slow"], "forward", 2.0, 0.1)
    assert alone.timeout_s == pytest.approx(TIMEOUT_FACTOR * 2.0, rel=1e-3)


def test_a_peer_twice_as_slow_as_the_median_still_stretches_the_round() -> None:
    trips = RoundTrips()
    for _ in range(200):
        for peer in ("a", "b", "c"):
            trips.observe(peer, "forward", 0.1)
        trips.observe("slower", "forward", 0.2)
    limits = trips.limits(["a", "b", "c", "slower"], "forward", 0.2, 0.05)
    assert limits.timeout_s == pytest.approx(TIMEOUT_FACTOR * 0.2, rel=1e-3)
    assert limits.grace_s == pytest.approx(0.1, rel=1e-3)


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


def test_no_timeout_is_stretched_past_the_servers_reply_window() -> None:
    # Peers measured at 25 s a call: 3 x their pace (and 4 x a 30 s floor) is longer than
    # servers keep a reply (REPLY_WINDOW_S); waiting past it got nothing.
    trips = RoundTrips()
    for _ in range(50):
        trips.observe("slow", "backward", 25.0)
    assert trips.limits(["slow"], "backward", 30.0, 0.5).timeout_s == REPLY_WINDOW_S
    assert trips.limits(["slow"], "backward", 10.0, 0.5).timeout_s == 40.0  # 4 x the floor
    assert TimeoutsConfig().request_s == REPLY_WINDOW_S  # the daemon's own default


@pytest.mark.parametrize("key", ["forward_timeout_s", "backward_timeout_s"])
@pytest.mark.parametrize("seconds", [0.0, 61.0, float("inf")])
def test_a_layer_refuses_timeouts_past_the_reply_window(key: str, seconds: float) -> None:
    with pytest.raises(ValueError, match=rf"{key} must be over 0 and at most 60 s"):
        RemoteMixtureOfExperts(8, (4,), "ffn.", 2, client=object(), **{key: seconds})  # type: ignore[arg-type]
    layer = RemoteMixtureOfExperts(8, (4,), "ffn.", 2, client=object(), **{key: 60.0})  # type: ignore[arg-type]
    assert getattr(layer, key) == 60.0
