"""Forward passes kept for their backward, bounded in bytes and in time.

A trainer that will call backward asks the server to keep the forward's graph; the
reply carries a random handle. The backward names the handle instead of sending the
inputs again. Entries are dropped after ``retain_s``, when the byte budget needs room
(oldest first), or when used. The budget is taken before a kept forward is computed
(``reserve``), so forwards in flight count too; a forward that does not fit is served
without being kept. A handle that is gone, belongs to another expert or was
issued to another peer is simply unknown, and the trainer falls back to the stateless
backward (sending the inputs).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from volunteerd.experts import Retained

__all__ = ["RetainedStats", "RetainedStore"]


@dataclass(slots=True)
class _Entry:
    uid: str
    peer_id: str
    retained: Retained
    expires_at: float


@dataclass(frozen=True, slots=True)
class RetainedStats:
    entries: int
    nbytes: int
    hits: int
    misses: int
    evicted: int
    refused: int = 0  # forwards served without keeping them: no room in the budget


class RetainedStore:
    def __init__(
        self, budget_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._budget = budget_bytes
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # Weight snapshots are shared by entries: charged once while any entry holds one.
        self._snapshot_refs: dict[int, int] = {}
        self._nbytes = 0  # kept entries and reservations of forwards in flight
        self._per_row: dict[str, int] = {}  # uid -> largest graph bytes per row seen
        self._hits = self._misses = self._evicted = self._refused = 0

    @property
    def enabled(self) -> bool:
        return self._budget > 0

    def reserve(self, uid: str, samples: int, input_bytes: int) -> int | None:
        """Room for the graph of a forward of ``samples`` rows, taken *before* it is
        computed: concurrent kept forwards must not overshoot the budget while they run.

        The size is this expert's largest graph per row seen so far (8 times the input
        until one is seen). Older entries are evicted to make room. Returns the bytes
        reserved (hand them to ``put``, or to ``release`` if the forward fails), or
        None when they cannot fit: then run the forward without keeping it."""
        self.expire()
        per_row = self._per_row.get(uid)
        estimate = samples * per_row if per_row is not None else 8 * input_bytes
        if estimate > self._budget:
            return None
        while self._nbytes + estimate > self._budget and self._entries:
            self._drop(next(iter(self._entries)))
            self._evicted += 1
        if self._nbytes + estimate > self._budget:  # other reservations fill it
            self._refused += 1
            return None
        self._nbytes += estimate
        return estimate

    def release(self, reserved: int) -> None:
        """Give back a reservation whose forward was not kept."""
        self._nbytes -= reserved

    def put(
        self, uid: str, peer_id: str, retained: Retained, reserved: int = 0, samples: int = 0
    ) -> str | None:
        """Keep ``retained`` in place of the ``reserved`` bytes; returns its handle, or
        None if it cannot fit."""
        self._nbytes -= reserved
        if samples:
            per_row = -(-retained.nbytes // samples)
            self._per_row[uid] = max(per_row, self._per_row.get(uid, 0))
        self.expire()
        cost = self._cost_of(retained)
        if cost > self._budget:
            return None
        while self._nbytes + cost > self._budget and self._entries:
            self._drop(next(iter(self._entries)))
            self._evicted += 1
        cost = self._cost_of(retained)  # evictions may have released its snapshot
        if self._nbytes + cost > self._budget:  # forwards in flight hold the rest
            self._refused += 1
            return None
        handle = secrets.token_hex(16)
        self._entries[handle] = _Entry(uid, peer_id, retained, self._clock() + self._ttl_s)
        self._charge(retained, +1)
        return handle

    def take(self, handle: str, uid: str, peer_id: str) -> Retained | None:
        """The entry for ``handle`` if it is alive and was issued to this peer for this
        expert (and then removed); otherwise None, and the entry stays for its owner."""
        self.expire()
        entry = self._entries.get(handle)
        if entry is None or entry.uid != uid or entry.peer_id != peer_id:
            self._misses += 1
            return None
        self._drop(handle)
        self._hits += 1
        return entry.retained

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

    def _drop(self, handle: str) -> None:
        entry = self._entries.pop(handle)
        self._charge(entry.retained, -1)

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
