"""The swarm's time, as this node reads it: its wall clock plus the offset its peers'
records show, where most of them agree that this computer's clock is wrong.

Signed records carry wall-clock times (``issued_at``, ``expires_at``) and are refused
when issued more than ``dht.max_clock_skew_s`` (30 s) in the future or once expired
(30 s after issue by default). A home PC whose clock is off by minutes or hours (a dead
clock battery, a dual boot that keeps local time in the hardware clock, automatic time
turned off) dropped out of the swarm without a word: every record it signed was refused
by everyone, and it refused theirs as expired or future ones.

Every expert record a node receives (a peer's store, the answer to a find) is a sample
of the sender's clock (not a manifest, whose ``issued_at`` is its owner's publish time,
up to its lifetime old: ``net/dht.py``, ``_Verbs.clock_samples``): ``issued_at`` minus
this node's wall time now. A peer that stores its own records sends them as they are
made; a find's answer holds records up to an announce period old, so a *voter* (the peer
a record came from; on a public network the /24 or /48 it connects from, so that a
thousand identities behind one address are one voter) counts with the newest it sent in
the last ``WINDOW_S``. The offset is taken only where a strict majority of at least
``MIN_AGREEING`` voters agree on it within ``AGREE_S``, and it is more than
``ADJUST_OVER_S`` from this clock (a clock within the records' own tolerance is left
alone: NTP keeps most within a second). Beyond ``MAX_OFFSET_S`` it is not followed, only
reported: a clock days off is for its owner to set. The offset is logged as a warning
whenever it is taken or changes, naming by how much this computer's clock is off. A jump
of the wall clock since the last estimate is seen by ``now()`` itself, which estimates
again at once.

Samples are kept on a clock that counts a suspend (``awake.awake_time``; Linux's
``CLOCK_BOOTTIME``). On ``time.monotonic``, which stops while a laptop sleeps, a night's
sleep of D seconds read as this wall clock jumping D ahead of every voter's sample, and
the first estimate after waking took an offset of -D (records signed D in the past,
refused as expired) until most voters had sent fresh records, about an announce period.

A peer cannot move this node's time alone, or with identities behind one address;
moving it needs most of the voters this node hears from in ``WINDOW_S``, which is an
eclipse of this node (the DHT's caps per address bound that elsewhere).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable

from volunteerd.awake import awake_time

__all__ = [
    "ADJUST_OVER_S",
    "AGREE_S",
    "MAX_OFFSET_S",
    "MIN_AGREEING",
    "WINDOW_S",
    "SwarmClock",
]

logger = logging.getLogger(__name__)

WINDOW_S = 600.0  # a voter's samples count this long (seconds awake or asleep)
AGREE_S = 60.0  # voters whose offsets lie this close agree
ADJUST_OVER_S = 60.0  # an offset at most this large is left to the records' tolerance
MAX_OFFSET_S = 7 * 86400.0  # further off: reported, not followed
MIN_AGREEING = 2  # at least this many voters, and more than half of all, must agree
MAX_VOTERS = 512  # the voters heard from most recently
_ESTIMATE_EVERY_S = 1.0


class SwarmClock:
    """``now()``: wall time plus the offset the swarm's records show (0.0 unless most
    voters agree this clock is off by more than ``ADJUST_OVER_S``)."""

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        ticking: Callable[[], float] = awake_time,
    ) -> None:
        self._wall = wall
        self._ticking = ticking
        self.offset = 0.0
        # the offset most voters agree on now, whether followed or not (None: no majority)
        self.agreed: float | None = None
        # voter -> (ticking time it was last heard, the newest record it sent in the
        # window: its issued_at less the ticking time it came at). On the ticking
        # clock, a voter's freshest record reads the same whatever this wall clock does
        # meanwhile (set by NTP or by hand); the wall clock is compared at each estimate.
        self._voters: dict[str, tuple[float, float]] = {}
        self._estimated_at = -math.inf
        self._reported: float | None = None
        # the wall clock less the ticking one when the offset was last estimated
        self._wall_ahead = wall() - ticking()

    def now(self) -> float:
        """The swarm's time. Where this wall clock jumped since the offset was last
        estimated (set by hand or by NTP, a suspend), the offset is estimated again at
        once from the voters heard (their samples are on the ticking clock): it was
        recomputed only as records came, and a manifest checked in between read the
        jumped time (an outside re-check: a project dropped 26 ms before the next
        record would have corrected the clock)."""
        wall, at = self._wall(), self._ticking()
        if abs(wall - at - self._wall_ahead) > ADJUST_OVER_S and self._voters:
            self._estimated_at = at
            self._estimate(at)
        return wall + self.offset

    def observe(self, voter: str, issued: Iterable[float]) -> None:
        """Records ``voter`` sent just now were issued at ``issued`` (its wall clock)."""
        newest = max((t for t in issued if math.isfinite(t)), default=None)
        if newest is None:
            return
        at = self._ticking()
        sample = newest - at
        held = self._voters.pop(voter, None)
        if held is not None and at - held[0] < WINDOW_S and held[1] > sample:
            # an older record than one it sent before: the newer sample stands, refreshed
            sample = held[1]
        self._voters[voter] = (at, sample)
        while len(self._voters) > MAX_VOTERS:
            del self._voters[next(iter(self._voters))]
        if at - self._estimated_at >= _ESTIMATE_EVERY_S:
            self._estimated_at = at
            self._estimate(at)

    def _estimate(self, at: float) -> None:
        for voter in [v for v, (seen, _) in self._voters.items() if at - seen >= WINDOW_S]:
            del self._voters[voter]
        wall_ahead = self._wall() - at  # the wall clock less the ticking one, now
        self._wall_ahead = wall_ahead
        samples = [sample - wall_ahead for _, sample in self._voters.values()]
        self.agreed = _majority(samples)
        agreed = self.agreed
        if agreed is None or abs(agreed) <= ADJUST_OVER_S:
            offset = 0.0
        elif abs(agreed) > MAX_OFFSET_S:
            offset = self.offset  # not followed: kept as it was
            if self._reported != agreed:
                self._reported = agreed
                logger.error(
                    "this computer's clock is %s the swarm's (%d peers agree): too far "
                    "to follow; set the clock right (automatic time) to take part",
                    _describe(-agreed),
                    len(self._voters),
                )
        else:
            offset = round(agreed, 1)
        if abs(offset - self.offset) >= min(AGREE_S / 2, ADJUST_OVER_S):
            if offset == 0.0:
                logger.warning("this computer's clock now agrees with the swarm's")
            else:
                logger.warning(
                    "this computer's clock is %s the swarm's (%d of %d peers agree): "
                    "records are signed and checked on the swarm's time; set the clock "
                    "right (automatic time) to stop this",
                    _describe(-offset),
                    _agreeing(offset, samples),
                    len(self._voters),
                )
            self.offset = offset
        elif offset == 0.0:
            self.offset = 0.0


def _agreeing(value: float, samples: list[float]) -> int:
    return sum(abs(s - value) <= AGREE_S for s in samples)


def _majority(samples: list[float]) -> float | None:
    """The median of the largest group of samples within ``AGREE_S`` of one of them,
    where it holds more than half of them and at least ``MIN_AGREEING``; else None."""
    best: list[float] = []
    for value in samples:
        group = [s for s in samples if abs(s - value) <= AGREE_S]
        if len(group) > len(best) or (
            len(group) == len(best) and best and abs(value) < abs(statistics.median(best))
        ):
            best = group
    if len(best) < MIN_AGREEING or 2 * len(best) <= len(samples):
        return None
    return statistics.median(best)


def _describe(ahead_s: float) -> str:
    """``ahead_s`` seconds as "2 h 5 min ahead of" / "40 s behind"."""
    size = abs(ahead_s)
    if size >= 86400:
        amount = f"{size / 86400:.1f} days"
    elif size >= 3600:
        amount = f"{int(size // 3600)} h {int(size % 3600 // 60)} min"
    elif size >= 60:
        amount = f"{int(size // 60)} min {int(size % 60)} s"
    else:
        amount = f"{size:.0f} s"
    return f"{amount} {'ahead of' if ahead_s > 0 else 'behind'}"
