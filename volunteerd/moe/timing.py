"""How long to wait for experts: timeouts and the k_min grace from measured round trips.

Configured timeouts fit the machine they were tried on (127.0.0.1, a round trip of
microseconds). Over the internet a call costs the link's round trip, the transfer of
its tensors and the server's queue, and that differs by peer. ``RoundTrips`` keeps, per
peer and verb, a smoothed duration of the calls it answered and how much they vary
(RFC 6298's SRTT and RTTVAR: ``srtt += (d - srtt) / 8``, ``rttvar += (|d - srtt| -
rttvar) / 4``), and derives a round's limits from the peers it calls:

* ``expected`` = max over the round's peers of ``srtt + 4 * rttvar`` — how long a healthy
  one of them may take — but at most ``STRAGGLER_FACTOR`` times the median peer's (the
  lower median: of two, the faster): a peer far slower than the others does not stretch
  the round's waits to its own pace (one 1 Mbit/s uplink among 50 Mbit/s ones stretched
  every round's grace to its 2 s cap, and the timeout to 20 s);
* ``timeout_s`` = min(``CAP_FACTOR * floor``, max(floor, ``TIMEOUT_FACTOR * expected``)),
  and never over ``REPLY_WINDOW_S`` (60 s), past which servers send no reply;
* ``grace_s`` = min(``CAP_FACTOR * floor``, max(floor, expected - fastest)), where
  ``fastest`` is the smallest ``srtt`` of the round's peers: the k_min answers come from
  the fast ones, and the grace lets a healthy slower one answer after them.

The floors are the configured ``forward_timeout_s``/``backward_timeout_s`` and
``grace_after_k_min_s``: measuring never shortens a wait below what the experiment asked
for (a loaded machine's hiccup must not turn into timeouts and bans), and the cap keeps
one pathological peer from stalling every step. Peers never measured add nothing; a
round of only such peers waits the floors.

Rows whose only experts sit on a peer far slower than the others do not wait for it
either: ``moe/dispatch.py`` ends the round ``STRAGGLER_FACTOR`` times the median
request's time after its start (measured in that round, not estimated), and the peer's
call is late.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from volunteerd.bounded import remember

__all__ = [
    "CAP_FACTOR",
    "REMEMBERED",
    "REPLY_WINDOW_S",
    "STRAGGLER_FACTOR",
    "TIMEOUT_FACTOR",
    "Limits",
    "RoundTrips",
]

TIMEOUT_FACTOR = 3.0
CAP_FACTOR = 4.0
# A server drops a reply still going out this long after its request began (the
# daemon's default ``timeouts.request_s``; net/rpc.py): waiting longer gets nothing, so
# no timeout is stretched past it and a trainer may not ask for more.
REPLY_WINDOW_S = 60.0
# How many times the round's median a peer may take and still be waited for. A peer
# 1.5x or 2x slower than the others is (and stays in use); one 5x slower (a 1 Mbit/s
# uplink among 50 Mbit/s ones) is not.
STRAGGLER_FACTOR = 3.0
_GAIN = 1 / 8  # RFC 6298's alpha
_VAR_GAIN = 1 / 4  # RFC 6298's beta
# (peer, key) pairs remembered, the least recently measured forgotten first: a trainer
# meets thousands of peers over weeks of churn, and a forgotten one waits the floors.
REMEMBERED = 8192


@dataclass(frozen=True, slots=True)
class Limits:
    """What one round waits: at most ``timeout_s``, and ``grace_s`` after k_min answers."""

    timeout_s: float
    grace_s: float


@dataclass(slots=True)
class _Estimate:
    srtt: float
    rttvar: float

    @property
    def expected(self) -> float:
        return self.srtt + 4 * self.rttvar


class RoundTrips:
    """Per-(peer, key) call durations, smoothed (the ``REMEMBERED`` most recently
    measured). Used from one thread (the network loop) or with lost updates being
    harmless: it is an estimate."""

    def __init__(self) -> None:
        self._estimates: OrderedDict[tuple[str, str], _Estimate] = OrderedDict()

    def __len__(self) -> int:
        return len(self._estimates)

    def observe(self, peer_id: str, key: str, seconds: float) -> None:
        """An answered call to ``peer_id`` took ``seconds``."""
        estimate = self._estimates.get((peer_id, key))
        if estimate is None:
            remember(self._estimates, (peer_id, key), _Estimate(seconds, seconds / 2), REMEMBERED)
            return
        self._estimates.move_to_end((peer_id, key))
        estimate.rttvar += _VAR_GAIN * (abs(seconds - estimate.srtt) - estimate.rttvar)
        estimate.srtt += _GAIN * (seconds - estimate.srtt)

    def srtt(self, peer_id: str, key: str) -> float | None:
        estimate = self._estimates.get((peer_id, key))
        return None if estimate is None else estimate.srtt

    def limits(
        self, peer_ids: Iterable[str], key: str, timeout_floor_s: float, grace_floor_s: float
    ) -> Limits:
        """A round's limits for calls to ``peer_ids`` (module docstring)."""
        known = [e for p in set(peer_ids) if (e := self._estimates.get((p, key))) is not None]
        if not known:
            return Limits(timeout_floor_s, grace_floor_s)
        median = sorted(e.expected for e in known)[(len(known) - 1) // 2]
        expected = min(max(e.expected for e in known), STRAGGLER_FACTOR * median)
        fastest = min(e.srtt for e in known)
        stretched = max(timeout_floor_s, TIMEOUT_FACTOR * expected)
        timeout_s = min(CAP_FACTOR * timeout_floor_s, stretched, REPLY_WINDOW_S)
        grace_s = min(CAP_FACTOR * grace_floor_s, max(grace_floor_s, expected - fastest))
        return Limits(timeout_s, grace_s)
