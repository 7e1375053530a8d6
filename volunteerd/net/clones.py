"""Copies of one identity: another daemon signing records with this node's key.

A data folder copied to a second computer (or a lab imaging one PC onto twenty) copies
``identity.key``, and every copy serves under the same peer id. Nothing in the swarm
tells them apart: storing peers keep one record per (key, writer), so the copies'
records overwrite each other; a trainer's one connection per peer id reaches whichever
copy it dialled, and its calls for the other copies' experts fail with
``unknown_expert`` (each such expert left out by the trainer for a while); copies
hosting the same expert never average with each other (a node's own records are left
out of its replica lookups), and one that stops withdraws the records of the others.
An outside audit saw all of it, and nothing told the volunteer.

``CloneWatch`` tells them. ``ExpertDHT`` gives it the issue time of every expert record
this process stores (``signed``: all records of an announcement round share one) and
every record under this node's peer id that a lookup or a read-back finds
(``check``). A record under this id that this process never signed, issued after it
started, is another daemon's: logged at WARNING with the other copy's addresses, once
and then at most hourly (``WARN_EVERY_S``), and passed to ``on_clone`` (the daemon's
error events). ``clash()`` is the warning while a copy was seen within that hour (the
control API's ``Status.identity_clash``).

A daemon restarted at another port finds its previous run's records still in the DHT
until they expire: those were issued before this process started, and are not a copy.
Issue times are the signer's swarm clock (``net.swarm_clock``); they are compared on
this process's wall clock with the offset it follows now, and ``margin_s`` (the records'
own tolerance, ``dht.max_clock_skew_s``) more: a previous run that followed an offset
this one has not taken yet signed at most that far ahead of this clock, or its records
would be refused as from the future.

The copies are not stopped: each would stop, and the experts of all of them would be
lost where one warning to the volunteer fixes it (docs/security.md, *Copies of one
identity*).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from volunteerd.bounded import remember
from volunteerd.net.records import ExpertRecord

__all__ = ["WARN_EVERY_S", "CloneWatch"]

logger = logging.getLogger(__name__)

WARN_EVERY_S = 3600.0  # the warning again, while copies are still seen
_MAX_SIGNED = 4096  # announcement rounds whose issue times are remembered


class CloneWatch:
    """Tells when another daemon signs records with this node's identity.

    ``started_at``: this process's start (``wall`` time); ``offset``: the swarm clock's
    offset that records' issue times carry (``SwarmClock.offset``)."""

    def __init__(
        self,
        peer_id: str,
        *,
        started_at: float,
        margin_s: float,
        offset: Callable[[], float] = lambda: 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.peer_id = peer_id
        self._started_at = started_at
        self._margin_s = margin_s
        self._offset = offset
        self._clock = clock
        self._signed: OrderedDict[float, None] = OrderedDict()
        self._warned_at: float | None = None
        self._seen_at: float | None = None  # ``clock`` when a copy's record was last seen
        self._message = ""
        self.on_clone: Callable[[str], object] | None = None

    def signed(self, records: Iterable[ExpertRecord]) -> None:
        """Records this process signed and stores."""
        for record in records:
            if record.issued_at not in self._signed:
                remember(self._signed, record.issued_at, None, _MAX_SIGNED)

    def check(self, records: Iterable[ExpertRecord]) -> None:
        """Records found in the DHT: a copy's among them is told (``_found``)."""
        offset = self._offset()
        others = [
            r
            for r in records
            if r.peer_id == self.peer_id
            and r.issued_at not in self._signed
            and r.issued_at - offset > self._started_at + self._margin_s
        ]
        if others:
            self._found(others)

    def clash(self) -> str | None:
        """The warning while a copy's record was seen within ``WARN_EVERY_S``; None
        otherwise."""
        if self._seen_at is None or self._clock() - self._seen_at > WARN_EVERY_S:
            return None
        return self._message

    def _found(self, records: list[ExpertRecord]) -> None:
        now = self._clock()
        self._seen_at = now
        addrs = sorted({a for r in records for a in r.addrs}) or ["an address it does not say"]
        message = (
            f"another daemon uses this identity (identity.key) at {', '.join(addrs)}: give "
            "each computer its own (stop it, delete identity.key there, start again)"
        )
        self._message = message
        if self._warned_at is not None and now - self._warned_at < WARN_EVERY_S:
            return
        self._warned_at = now
        logger.warning("%s", message)
        if self.on_clone is not None:
            self.on_clone(message)
