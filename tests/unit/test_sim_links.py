"""The home-connection distribution: its documented medians and shares, and latencies."""

from __future__ import annotations

import statistics

import pytest

from volunteerd.sim.links import (
    CORE_ONE_WAY_MS,
    DOWN_MEDIAN_MBPS,
    LAN,
    RTT_MEDIAN_MS,
    UP_MEDIAN_MBPS,
    Link,
    home_links,
    one_way_s,
    transfer_s,
)
from volunteerd.testing.wan.profile import BUILTIN

LINKS = home_links(10_000, seed=0)


def test_same_seed_draws_the_same_links() -> None:
    assert home_links(500, seed=3) == home_links(500, seed=3)
    assert home_links(500, seed=3) != home_links(500, seed=4)
    assert home_links(10_000, seed=0)[:500] == LINKS[:500]


@pytest.mark.parametrize(
    ("figure", "median"),
    [("down_mbps", DOWN_MEDIAN_MBPS), ("up_mbps", UP_MEDIAN_MBPS), ("rtt_ms", RTT_MEDIAN_MS)],
)
def test_medians_are_the_documented_ones(figure: str, median: float) -> None:
    drawn = statistics.median(getattr(link, figure) for link in LINKS)
    assert drawn == pytest.approx(median, rel=0.04)


def test_a_quarter_of_homes_upload_at_10_mbit_or_less() -> None:
    share = sum(link.up_mbps <= 10 for link in LINKS) / len(LINKS)
    assert share == pytest.approx(0.26, abs=0.02)  # the module docstring's figure


def test_fast_downloads_upload_faster() -> None:
    by_down = sorted(LINKS, key=lambda link: link.down_mbps)
    slow, fast = by_down[: len(by_down) // 4], by_down[-len(by_down) // 4 :]
    assert statistics.median(link.up_mbps for link in fast) > 4 * statistics.median(
        link.up_mbps for link in slow
    )


def test_links_stay_within_physical_bounds() -> None:
    assert all(0.5 <= link.up_mbps <= 1000 and 1 <= link.down_mbps <= 1000 for link in LINKS)
    assert all(2 <= link.rtt_ms <= 600 for link in LINKS)


def test_one_way_is_positive_and_symmetric() -> None:
    for a, b in zip(LINKS[:200], LINKS[200:400], strict=True):
        assert one_way_s(a, b) == one_way_s(b, a) > 0
    a, b = LINKS[0], LINKS[1]
    assert one_way_s(a, b) == pytest.approx((a.rtt_ms / 2 + b.rtt_ms / 2 + CORE_ONE_WAY_MS) / 1000)


def test_lan_hosts_are_microseconds_apart_and_homes_tens_of_milliseconds() -> None:
    assert 0 < one_way_s(LAN, LAN) < 1e-4
    pairs = [one_way_s(a, b) for a, b in zip(LINKS[::2], LINKS[1::2], strict=True)]
    assert statistics.median(pairs) == pytest.approx(0.050, rel=0.1)


def test_wan_emulator_hosts_map_to_links_of_the_same_latency() -> None:
    home = Link.of_wan(BUILTIN["home"].link_specs(1, seed=0)[0])
    assert home == Link(up_mbps=10.0, down_mbps=50.0, rtt_ms=40.0)
    # the emulator's hosts are delay_a + delay_b apart, through one core router
    assert one_way_s(home, home, core_ms=0) == pytest.approx(0.040)
    lan = Link.of_wan(BUILTIN["lan"].link_specs(1, seed=0)[0])
    assert one_way_s(lan, lan) == 0


def test_transfer_is_limited_by_the_slower_end() -> None:
    sender = Link(up_mbps=10, down_mbps=100, rtt_ms=20)
    receiver = Link(up_mbps=10, down_mbps=5, rtt_ms=20)
    megabyte = 1_000_000
    assert transfer_s(sender, receiver, megabyte) == pytest.approx(
        one_way_s(sender, receiver) + 1.6
    )
    assert transfer_s(receiver, sender, megabyte) == pytest.approx(
        one_way_s(sender, receiver) + 0.8
    )
