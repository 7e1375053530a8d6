"""Forward passes kept for their backward, bounded in bytes and in time.

A trainer that will call backward asks the server to keep the forward's graph; the
reply carries a random handle. The backward names the handle instead of sending the
inputs again. Entries are dropped after ``retain_s``, when the byte budget needs room,
or when used. Room is made from the party that holds the most bytes, its oldest entry
first (a party: the requester's address, as the device's lanes count it): one stranger
keeping forwards it never takes back (9 requests a second, far inside its limits) evicted
every other trainer's, whose backwards then came back ``expired`` (an outside probe: 10
of 11 at 3 s between forward and backward). The budget is taken before a kept forward is computed
(``reserve``), so forwards in flight count too; a forward that does not fit is served
without being kept (counted in ``refused``). A handle that is gone, belongs to another
expert or was issued to another peer is simply unknown, and the trainer falls back to
the stateless backward (sending the inputs).

The reservation is an estimate: the input's bytes times what kept graphs of that expert
were measured to hold per input byte, for inputs of about the same size per sample
(``_size_class``: a sequence of 16 tokens and one of 4,096 are measured apart, so a
stranger's long sequences say nothing about an honest trainer's short ones). Each kept
forward's real size is measured after it ran (``put``): it replaces the reservation and
becomes that size class's estimate (the latest measurement, not the largest ever). So
a forward evicts older entries for what forwards of its size really hold, and its entry
is charged what it really holds.

Each entry also remembers the expert's update count when its forward ran: the backward
that takes it is applied ``updates now - updates then`` optimizer steps later (the
gradient's *staleness* at the expert: the other trainers' and the other batches'
backwards in between). ``StalenessMeter`` counts them per expert: a few integer ops per
backward. A stateless backward recomputes the forward on the current weights; which
weights the trainer's forward saw is unknown there, so those are counted apart.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from volunteerd.experts import Retained

__all__ = [
    "STALENESS_BUCKETS",
    "Kept",
    "RetainedStats",
    "RetainedStore",
    "StalenessMeter",
    "StalenessStats",
]

# The histogram's buckets of staleness (updates between a forward and its backward).
STALENESS_BUCKETS = ("0", "1", "2-3", "4-7", "8+")


@dataclass(slots=True)
class _Entry:
    uid: str
    peer_id: str
    retained: Retained
    expires_at: float
    version: int  # the expert's ``updates`` when the forward ran
    party: str  # whose share of the budget it takes (the address; the peer on loopback)


@dataclass(frozen=True, slots=True)
class Kept:
    """What ``RetainedStore.take`` hands back: the kept forward, and the expert's
    ``updates`` when it ran."""

    retained: Retained
    version: int
    # Where it came from, for ``RetainedStore.give_back``
    handle: str = ""
    uid: str = ""
    peer_id: str = ""
    expires_at: float = math.inf
    party: str = ""


@dataclass(frozen=True, slots=True)
class RetainedStats:
    entries: int
    nbytes: int
    hits: int
    misses: int
    evicted: int
    refused: int = 0  # forwards served without keeping them: no room in the budget


# Until an expert's first kept graph is measured, a kept forward is estimated at this
# many times its input's bytes.
_DEFAULT_RATIO = 8.0


def _size_class(samples: int, input_bytes: int) -> int:
    """Inputs of about the same bytes per sample (within a factor of two) share an
    estimate: a transformer's graph per token may grow with the sequence's length."""
    return (input_bytes // samples).bit_length() if samples > 0 else 0


class RetainedStore:
    def __init__(
        self, budget_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._budget = budget_bytes
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # party -> its entries' handles (in the order of ``_entries``) and their bytes
        self._parties: dict[str, OrderedDict[str, None]] = {}
        self._party_bytes: dict[str, int] = {}
        # Weight snapshots are shared by entries: charged once while any entry holds one.
        self._snapshot_refs: dict[int, int] = {}
        self._nbytes = 0  # kept entries and reservations of forwards in flight
        self._reserved = 0  # of which reservations (which no eviction frees)
        # uid -> size class -> graph bytes per input byte, as last measured (``put``)
        self._ratios: dict[str, dict[int, float]] = {}
        self._hits = self._misses = self._evicted = self._refused = 0

    @property
    def enabled(self) -> bool:
        return self._budget > 0

    def estimate(self, uid: str, samples: int, input_bytes: int) -> int:
        """The bytes a kept forward of ``samples`` rows and ``input_bytes`` of input is
        expected to hold: its input's bytes times what this expert's kept graphs of the
        nearest size class were last measured to hold per input byte (of the larger of
        two equally near; 8 times the input until one is measured)."""
        ratios = self._ratios.get(uid)
        if not ratios:
            return math.ceil(_DEFAULT_RATIO * input_bytes)
        size = _size_class(samples, input_bytes)
        ratio = ratios.get(size)
        if ratio is None:
            ratio = ratios[min(ratios, key=lambda other: (abs(other - size), -other))]
        return math.ceil(ratio * input_bytes)

    def reserve(self, uid: str, samples: int, input_bytes: int) -> int | None:
        """Room for the graph of a forward of ``samples`` rows, taken *before* it is
        computed: concurrent kept forwards must not overshoot the budget while they run.

        The size is ``estimate``d from the graphs of this expert measured so far. Older
        entries are evicted to make room (for that much, no more). Returns the bytes
        reserved (hand them to ``put``, or to ``release`` if the forward fails), or
        None when they cannot fit: then run the forward without keeping it."""
        self.expire()
        estimate = self.estimate(uid, samples, input_bytes)
        if self._reserved + estimate > self._budget:  # evicting every entry would not do
            self._refused += 1
            return None
        while self._nbytes + estimate > self._budget and self._entries:
            self._drop(self._victim())
            self._evicted += 1
        self._nbytes += estimate
        self._reserved += estimate
        return estimate

    def release(self, reserved: int) -> None:
        """Give back a reservation whose forward was not kept."""
        self._nbytes -= reserved
        self._reserved -= reserved

    def put(
        self,
        uid: str,
        peer_id: str,
        retained: Retained,
        reserved: int = 0,
        samples: int = 0,
        version: int = 0,
        input_bytes: int = 0,
        party: str = "",
    ) -> str | None:
        """Keep ``retained`` in place of the ``reserved`` bytes; returns its handle, or
        None if it cannot fit. ``version``: the expert's ``updates`` when the forward
        ran (``take`` returns it). With ``samples`` and ``input_bytes`` (the forward's
        input) its measured size becomes the estimate for inputs of its size class.
        ``party`` (``peer_id`` when empty) is whose share of the budget it is charged to."""
        self.release(reserved)
        if samples > 0 and input_bytes > 0 and not retained.stacked:
            # stacked forwards keep no graph: they say nothing of what a graph holds
            ratios = self._ratios.setdefault(uid, {})
            ratios[_size_class(samples, input_bytes)] = retained.nbytes / input_bytes
        self.expire()
        # Forwards in flight hold their reservations: if it does not fit beside them
        # alone (its snapshot charged), nothing is evicted for it.
        if self._reserved + retained.nbytes + retained.weights.nbytes > self._budget:
            self._refused += 1
            return None
        cost = self._cost_of(retained)
        while self._nbytes + cost > self._budget and self._entries:
            self._drop(self._victim())
            self._evicted += 1
            cost = self._cost_of(retained)  # evictions may have released its snapshot
        handle = secrets.token_hex(16)
        expires_at = self._clock() + self._ttl_s
        self._add(handle, _Entry(uid, peer_id, retained, expires_at, version, party or peer_id))
        return handle

    def peek(self, handle: str, uid: str, peer_id: str) -> Retained | None:
        """The kept forward of ``handle`` if it is alive and was issued to this peer for
        this expert, left in the store: check a backward against it before ``take``.
        A miss is counted when there is none (a hit only when it is taken)."""
        self.expire()
        entry = self._entries.get(handle)
        if entry is None or entry.uid != uid or entry.peer_id != peer_id:
            self._misses += 1
            return None
        return entry.retained

    def take(self, handle: str, uid: str, peer_id: str) -> Kept | None:
        """The entry for ``handle`` if it is alive and was issued to this peer for this
        expert (and then removed); otherwise None, and the entry stays for its owner."""
        self.expire()
        entry = self._entries.get(handle)
        if entry is None or entry.uid != uid or entry.peer_id != peer_id:
            self._misses += 1
            return None
        self._drop(handle)
        self._hits += 1
        return Kept(
            entry.retained,
            entry.version,
            handle,
            entry.uid,
            entry.peer_id,
            entry.expires_at,
            entry.party,
        )

    def give_back(self, kept: Kept) -> bool:
        """Keep again, under its handle and until its old expiry, an entry that ``take``
        handed out and that was not used (its backward was refused before it ran): the
        trainer may retry. Only into free room (nothing is evicted for it) and while it
        has not expired; returns whether it is kept."""
        self.expire()
        if kept.retained.consumed or not kept.handle or kept.handle in self._entries:
            return False
        cost = self._cost_of(kept.retained)
        if kept.expires_at <= self._clock() or self._nbytes + cost > self._budget:
            self._evicted += 1  # gone as if it had stayed and expired or been evicted
            return False
        entry = _Entry(
            kept.uid,
            kept.peer_id,
            kept.retained,
            kept.expires_at,
            kept.version,
            kept.party or kept.peer_id,
        )
        self._add(kept.handle, entry)
        # in the order of expiry, which ``expire`` relies on (and a party's eviction)
        for later in [h for h, e in self._entries.items() if e.expires_at > kept.expires_at]:
            self._entries.move_to_end(later)
            self._parties[self._entries[later].party].move_to_end(later)
        self._hits -= 1  # taken, but not used
        return True

    def clear(self) -> None:
        for handle in list(self._entries):
            self._drop(handle)

    def statistics(self) -> RetainedStats:
        return RetainedStats(
            len(self._entries),
            self._nbytes,
            self._hits,
            self._misses,
            self._evicted,
            self._refused,
        )

    def _cost_of(self, retained: Retained) -> int:
        snapshot = 0 if id(retained.weights) in self._snapshot_refs else retained.weights.nbytes
        return retained.nbytes + snapshot

    def _charge(self, retained: Retained, sign: int) -> None:
        key = id(retained.weights)
        refs = self._snapshot_refs.get(key, 0)
        if sign > 0:
            self._nbytes += retained.nbytes + (retained.weights.nbytes if refs == 0 else 0)
            self._snapshot_refs[key] = refs + 1
        else:
            self._nbytes -= retained.nbytes + (retained.weights.nbytes if refs == 1 else 0)
            if refs == 1:
                del self._snapshot_refs[key]
            else:
                self._snapshot_refs[key] = refs - 1

    def _add(self, handle: str, entry: _Entry) -> None:
        self._entries[handle] = entry
        self._parties.setdefault(entry.party, OrderedDict())[handle] = None
        self._party_bytes[entry.party] = self._party_bytes.get(entry.party, 0) + (
            entry.retained.nbytes
        )
        self._charge(entry.retained, +1)

    def _drop(self, handle: str) -> None:
        entry = self._entries.pop(handle)
        handles = self._parties[entry.party]
        del handles[handle]
        if handles:
            self._party_bytes[entry.party] -= entry.retained.nbytes
        else:
            del self._parties[entry.party], self._party_bytes[entry.party]
        self._charge(entry.retained, -1)

    def _victim(self) -> str:
        """The entry to evict for room: the oldest of the party holding the most bytes
        (of the parties holding as much, the one whose oldest entry is oldest)."""
        most = max(self._party_bytes.values())
        oldest = [next(iter(h)) for p, h in self._parties.items() if self._party_bytes[p] == most]
        return min(oldest, key=lambda handle: self._entries[handle].expires_at)

    def expire(self) -> None:
        """Drop entries older than ``retain_s`` (also called once a second by the
        runtime, so an idle server gives their memory back)."""
        now = self._clock()
        while self._entries:
            handle, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                return
            self._drop(handle)
            self._evicted += 1


@dataclass(frozen=True, slots=True)
class StalenessStats:
    """Staleness at one expert (or summed over several): over the backwards through
    kept forwards, how many optimizer updates the expert took between the forward and
    the backward. ``histogram`` counts them by ``STALENESS_BUCKETS``; ``stateless``
    counts the stateless backwards (staleness unknown, not in the others)."""

    count: int = 0
    total: int = 0  # sum of the staleness of the ``count`` backwards
    max: int = 0
    histogram: tuple[int, ...] = (0,) * len(STALENESS_BUCKETS)
    stateless: int = 0

    @property
    def mean(self) -> float | None:
        """None before the first backward through a kept forward."""
        return self.total / self.count if self.count else None

    @property
    def by_bucket(self) -> dict[str, int]:
        """The histogram keyed by ``STALENESS_BUCKETS`` ("0", "1", "2-3", "4-7", "8+")."""
        return dict(zip(STALENESS_BUCKETS, self.histogram, strict=True))

    def __add__(self, other: StalenessStats) -> StalenessStats:
        return StalenessStats(
            self.count + other.count,
            self.total + other.total,
            max(self.max, other.max),
            tuple(a + b for a, b in zip(self.histogram, other.histogram, strict=True)),
            self.stateless + other.stateless,
        )


class StalenessMeter:
    """Counts one expert's staleness. ``record`` runs on the device's worker as each
    backward runs; ``statistics`` may read from another thread (a snapshot that may be
    one backward behind)."""

    __slots__ = ("_count", "_histogram", "_max", "_stateless", "_total")

    def __init__(self) -> None:
        self._count = self._total = self._max = self._stateless = 0
        self._histogram = [0] * len(STALENESS_BUCKETS)

    def record(self, staleness: int) -> None:
        """One backward through a kept forward, ``staleness`` updates after it (a
        negative one, after a restore from an older checkpoint, counts as 0)."""
        staleness = max(0, staleness)
        self._count += 1
        self._total += staleness
        if staleness > self._max:
            self._max = staleness
        # 0 -> 0, 1 -> 1, 2..3 -> 2, 4..7 -> 3, 8+ -> 4
        self._histogram[min(staleness.bit_length(), len(STALENESS_BUCKETS) - 1)] += 1

    def record_stateless(self, backwards: int = 1) -> None:
        self._stateless += backwards

    def statistics(self) -> StalenessStats:
        return StalenessStats(
            self._count, self._total, self._max, tuple(self._histogram), self._stateless
        )
