"""Home internet connections: a distribution to draw simulated volunteers' links from.

A `Link` is one host's access to the internet: its upload and download rates and its
round trip to "the core" (its ISP's exchange with the rest of the internet). Two hosts
are `one_way_s(a, b)` apart: half of each access round trip plus a crossing of the core
between their ISPs.

The distribution (`home_links`): each figure log-normal around a median, so that half
the hosts are above and half below it and the spread is a factor, not an offset:

| figure | median | sigma of ln | 10th-90th percentile | clipped to |
|---|---|---|---|---|
| download | 100 Mbit/s | 0.9 | ~32-320 Mbit/s | 1-1000 |
| upload | 20 Mbit/s | 1.1 | ~4.9-82 Mbit/s | 0.5-1000 |
| access round trip | 30 ms | 0.5 | ~16-57 ms | 2-600 |

Upload and download are correlated (0.7 between their logarithms: fibre homes are fast
both ways, DSL homes slow both ways); the round trip is drawn independently. With these
figures **about 26 % of hosts upload at 10 Mbit/s or less** (and ~0.3 % at 1 Mbit/s or
less), 22 % download at 50 Mbit/s or less, and 28 % have an access round trip of 40 ms
or more. Clipping touches under 1 % of hosts and leaves the medians as they are.

Where the figures come from (approximately; crowd-sourced speed tests lean towards
faster lines, and every source measures to a nearby test server, not across a
continent):

* Download: Ookla's Speedtest Global Index put the global median of fixed broadband at
  roughly 90-95 Mbit/s in mid-2024, and the U.S. median at roughly 120 Mbit/s in 2021;
  100 Mbit/s is the round number between.
* Upload: the global median of fixed broadband (~45 Mbit/s in Ookla's 2020 figures) is
  lifted by symmetric fibre in East Asia; asymmetric cable and DSL lines, most homes of
  North America and Europe, upload far less (Ookla's U.S. median was ~18 Mbit/s in
  2021). We take 20 Mbit/s and a wide spread, so that DSL (~1 Mbit/s) and fibre
  (hundreds) are both in the tail, and a quarter of hosts sit at or below the 10 Mbit/s
  the issue asks the per-volunteer traffic to fit.
* Access round trip: Ookla's idle latency to the nearest test server is ~10-20 ms on
  fixed lines (15 ms U.S. median in 2021; the FCC's Measuring Broadband America reports
  find latency depends mostly on the technology, DSL highest); Wi-Fi in the home and the
  way to an exchange point add to it, and satellite lines (~40 ms low-orbit, ~600 ms
  geostationary) sit in the tail. We take 30 ms.
* Core: `CORE_ONE_WAY_MS` = 20 ms between two ISPs' cores, a continent-sized swarm
  (fibre across Europe is ~10-15 ms one way, across North America ~25-30 ms).

So the median pair of hosts is 15 + 15 + 20 = 50 ms apart one way (100 ms round trip).

The WAN emulator (`volunteerd/testing/wan/profile.py`) uses the same picture: there a
host's `delay_ms` is one way host -> core, so `Link.of_wan(spec)` has
`rtt_ms = 2 * delay_ms`. Its hosts share one core router, so compare a run there with
`one_way_s(a, b, core_ms=0)`. Its profiles sit inside this distribution: `home` (50
down / 10 up Mbit/s, 40 ms access round trip) is a slower-than-median home (about the
22nd percentile of download, 26th of upload, 72nd of round trip), `dsl` (16/1 Mbit/s)
is the slow tail, `internet` spreads 20-150 ms one way between homes, and `lan` is the
`LAN` link below (we give it 10 Gbit/s, the rate of loopback rather than of a switch).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "CORE_ONE_WAY_MS",
    "DOWN_MEDIAN_MBPS",
    "LAN",
    "RTT_MEDIAN_MS",
    "UP_MEDIAN_MBPS",
    "Link",
    "home_links",
    "one_way_s",
    "transfer_s",
]

DOWN_MEDIAN_MBPS = 100.0
UP_MEDIAN_MBPS = 20.0
RTT_MEDIAN_MS = 30.0
CORE_ONE_WAY_MS = 20.0
"""One way across the core, between two hosts' ISPs."""

_DOWN_SIGMA = 0.9
_UP_SIGMA = 1.1
_RTT_SIGMA = 0.5
_UP_DOWN_CORRELATION = 0.7
_DOWN_RANGE = (1.0, 1000.0)
_UP_RANGE = (0.5, 1000.0)
_RTT_RANGE_MS = (2.0, 600.0)
# Hosts whose access round trip is below this share one LAN: no core between them.
_LAN_RTT_MS = 1.0


class _WanLink(Protocol):
    @property
    def delay_ms(self) -> float: ...
    @property
    def up_mbit(self) -> float: ...
    @property
    def down_mbit(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Link:
    """One host's access link: rates in Mbit/s, round trip to the core in ms."""

    up_mbps: float
    down_mbps: float
    rtt_ms: float
    """This host's access round trip to the internet core (not to another host)."""

    @classmethod
    def of_wan(cls, spec: _WanLink) -> Link:
        """The link of a WAN emulator host (`testing.wan.LinkSpec`: one-way delay)."""
        return cls(up_mbps=spec.up_mbit, down_mbps=spec.down_mbit, rtt_ms=2 * spec.delay_ms)


LAN = Link(up_mbps=10_000.0, down_mbps=10_000.0, rtt_ms=0.05)
"""127.0.0.1-like, for validation runs against real daemons on one machine: ~25 µs one
way, and a rate nothing in volunteerd comes near."""


def _clip(value: float, bounds: tuple[float, float]) -> float:
    return min(max(value, bounds[0]), bounds[1])


def home_links(count: int, seed: int) -> list[Link]:
    """``count`` home connections drawn from the distribution of the module docstring;
    the same seed draws the same links."""
    if count < 0:
        raise ValueError(f"count must be >= 0, not {count}")
    rng = random.Random(seed)
    across = math.sqrt(1 - _UP_DOWN_CORRELATION**2)
    links = []
    for _ in range(count):
        z_down, z_other, z_rtt = (rng.normalvariate(0.0, 1.0) for _ in range(3))
        z_up = _UP_DOWN_CORRELATION * z_down + across * z_other
        links.append(
            Link(
                up_mbps=_clip(UP_MEDIAN_MBPS * math.exp(_UP_SIGMA * z_up), _UP_RANGE),
                down_mbps=_clip(DOWN_MEDIAN_MBPS * math.exp(_DOWN_SIGMA * z_down), _DOWN_RANGE),
                rtt_ms=_clip(RTT_MEDIAN_MS * math.exp(_RTT_SIGMA * z_rtt), _RTT_RANGE_MS),
            )
        )
    return links


def one_way_s(a: Link, b: Link, *, core_ms: float = CORE_ONE_WAY_MS) -> float:
    """Seconds a small message takes from ``a`` to ``b`` (the same both ways): half of
    each access round trip, plus ``core_ms`` unless both hosts are on one LAN (access
    round trips under 1 ms, as `LAN`). ``core_ms=0`` matches the WAN emulator, whose
    hosts share one core router."""
    core = 0.0 if a.rtt_ms < _LAN_RTT_MS and b.rtt_ms < _LAN_RTT_MS else core_ms
    return ((a.rtt_ms + b.rtt_ms) / 2 + core) / 1000


def transfer_s(a: Link, b: Link, nbytes: int, *, core_ms: float = CORE_ONE_WAY_MS) -> float:
    """Seconds until ``nbytes`` sent by ``a`` have all reached ``b`` on otherwise idle
    links: the one-way latency plus serialisation at the slower of ``a``'s upload and
    ``b``'s download (no TCP slow start, no competing traffic)."""
    rate_bps = min(a.up_mbps, b.down_mbps) * 1e6
    return one_way_s(a, b, core_ms=core_ms) + 8 * nbytes / rate_bps
