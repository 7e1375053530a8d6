"""The share of a transfer quota that bulk replies (``params``, ``shard``) may use.

Every byte the throttle counts goes into the volunteer's daily and monthly transfer
quotas (``net.throttle``), and serving stops once one is used up (``server.pausing``).
A ``params`` or ``shard`` request is a few bytes; its reply is a whole expert (or a
4 MiB chunk of its state), and anyone may ask. In an outside probe one fresh identity,
within every per-peer limit, sent 16 ``params`` requests of about 100 bytes to a
volunteer with a 0.5 GB daily quota and hidden-1024 experts (a reply is ~32 MiB): they
were answered in 2.7 s, and the volunteer stopped serving until midnight.

So while a quota is set, bulk replies get a budget per day (local time, the day the
throttle's ledger counts), from the day's allowance: the daily quota, or a thirtieth of
the monthly quota (the smaller when both are set):

* all bulk replies together, at most ``BULK_SHARE`` (half) of it, so that serving
  expert calls, the volunteer's contribution, always keeps the rest; over it, ``busy``;
* one party (``Request.address``, which the identities of one machine share; a caller
  with no address, over a relay or on loopback, by its peer id), at most the largest of
  ``PARTY_SHARE`` (5 %) of it, ``JOIN_EXPERTS`` (8) whole transfers (a ``params``
  reply, a shard's whole snapshot) but no more than ``PARTY_MOST`` (a quarter) of the
  bulk half, and one whole transfer, so that a joiner can download the experts it joins
  with and a replica can average; over it, ``rate_limited``. The share was the larger
  of 5 % and one whole transfer: at a 0.1 GB daily quota, 5 MB, two experts of 2.1 MB,
  and all 8 joiners of an outside audit, each choosing 6 experts (12.6 MB), were
  refused and seeded the rest from initial weights. Now 12.5 MB there (a quarter of
  the 50 MB half; 8 such experts would be 16.8 MB), 25 MB at 0.2 GB: one address still
  takes at most a quarter of what bulk replies may use in a day.

This daemon's own bulk fetches, the replica averager's ``params`` requests to other
replicas (``fetch``), go against the same half: what they receive counts in the quota
as what is sent does. In an outside audit a seed of 32 experts, once joiners hosted
replicas, received 164 MB in ~70 s of averaging under a 0.2 GB daily quota and stopped
serving until midnight. Now its fetches take at most ``AVERAGING_SHARE`` (half) of the
bulk half, so that joiners downloading from this daemon keep the rest of it, and a
fetch that does not fit is skipped (logged once a day); serving keeps its half always.

Both codes tell an honest peer to try later, and until when (``retry_after_s``: the
seconds to the end of the ledger's day, ``TransferLedger.seconds_left_today``): the
shard download does not retry what lasts longer than its backoff, the replica averager
backs off from the peer, and a joiner asks this daemon nothing more until then, filling
its room with experts other replicas hold (``swarm.joiner``); the experts only this
daemon holds wait, not seeded. Before, joiners asked again every few minutes, their
choice taking the experts only the spent seed held: in an outside re-check 8 joiners
held 2-5 of their 6 experts for ~30 min, then seeded the rest.

A reply is counted at its real size once the handler has built it (before that, a
party or the whole already over its budget is refused without building one), and what
of it is not written after all (refused for memory, its caller gone, a slow reader,
the stream reset: ``net.rpc.Reply.unsent``) is given back. Before,
a reply counted whole as soon as it was built: in an outside audit two joiners that had
got no expert from a seed were refused for having used their share, and the bulk half
was used up with ~40 MB of it sent. Without a quota nothing is counted or refused.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from volunteerd.errors import Busy, RateLimited
from volunteerd.net.throttle import Throttle

__all__ = [
    "AVERAGING_SHARE",
    "BULK_SHARE",
    "DAYS_PER_MONTH",
    "JOIN_EXPERTS",
    "PARTY_MOST",
    "PARTY_SHARE",
    "TransferBudget",
]

logger = logging.getLogger(__name__)

BULK_SHARE = 0.5  # of the day's allowance, for all bulk replies together
PARTY_SHARE = 0.05  # of the day's allowance, for one party at least...
JOIN_EXPERTS = 8  # ...or this many whole transfers (a joiner's experts)...
PARTY_MOST = 0.25  # ...but no more than this of the bulk half (or one whole transfer)
AVERAGING_SHARE = 0.5  # of the bulk half, for this daemon's own averaging fetches
DAYS_PER_MONTH = 30  # a monthly quota's day allowance is this fraction of it
# Parties counted today; the least recently served are forgotten beyond (their bytes
# stay in the day's total, which bounds what forgetting can give away).
MAX_PARTIES = 4096


class TransferBudget:
    """Bulk replies' share of ``throttle``'s quotas (see the module docstring)."""

    def __init__(self, throttle: Throttle) -> None:
        self._throttle = throttle
        self._day: tuple[str, int] = ("", -1)  # the ledger day counted: date, days begun
        self._total = 0  # bulk bytes today
        self._parties: OrderedDict[str, int] = OrderedDict()  # party -> bulk bytes today
        self._largest = 0  # the largest whole transfer seen (a refusal's estimate)
        self._told = False  # whether today's "bulk share used" was logged
        self._fetched = 0  # bytes of this daemon's own fetches today (in ``_total`` too)
        self._told_fetch = False  # whether today's "fetches skipped" was logged

    def _allowance(self) -> int:
        """Today's allowance in bytes (0: no quota)."""
        throttle = self._throttle
        quotas = [throttle.daily_quota_bytes] if throttle.daily_quota_bytes > 0 else []
        if throttle.quota_bytes > 0:
            quotas.append(throttle.quota_bytes // DAYS_PER_MONTH)
        if not quotas:
            return 0
        ledger = throttle.ledger
        _ = ledger.today  # turns the ledger's day over if it has ended
        # (a day ended early by a change of time zone westward has the next one's date)
        if (ledger.day, ledger.days_begun) != self._day:
            self._day, self._total, self._told = (ledger.day, ledger.days_begun), 0, False
            self._fetched, self._told_fetch = 0, False
            self._parties.clear()
        return max(1, min(quotas))

    def check(self, party: str) -> None:
        """Refuse, before its reply is built, a party or the whole already over budget.
        Raises RateLimited or Busy."""
        allowance = self._allowance()
        if allowance:
            self._refuse(party, allowance, 0, self._largest)

    def take(self, party: str, size: int, whole: int) -> None:
        """Count a reply of ``size`` bytes to ``party``, part of a transfer of ``whole``
        bytes (a shard's snapshot; a ``params`` reply is its own whole), or refuse it.
        Raises RateLimited or Busy."""
        allowance = self._allowance()
        if not allowance:
            return
        self._largest = max(self._largest, whole)
        self._refuse(party, allowance, size, whole)
        self._total += size
        self._parties[party] = self._parties.get(party, 0) + size
        self._parties.move_to_end(party)
        while len(self._parties) > MAX_PARTIES:
            self._parties.popitem(last=False)

    def fetch(self, size: int) -> bool:
        """Count ``size`` bytes this daemon is about to receive for its own bulk transfer
        (a replica's parameters, the request's and reply header's bytes included), or
        return False, counting nothing, when they do not fit (``can_fetch``)."""
        if not self.can_fetch(size):
            return False
        if self._allowance():
            self._total += size
            self._fetched += size
        return True

    def can_fetch(self, size: int) -> bool:
        """Whether ``size`` bytes of this daemon's own fetches fit today: in the bulk
        half, and in ``AVERAGING_SHARE`` of it. Always True without a quota."""
        allowance = self._allowance()
        if not allowance:
            return True
        bulk = int(allowance * BULK_SHARE)
        most = int(bulk * AVERAGING_SHARE)
        if self._total + size > bulk or self._fetched + size > most:
            if not self._told_fetch:
                self._told_fetch = True
                logger.warning(
                    "replica averaging skipped until midnight: bulk transfers used their "
                    "share of the day's transfer quota (%d of %d bytes; averaging %d of "
                    "its %d); serving keeps the rest",
                    self._total,
                    bulk,
                    self._fetched,
                    most,
                )
            return False
        return True

    def unfetched(self, size: int) -> None:
        """Uncount ``size`` bytes of a ``fetch`` that did not come (a refusal, an
        unreachable peer)."""
        if size <= 0 or not self._allowance():
            return
        self._total = max(0, self._total - size)
        self._fetched = max(0, self._fetched - size)

    def give_back(self, party: str, size: int) -> None:
        """Uncount ``size`` bytes of a reply to ``party`` that were not sent after all
        (refused once built, or its write ended early: the caller gone, the stream
        reset). A reply cut at midnight gives back from the new day's count, never below
        nothing."""
        if size <= 0 or not self._allowance():
            return
        self._total = max(0, self._total - size)
        if party in self._parties:
            self._parties[party] = max(0, self._parties[party] - size)

    def _refuse(self, party: str, allowance: int, size: int, whole: int) -> None:
        bulk = int(allowance * BULK_SHARE)
        if self._total + size > bulk or (size == 0 and self._total >= bulk):
            if not self._told:
                self._told = True
                logger.info(
                    "bulk transfers (params, shard) refused until midnight: they used "
                    "their %d bytes of the day's transfer quota; serving keeps the rest",
                    bulk,
                )
            raise Busy(
                f"bulk transfers have used their share of this volunteer's transfer "
                f"quota today ({bulk} bytes); try again tomorrow",
                retry_after_s=self._throttle.ledger.seconds_left_today(),
            )
        share = max(
            int(allowance * PARTY_SHARE),
            min(JOIN_EXPERTS * whole, int(bulk * PARTY_MOST)),
            whole,
        )
        used = self._parties.get(party, 0)
        if used + size > share or (size == 0 and used >= share):
            raise RateLimited(
                f"bulk transfers to your address have used their share of this "
                f"volunteer's transfer quota today ({share} bytes); try again tomorrow",
                retry_after_s=self._throttle.ledger.seconds_left_today(),
            )
