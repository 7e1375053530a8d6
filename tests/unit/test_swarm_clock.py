"""``net/swarm_clock.py``: a node whose wall clock is off reads the swarm's time from
its peers' records, where most of them agree, and only then."""

from __future__ import annotations

import logging
import time

import pytest

from volunteerd.net import swarm_clock
from volunteerd.net.swarm_clock import SwarmClock

TRUE_NOW = 1_800_000_000.0


class Clocks:
    """A node's wall clock ``off`` seconds from the swarm's, and a monotonic one."""

    def __init__(self, off: float) -> None:
        self.true, self.off, self.ticking = TRUE_NOW, off, 0.0

    def swarm_clock(self) -> SwarmClock:
        return SwarmClock(wall=lambda: self.true + self.off, ticking=lambda: self.ticking)

    def step(self, seconds: float) -> None:
        self.true += seconds
        self.ticking += seconds


def hear(clock: SwarmClock, clocks: Clocks, voters: dict[str, float], rounds: int = 3) -> None:
    """Each voter sends records it issued just now on its own clock (``voters``: its
    offset from the true time), a second apart."""
    for _ in range(rounds):
        for voter, off in voters.items():
            clock.observe(voter, [clocks.true + off, clocks.true + off - 5.0])
        clocks.step(1.0)


@pytest.mark.parametrize("off", [2 * 3600.0, -2 * 3600.0, 86400.0, -90.0])
def test_a_clock_hours_off_takes_the_time_most_peers_agree_on(
    off: float, caplog: pytest.LogCaptureFixture
) -> None:
    clocks = Clocks(off)
    clock = clocks.swarm_clock()
    caplog.set_level(logging.WARNING, logger=swarm_clock.__name__)
    hear(clock, clocks, {"a": 0.3, "b": -0.2, "c": 0.0})
    assert clock.now() == pytest.approx(clocks.true, abs=1.0)
    assert "this computer's clock is" in caplog.text
    assert ("ahead of" if off > 0 else "behind") in caplog.text


def test_a_clock_within_the_records_tolerance_is_left_alone() -> None:
    clocks = Clocks(20.0)
    clock = clocks.swarm_clock()
    hear(clock, clocks, {"a": 0.0, "b": 0.0, "c": 0.0})
    assert clock.offset == 0.0
    assert clock.agreed == pytest.approx(-20.0, abs=1.0)


def test_one_peer_or_a_minority_cannot_move_an_honest_clock() -> None:
    clocks = Clocks(0.0)
    clock = clocks.swarm_clock()
    hear(clock, clocks, {"liar": 3 * 3600.0})
    assert clock.offset == 0.0
    hear(clock, clocks, {"liar": 3 * 3600.0, "liar2": 3 * 3600.0, "a": 0.0, "b": 0.0})
    assert clock.offset == 0.0  # two against two: no strict majority
    hear(clock, clocks, {"c": 0.0})
    assert clock.offset == 0.0
    assert clock.agreed == pytest.approx(0.0, abs=1.0)


def test_identities_behind_one_voter_are_one_vote() -> None:
    """The DHT names a voter by the prefix a peer connects from: however many records
    and identities come from it, they are one sample (the newest it sent)."""
    clocks = Clocks(0.0)
    clock = clocks.swarm_clock()
    for _ in range(100):
        clock.observe("203.0.113.0/24", [clocks.true + 3600.0] * 50)
    hear(clock, clocks, {"a": 0.0, "b": 0.0})
    assert clock.offset == 0.0


def test_old_records_from_a_find_do_not_drag_the_time_back() -> None:
    """A find's answer holds records up to an announce period old: a voter counts with
    the newest it sent in the window, so records from a minute ago do not read as a
    clock a minute behind."""
    clocks = Clocks(0.0)
    clock = clocks.swarm_clock()
    for _ in range(5):
        for voter in "abc":
            clock.observe(voter, [clocks.true])
            clock.observe(voter, [clocks.true - 100.0])  # an old record, later
        clocks.step(1.0)
    assert clock.offset == 0.0
    assert clock.agreed == pytest.approx(0.0, abs=2.0)


def test_a_clock_days_off_is_reported_not_followed(caplog: pytest.LogCaptureFixture) -> None:
    clocks = Clocks(-30 * 86400.0)
    clock = clocks.swarm_clock()
    caplog.set_level(logging.ERROR, logger=swarm_clock.__name__)
    hear(clock, clocks, {"a": 0.0, "b": 0.0, "c": 0.0})
    assert clock.offset == 0.0
    assert "30.0 days behind the swarm's" in caplog.text
    assert "too far to follow" in caplog.text


def test_voters_gone_for_the_window_no_longer_count_and_a_set_clock_is_seen() -> None:
    clocks = Clocks(7200.0)
    clock = clocks.swarm_clock()
    hear(clock, clocks, {"a": 0.0, "b": 0.0})
    assert clock.offset == pytest.approx(-7200.0, abs=1.0)
    clocks.off = 0.0  # the owner set the clock right
    clocks.step(swarm_clock.WINDOW_S)
    hear(clock, clocks, {"c": 0.0, "d": 0.0})
    assert clock.offset == 0.0
    assert clock.now() == pytest.approx(clocks.true)


def test_a_wall_clock_jump_is_corrected_at_once_not_at_the_next_record() -> None:
    # The offset was estimated only as records came: read between a jump of the wall
    # clock and the next record, the swarm's time was the jumped time (a manifest read
    # then as expired: its project was dropped).
    clocks = Clocks(0.0)
    clock = clocks.swarm_clock()
    hear(clock, clocks, {"a": 0.0, "b": 0.0, "c": 0.0})
    assert clock.offset == 0.0
    clocks.off = 48 * 3600.0  # set 48 h ahead; no record has come since
    clocks.step(0.5)
    assert clock.now() == pytest.approx(clocks.true, abs=1.0)
    clocks.off = 0.0  # and set right again
    clocks.step(0.5)
    assert clock.now() == pytest.approx(clocks.true, abs=1.0)


def test_with_no_voters_heard_the_wall_clock_is_the_swarms_time() -> None:
    clocks = Clocks(0.0)
    clock = clocks.swarm_clock()
    clocks.off = 3 * 3600.0
    assert clock.now() == clocks.true + clocks.off  # nobody to say otherwise


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="Linux's CLOCK_BOOTTIME")
def test_a_night_asleep_is_not_read_as_a_clock_jump(monkeypatch: pytest.MonkeyPatch) -> None:
    """A suspend: the wall clock and CLOCK_BOOTTIME run on, ``time.monotonic`` stops.
    Samples kept on the monotonic clock read the night as this clock jumping ahead of
    every voter, and the swarm's time went back by the whole night (records signed for
    it refused as expired) until fresh records came."""
    asleep = [0.0]
    real_gettime = time.clock_gettime

    def gettime(clock_id: int) -> float:
        extra = asleep[0] if clock_id == time.CLOCK_BOOTTIME else 0.0
        return real_gettime(clock_id) + extra

    monkeypatch.setattr(time, "clock_gettime", gettime)
    start_wall, start_mono = TRUE_NOW, time.monotonic()

    def wall() -> float:  # right, and running on through the night
        return start_wall + (time.monotonic() - start_mono) + asleep[0]

    clock = SwarmClock(wall=wall)
    for voter in ("a", "b", "c"):
        clock.observe(voter, [wall()])  # the voters' clocks agree with this one
    assert clock.now() == pytest.approx(wall(), abs=1.0)
    asleep[0] = 8 * 3600.0  # the lid closed for 8 hours; no record has come since
    assert clock.now() == pytest.approx(wall(), abs=1.0)
    assert clock.offset == 0.0
