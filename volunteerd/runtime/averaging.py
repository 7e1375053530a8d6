"""Replica averaging: daemons hosting the same expert pull their weights together.

Every ``average_every_s`` (jittered ±20%, so replicas do not all ask at once) the
averager asks the swarm which other daemons host each of its uids (``replicas_of``:
batched DHT lookups), and for each uid that has replicas fetches their parameters (the
``params`` verb), drops replies that do not fit (larger than its own parameters, refused
from their prefix before the rest is read; wrong uid, names, dtypes or shapes,
non-finite values) and combines the rest with *centered clipping* around its own
weights, tensor by tensor::

    new = own + 1/n * sum_i clip(w_i - own, tau)      n = replicas averaged, self included
    clip(v, tau) = v * min(1, tau / |v|)              tau = clip_ratio * max(|own|, 0.01*sqrt numel)

(``experts.clipping.centered_clip``: the one implementation, which trainers use too.)

Replicas that trained on similar data are within tau of each other and are averaged
exactly; a replica that is far away (broken, or malicious: weights x1e3, noise) pulls
each tensor by at most tau/n per round. The whole move is at most tau*(n-1)/n. The new
weights are written in the device worker's turn, copy-on-write, as an optimizer step
is (``ExpertBackend.set_parameters``).

Which replicas a round asks: anyone can announce a uid under fresh identities, so the
DHT's list may be mostly peers that do not exist or send junk. The averager remembers
who answered: up to ``max_peers`` are asked each round, replicas whose parameters were
used before first (a random choice of them, keeping one place for a peer not asked yet
while there is one), then new peers in the order the DHT lists them (storing nodes list
the writers present longest first), peers never asked before those coming back from a
backoff. A peer whose fetch failed or whose reply was
refused is not asked again for a while, twice as long after each failure in a row
(``average_every_s`` doubled up to an hour). So fake records cost a round at most its
``max_peers`` calls, each fake is tried once per backoff, and an honest replica found
once keeps being averaged with however many fakes are listed. A replica that refuses
saying until when (``retry_after_s``: its transfer quota, or its bulk replies' share of
it, used up) is not asked until then, a day at most and a failure's backoff at least, and
stays a good replica: logged once ("quota used up until 14:05"), not dropped as
unreachable every backoff. Such a claim is believed twice in a row (``_SPENT_CLAIMS``),
then counts as a failure, and a peer that made one sorts after never-asked ones. What is
remembered, and the per-peer counters, are bounded (``_MAX_REMEMBERED`` peers each).

How long a round takes: a replica must send its parameters within ``FIRST_REPLY_S``
(5 s, as trainers' fetches must begin within) plus their size at ``MIN_REPLY_RATE``
(256 kbit/s), the fetch bound, and backs off as a failure if not: "timeout" when no
reply began, "too_slow" when one was arriving (a WARNING, once per expert, names the
size and the rate it came at). The bound is the RPC call's own deadline
(``ReplicaSource.fetch``'s ``timeout_s``; the reply must still begin within
``request_s``), and the server keeps such a reply going as long: cut at ``request_s``
whatever its size, an expert of 33.5 MB over a 2 Mbit/s uplink (134 s) was never
averaged, its replicas dropped as "unreachable" every round after sending ~60 MB each (an
outside audit). The hosted experts with replicas
are gathered concurrently (``CONCURRENT_EXPERTS``, fewer when their replies would hold
more than ``GATHER_BUDGET_BYTES`` together), those averaged longest ago first; experts
without replicas take none of the round's time. A round ends after ``average_every_s``
or one lookup and the largest expert's fetch bound, whichever is longer: a fetch still
running then is cut without counting against its peer, replies already checked are
still averaged, and experts not begun wait for the next round, first in line. A record
whose address accepts and never answers used to hold each expert for all of
``request_s`` in turn: with a fresh such identity per expert, a round of four experts
took 240 s; now about the fetch bound of the slowest expert. And a lookup per expert,
experts with no replica included, ran every round of two daemons of 512 experts each
out of time (the first after 17 experts; an outside audit): a round looks up all its
uids at once now.

After a freeze: a daemon that did not run for ``FROZEN_S`` or more (a laptop's suspend,
SIGSTOP: a 1 s sleep that took that long on the clock that counts suspended time) wakes
with weights that many seconds behind its replicas, which kept training; served at once,
trainers' spot checks see the replicas disagree and may ban the up-to-date one. So the
experts whose last lookup listed replicas are held back (``stale``; ``on_stale`` hears of
each change: the daemon refuses their calls with ``paused`` and withdraws their records)
until they are averaged with at least one replica, this daemon's own stale weights left
out of the mean (``catch_up``), in rounds ``_CATCH_UP_ROUND_S`` apart with the same
replicas until a round moved every tensor by less than tau: one round moves it by tau at
most, and a checkpoint x1.5 off its replica, released after one, served weights 27 %
off (a re-check). So one hostile replica, the only one answering, pulls a held expert by
tau a round for ``CATCH_UP_S``. One whose lookup now lists no replica serves at once;
while network use is not allowed (the lookup raises ``Paused``) held experts stay held,
and ``CATCH_UP_S`` counts from when it is; after it every expert serves again, caught
up or not.

And at start: a daemon whose PC was off overnight, or started from a backup put back,
loads checkpoints hours behind its replicas, and served them from its first second (an
outside audit: outputs 35-40 % off the other replica's, 5 % still after 16 s). The
daemon passes each expert loaded from a checkpoint (at start, or taken by a joiner from
its own) to ``hold_restored`` with when the checkpoint held its weights
(``Checkpointer.take_restored``); one ``FROZEN_S`` old or more is held back at once,
before it is announced, then looked up (no lookup has run yet at start): one whose
lookup lists no replica serves again as soon as it answers, the others are caught up as
after a freeze (``catch_up_restored``). A restart in place holds nothing back: its
checkpoints are seconds old, or held the weights until the graceful stop.

Under a transfer quota: every fetch's bytes (what a replica sends, and a little for the
request and the reply's header: ``FETCH_FRAME_BYTES``) are asked of ``budget``
(``server.transfers.TransferBudget``, the one the daemon's bulk replies use) before it
starts, and given back if it fails before a reply came (of a reply cut as too slow,
what did not arrive); a fetch that does not fit is
skipped, and a round when not even its smallest expert's fetch fits (counted in
``AveragingStats.skipped_for_quota``; the budget logs it once a day). Before, nothing
bounded them: an outside audit's seed of 32 experts received 164 MB in ~70 s of
averaging with the joiners that hosted replicas, used up its 0.2 GB daily quota and
stopped serving until midnight.

When idle: replicas that agree and that nobody trains sent each other every expert
whole every round (134 MB each way per 30 s for 4 experts of hidden 1024 with one
replica each, ~16 GB an hour; the rounds wrote nothing). A round that combined an
expert with its replicas and moved nothing remembers so (``_agreed``); while its own
weights stay that version, the next rounds ask those replicas ``unless_version`` their
last reply's version, and one still at it answers "unchanged", without tensors: it is
combined as these weights (it agreed with them), and a round of only such answers
writes nothing and fetched ~200 bytes an expert (``gather``).

The network is behind ``ReplicaSource`` (the daemon gives the DHT and the RPC client),
so this module needs no libp2p and its tests can fake the swarm.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import trio

from volunteerd.awake import awake_time
from volunteerd.bounded import remember
from volunteerd.config import ReplicasConfig
from volunteerd.errors import (
    FrameTooLarge,
    Paused,
    RemoteError,
    ReplyTooSlow,
    RequestTimeout,
    VolunteerdError,
)
from volunteerd.experts import ExpertBackend, from_wire
from volunteerd.experts.clipping import Params, centered_clip, clip_bound
from volunteerd.runtime.service import ExpertRuntime
from volunteerd.shown import clock_time, span
from volunteerd.wire import WireTensor
from volunteerd.wire.messages import ParamsReply

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = [
    "AveragingStats",
    "FetchBudget",
    "ReplicaAverager",
    "ReplicaSource",
    "centered_clip",
]

logger = logging.getLogger(__name__)

_MAX_REMEMBERED = 4096  # peers remembered as good, as failed, and in each per-peer counter
_MAX_BACKOFF_S = 3600.0  # the longest a failed peer goes unasked
# A replica that refuses saying until when (``retry_after_s``: its transfer quota, or
# its bulk replies' share of it, used up until the quota's day or month ends) is not
# asked until then, a stranger's claim held to a day at most, and said so once: it was
# logged "dropped (unreachable): busy: ..." and asked again after every backoff. The
# codes such a refusal comes with (as the joiner's ``_LATER_CODES``).
_SPENT_CODES = frozenset({"busy", "rate_limited", "paused"})
_SPENT_MOST_S = 86400.0
# Such a claim holds a peer off for the backoff a failure would get at least, and is
# believed _SPENT_CLAIMS times in a row (until it gives parameters again, as the joiner's
# ``_SPENT_CLAIMS``): after that a refusal is a failure. Believed for any time, with no
# failure counted, 8 fake replicas refusing "busy" for 1 s were never-asked peers each
# round, listed before an honest newcomer, and took all 8 places: it was averaged in 0 of
# 24 rounds, and the claims were logged 192 times (a re-check).
_SPENT_CLAIMS = 2
# A replica must begin to answer within this (trainers' ``FIRST_REPLY_S``)...
FIRST_REPLY_S = 5.0
# ...and send its parameters at this rate at least (bytes a second: 256 kbit/s, below
# what a volunteer who throttled their upload hard still sends). The averager sees a
# fetch only whole (``ReplicaSource.fetch``), so the two make one bound, which the
# source is given (``timeout_s``); the RPC client and server keep a bulk reply going
# as long (``net.rpc.BULK_MIN_RATE``, the same rate).
MIN_REPLY_RATE = 32 << 10
# How much longer than the fetch bound the averager waits for the source to keep it
# itself (its cut says how much had arrived: a ``ReplyTooSlow``), before cutting it.
_SOURCE_GRACE_S = 0.5
# experts whose replicas are fetched at once in a round...
CONCURRENT_EXPERTS = 4
# ...fewer while max_peers replies of each would hold more bytes than this (one at least)
GATHER_BUDGET_BYTES = 512 << 20
# A fetch's bytes beside the parameters, asked of the budget: its request, the reply's
# prefix and header (names and tensor metadata)
FETCH_FRAME_BYTES = 4096
# A daemon that did not run for this long (its 1 s ticks, ``TICK_S``) holds back its
# replicated experts until caught up. Twice the default ``average_every_s``: replicas are
# always up to a round apart, and the round due at waking handles a freeze that short.
# Far above the event loop's stalls under heavy CPU load (seconds: the experts compute
# in worker threads), which must not hold experts back.
FROZEN_S = 60.0
TICK_S = 1.0
# The longest experts are held back after a freeze: time for a few tries (a fetch bound,
# connections dialled again, a peer's backoff of ``average_every_s``); a daemon whose
# replicas are gone or silent serves again after it.
CATCH_UP_S = 120.0
_CATCH_UP_RETRY_S = 5.0
# The pause between the rounds of a catch-up whose move was clipped (tau at most a
# round): a checkpoint 600 s old, x1.5 off its replica, was 27 % off still after one
# round; about 5 rounds catch it up, x3 about 12.
_CATCH_UP_ROUND_S = 2.0
# At most this many rounds (then it serves, and the usual rounds go on): they bound how
# far one hostile replica pulls a held expert, tau a round (its copy, x50 away, in 83 s
# when only CATCH_UP_S bounded the rounds: a re-check).
CATCH_UP_ROUNDS = 6


class ReplicaSource(Protocol):
    """How the averager reaches the swarm."""

    async def replicas(self, uid: str) -> list[str]:
        """Peer ids of the other daemons hosting ``uid`` now (not this one)."""
        ...

    async def replicas_of(self, uids: Sequence[str]) -> dict[str, list[str]]:
        """``replicas`` of each of ``uids``, in as few lookups as the swarm allows."""
        ...

    async def fetch(
        self,
        peer_id: str,
        uid: str,
        *,
        max_bytes: int,
        timeout_s: float | None = None,
        unless_version: str | None = None,
    ) -> tuple[ParamsReply, list[WireTensor]]:
        """``peer_id``'s parameters of ``uid``, whose tensors hold at most ``max_bytes``
        together, within ``timeout_s`` if given. Raises VolunteerdError when it fails:
        FrameTooLarge for a reply over ``max_bytes``, refused before its body is read;
        ReplyTooSlow when ``timeout_s`` cut a reply that was arriving.
        ``unless_version``: the ``version`` of ``peer_id``'s last reply ("" for none):
        a reply ``unchanged``, without tensors, while its weights are still that one
        (a peer that does not know the field answers as without it)."""
        ...


class FetchBudget(Protocol):
    """What this daemon may receive for its own bulk transfers (a transfer quota's
    share: ``server.transfers.TransferBudget``)."""

    def fetch(self, size: int) -> bool:
        """Count ``size`` bytes about to be received; False, counting nothing, when
        they do not fit."""
        ...

    def can_fetch(self, size: int) -> bool:
        """Whether ``size`` bytes would fit (nothing counted)."""
        ...

    def unfetched(self, size: int) -> None:
        """Uncount ``size`` bytes of a ``fetch`` that did not come."""
        ...


@dataclass(frozen=True, slots=True)
class AveragingStats:
    rounds: int  # averaging rounds of one expert that found at least one good replica
    averaged: int  # replicas averaged with, summed over rounds
    rejected: dict[str, int]  # replies dropped, by reason
    rejected_by_peer: dict[str, int]
    clipped_by_peer: dict[str, int]  # tensors of a peer's reply that were clipped
    last_shift: dict[str, float]  # uid -> |new - own| / |own| over all tensors, last round
    # replica fetches (and whole rounds) skipped: the transfer quota's bulk share was used
    skipped_for_quota: int = 0
    # fetches answered "unchanged" (no tensors): replicas that agreed, nobody trained since
    unchanged: int = 0


@dataclass(slots=True)
class _Counters:
    rounds: int = 0
    averaged: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    rejected_by_peer: dict[str, int] = field(default_factory=dict)
    clipped_by_peer: dict[str, int] = field(default_factory=dict)
    last_shift: dict[str, float] = field(default_factory=dict)
    skipped_for_quota: int = 0
    unchanged: int = 0


# A replica's reply "unchanged" in ``gather``'s list: its weights are the ones it sent
# in the round that agreed with ours (``ReplicaAverager._agreed``).
_UNCHANGED: Params = {}


class ReplicaAverager:
    """Averages ``runtime``'s experts with their replicas found through ``source``."""

    def __init__(
        self,
        runtime: ExpertRuntime,
        source: ReplicaSource,
        config: ReplicasConfig,
        rng: random.Random | None = None,
        clock: Callable[[], float] | None = None,
        *,
        awake_clock: Callable[[], float] = awake_time,
        wall_clock: Callable[[], float] = time.time,
        on_stale: Callable[[frozenset[str]], None] = lambda stale: None,
        lookup_s: float = 0.0,
        budget: FetchBudget | None = None,
    ) -> None:
        self.runtime = runtime
        self.source = source
        self._config = config
        self._lookup_s = lookup_s  # the most ``source.replicas`` takes
        self._budget = budget  # a transfer quota's share for fetches; None: no quota
        self._rng = rng or random.Random()
        # Backoffs and spent replicas' deadlines: ``awake_clock`` unless given. On
        # time.monotonic, which stops while the machine sleeps, a replica whose quota
        # was used up until midnight was skipped 14 h more after a 14 h suspend.
        self._clock = clock or awake_clock
        self._counts = _Counters()
        self._good: OrderedDict[str, float] = OrderedDict()  # peer -> when last used
        self._failed: OrderedDict[str, tuple[float, int]] = OrderedDict()  # -> (retry at, n)
        self._spent: OrderedDict[str, float] = OrderedDict()  # peer -> not asked until
        self._spent_claims: OrderedDict[str, int] = OrderedDict()  # -> such refusals in a row
        # (uid, peer) -> the version its last reply of uid's parameters said it was
        self._versions: OrderedDict[tuple[str, str], str] = OrderedDict()
        # uid -> (its weights' version after, the replicas) of the last round that
        # combined them and moved nothing (they agree): while neither side changes,
        # the next rounds need none of their bytes (``gather``)
        self._agreed: dict[str, tuple[str, frozenset[str]]] = {}
        self._rounds_run = 0
        self._turns: dict[str, int] = {}  # hosted uid -> the round it was last gathered in
        self._awake_clock = awake_clock
        self._wall_clock = wall_clock  # checkpoints' ages: their headers' time.time()
        self._on_stale = on_stale
        self._replicated: set[str] = set()  # uids whose latest lookup listed replicas
        self._warned_slow: set[str] = set()  # uids warned of as too slow to fetch
        self.stale: frozenset[str] = frozenset()  # held back until caught up
        # loaded from old checkpoints (uid -> their age, s), for ``watch_restored``
        self._restored: dict[str, float] = {}
        self._restored_added = trio.Event()

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Average every expert every ``average_every_s`` (jittered), and catch up after
        a freeze (``watch_freezes``) and experts loaded from old checkpoints
        (``watch_restored``), until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.watch_freezes)
            nursery.start_soon(self.watch_restored)
            task_status.started()
            while True:
                await trio.sleep(self._config.average_every_s * self._rng.uniform(0.8, 1.2))
                await self.run_round()

    async def watch_freezes(self) -> None:
        """Tick every ``TICK_S``; a tick that took ``FROZEN_S`` or more (the process did
        not run) starts ``catch_up``. Until cancelled."""
        while True:
            before = self._awake_clock()
            await trio.sleep(TICK_S)
            away_s = self._awake_clock() - before
            if away_s >= FROZEN_S:
                await self.catch_up(away_s)

    async def catch_up(self, away_s: float) -> None:
        """Hold back the experts whose latest lookup listed replicas (``stale``) and
        average each with its replicas, its own weights left out of the mean, until a
        round with replicas was not clipped, its lookup lists none, or ``CATCH_UP_S``
        (from when network use is allowed) passed; then serve them again. Returns when
        none of them is held back."""
        stale = self._replicated.intersection(self.runtime.uids) - self.stale
        if not stale:
            logger.info("did not run for %.0f s; no expert has replicas to catch up with", away_s)
            return
        logger.warning(
            "did not run for %.0f s: not serving %d experts with replicas (%s) until "
            "averaged with them (%.0f s at most)",
            away_s,
            len(stale),
            ", ".join(sorted(stale)),
            CATCH_UP_S,
        )
        self._hold(self.stale | stale)
        listed = await self._look_up_allowed(sorted(stale))
        await self._catch_up(frozenset(stale), listed)

    def hold_restored(self, saved_at: Mapping[str, float]) -> None:
        """Hold back at once (before they are announced) the experts of ``saved_at``
        (uid -> when the checkpoint it was just loaded from was written, time.time())
        whose checkpoint is ``FROZEN_S`` old or more: like a daemon after a freeze, one
        whose PC was off overnight, or that was started from a backup, is that far
        behind its replicas. A checkpoint written ``FROZEN_S`` or more in the future (by
        a clock that was ahead, set right since) is of unknown age: held back too, as
        fresh it served at once. ``watch_restored`` looks them up and catches them up."""
        now = self._wall_clock()
        old = {
            uid: now - at
            for uid, at in saved_at.items()
            if abs(now - at) >= FROZEN_S and uid not in self.stale
        }
        if old:
            self._restored.update(old)
            self._hold(self.stale | old.keys())
            self._restored_added.set()

    async def watch_restored(self) -> None:
        """Catch up the experts ``hold_restored`` held back (``catch_up_restored``), until
        cancelled."""
        async with trio.open_nursery() as nursery:
            while True:
                await self._restored_added.wait()
                self._restored_added = trio.Event()
                ages, self._restored = self._restored, {}
                nursery.start_soon(self.catch_up_restored, ages)

    async def catch_up_restored(self, ages: Mapping[str, float]) -> None:
        """Catch up held-back experts loaded from old checkpoints (uid -> the
        checkpoint's age, s), as ``catch_up`` does after a freeze; they are looked up
        first (at start no lookup has run yet), and those whose lookup lists no replica
        serve again at once. A lookup that fails leaves each to its own."""
        uids = [uid for uid in ages if uid in self.runtime.uids]
        listed = await self._look_up_allowed(uids)
        stale = set(uids)
        if listed is not None:
            for uid in uids:
                if listed.get(uid):
                    self._replicated.add(uid)
                else:
                    self._replicated.discard(uid)
                    stale.discard(uid)
        self._hold(self.stale - (ages.keys() - stale))  # no replica, or no longer hosted
        if not stale:
            logger.info(
                "loaded checkpoints up to %s old; no replica of them to catch up with",
                _age(max(ages.values())),
            )
            return
        logger.warning(
            "started from checkpoints %s old: not serving %d experts with replicas (%s) "
            "until averaged with them (%.0f s at most)",
            _age(max(ages[uid] for uid in stale)),
            len(stale),
            ", ".join(sorted(stale)),
            CATCH_UP_S,
        )
        await self._catch_up(frozenset(stale), listed)

    async def _look_up_allowed(self, uids: Sequence[str]) -> dict[str, list[str]] | None:
        """``source.replicas_of(uids)`` once network use is allowed: while it is not
        (paused, snoozed, outside the network hours, over quota: ``Paused``) the held
        experts stay held, and ``CATCH_UP_S`` counts from then. Read as "no replica",
        such a lookup served them un-caught-up (41 % off their replica after resuming;
        a re-check). None when the lookup failed or took too long."""
        waited = False
        while True:
            try:
                with trio.move_on_after(self._lookup_s or math.inf):
                    return await self.source.replicas_of(uids)
                return None
            except Paused:
                if not waited:
                    logger.info(
                        "network use is not allowed now: %d experts held back until it is",
                        len(uids),
                    )
                    waited = True
                await trio.sleep(_CATCH_UP_RETRY_S)
            except Exception as exc:  # VolunteerdError, or py-libp2p's own (as in run_round)
                logger.info("looking up the experts to catch up failed: %r", exc)
                return None

    async def _catch_up(
        self, stale: frozenset[str], listed: Mapping[str, list[str]] | None = None
    ) -> None:
        """Average each of ``stale`` (held back) with its replicas (``listed``: as a
        lookup just found them; None looks each up), its own weights left out, until
        a round moved it by less than tau (the clipping did not hold it back), its
        lookup lists none, ``CATCH_UP_ROUNDS`` rounds were clipped, or ``CATCH_UP_S``
        passed, and serve it again."""
        caught_up: list[str] = []

        async def catch_up_one(uid: str) -> None:
            peers = None if listed is None else listed.get(uid, [])
            rounds = 0
            while uid in self.runtime.uids:
                try:
                    # every replica's weights, whatever it says of them
                    replies = await self.gather(uid, listed=peers, conditional=False)
                    if uid not in self._replicated:
                        break
                    if replies:
                        _, clipped = await self._combine(uid, replies, own_weight=False)
                        rounds += 1
                        if not clipped:
                            caught_up.append(uid)
                            break
                        if rounds >= CATCH_UP_ROUNDS:
                            logger.info(
                                "%s: still further than a round from its replicas after "
                                "%d rounds; serving it, the usual rounds go on",
                                uid,
                                rounds,
                            )
                            break
                        # Moved by tau only: further from the replicas than a round
                        # goes (one round left a checkpoint x1.5 off 27 % off). Held
                        # still, again with the same replicas.
                        peers = [peer_id for peer_id, _ in replies]
                        await trio.sleep(_CATCH_UP_ROUND_S)
                        continue
                except Paused:  # network use not allowed now: held until it is,
                    # and CATCH_UP_S counted from then (5 s late at most)
                    window.deadline = max(window.deadline, trio.current_time() + CATCH_UP_S)
                except Exception as exc:  # a lookup that failed, the expert dropped
                    logger.info("catching up %s failed: %r", uid, exc)
                peers = None
                await trio.sleep(_CATCH_UP_RETRY_S)
            self._hold(self.stale - {uid})

        window = trio.CancelScope(deadline=trio.current_time() + CATCH_UP_S)
        with window:
            async with trio.open_nursery() as nursery:
                for uid in sorted(stale):
                    nursery.start_soon(catch_up_one, uid)
        late = sorted(self.stale & stale)
        self._hold(self.stale - stale)
        logger.info(
            "serving %d experts again: %d caught up with their replicas, %d without "
            "replicas now, %d not caught up within %.0f s%s",
            len(stale),
            len(caught_up),
            len(stale) - len(caught_up) - len(late),
            len(late),
            CATCH_UP_S,
            f" ({', '.join(late)})" if late else "",
        )

    def _hold(self, stale: frozenset[str]) -> None:
        if stale != self.stale:
            self.stale = stale
            self._on_stale(stale)

    async def run_round(self) -> int:
        """One averaging round for every hosted expert; returns the replicas used.

        Every hosted uid is looked up at once (``ReplicaSource.replicas_of``); of those
        with replicas, up to ``CONCURRENT_EXPERTS`` experts at once (fewer for large
        ones), those gathered longest ago first; fetches end by the round's deadline (see
        ``round_s``), and an expert whose turn has not come by then waits for the next
        round."""
        self._rounds_run += 1
        sizes = {uid: self._param_bytes(uid) for uid in self.runtime.uids}
        if not sizes:
            return 0
        self._turns = {uid: n for uid, n in self._turns.items() if uid in sizes}
        self._agreed = {uid: v for uid, v in self._agreed.items() if uid in sizes}
        budget = self._budget
        if budget is not None and not budget.can_fetch(min(sizes.values()) + FETCH_FRAME_BYTES):
            # not even one fetch fits today: no lookups either
            self._counts.skipped_for_quota += 1
            return 0
        deadline = trio.current_time() + self.round_s(max(sizes.values()))
        listed: dict[str, list[str]] | None = None
        try:
            with trio.move_on_at(deadline):
                listed = await self.source.replicas_of(list(sizes))
        except Paused:  # network use not allowed now: nothing to average with
            return 0
        except VolunteerdError as exc:
            logger.info("averaging round: looking up its experts failed: %s", exc)
            return 0
        except Exception as exc:
            # py-libp2p raises its own errors under a lookup (PeerStoreError for a peer
            # that left): the round is tried again, the daemon serves on. Each expert's
            # own lookup was inside its try before the lookups were batched, and this
            # one ended the daemon (tests/integration/test_stays_up.py).
            logger.warning("averaging round: looking up its experts failed: %r", exc)
            return 0
        if listed is None:  # out of time already: what has replicas is not known
            logger.info("averaging round out of time looking up its %d experts", len(sizes))
            return 0
        for uid in sizes:
            if listed.get(uid):
                self._replicated.add(uid)
            else:
                self._replicated.discard(uid)
        # Only experts with replicas take the round's time.
        in_turn = sorted(
            (uid for uid in sizes if listed.get(uid)), key=lambda uid: self._turns.get(uid, 0)
        )
        per_round = self._config.max_peers * max(max(sizes.values()), 1)
        at_once = max(1, min(CONCURRENT_EXPERTS, GATHER_BUDGET_BYTES // per_round))
        waiting = deque(in_turn)
        used = 0

        async def worker() -> None:
            nonlocal used
            while waiting and trio.current_time() < deadline:
                uid = waiting.popleft()
                self._turns[uid] = self._rounds_run
                try:
                    n = await self.average(uid, deadline=deadline, listed=listed[uid])
                    used += n  # not `used += await ...`: that reads `used` before awaiting
                except VolunteerdError as exc:
                    logger.info("averaging %s failed: %s", uid, exc)
                except Exception as exc:
                    # Peers come and go under the lookup (py-libp2p raises its own errors,
                    # e.g. PeerStoreError for one that left): never a reason to stop serving.
                    logger.warning("averaging %s failed: %r", uid, exc)

        async with trio.open_nursery() as nursery:
            for _ in range(min(at_once, len(waiting))):
                nursery.start_soon(worker)
        if waiting:  # they keep their place in line: first next round
            logger.info("averaging round out of time; left for the next: %s", ", ".join(waiting))
        return used

    def round_s(self, largest_bytes: int) -> float:
        """How long a round may take at most, with experts of ``largest_bytes``
        parameter bytes at most: ``average_every_s``, or one lookup and one fetch of the
        largest. The lookup counts: a fetch begins after it, and one still under way at
        the round's deadline is cut uncounted, so with a round of one fetch bound a
        replica that stalled mid-reply was never dropped as "timeout" nor backed off,
        and held every round for its whole length (an outside probe)."""
        return max(self._config.average_every_s, self._lookup_s + fetch_bound_s(largest_bytes))

    async def average(
        self, uid: str, *, deadline: float = math.inf, listed: list[str] | None = None
    ) -> int:
        """Average ``uid`` with its replicas once; returns how many replicas went in.
        Fetches end at ``deadline`` (trio's clock) at the latest; the replies checked by
        then are averaged. ``listed``: as in ``gather``."""
        return await self.combine(uid, await self.gather(uid, deadline=deadline, listed=listed))

    async def gather(
        self,
        uid: str,
        *,
        deadline: float = math.inf,
        listed: list[str] | None = None,
        conditional: bool = True,
    ) -> list[tuple[str, Params]]:
        """The parameters of up to ``max_peers`` other replicas of ``uid`` that fit, by
        peer id; the others are counted as rejected. A replica that has not sent them
        within ``fetch_bound_s`` is dropped as "timeout"; one still being fetched or
        checked at ``deadline`` (trio's clock) is left out uncounted. ``listed``: the
        replicas a lookup just found (a round looks up all its experts at once); None
        looks them up.

        ``conditional``: a replica of the last round that agreed with this one
        (``_agreed``), while this one's weights are still what that round left, is
        asked ``unless_version`` its last reply's version; one that answers
        "unchanged" is listed as ``_UNCHANGED`` (its weights are ours, as then), with
        no tensors fetched. Idle replicas (nobody training: between a project's runs, a
        night without trainers) sent each other every expert whole every round: 33.5
        MB an expert at hidden 1024, 16 GB an hour each way for 4 experts with one
        replica each. A replica can say "unchanged" of itself only: a lie leaves its
        own newer weights out, no other replica's."""
        replies: list[tuple[str, Params]] = []
        with trio.move_on_at(deadline):
            if listed is None:
                listed = await self.source.replicas(uid)
            if listed:
                self._replicated.add(uid)
            else:
                self._replicated.discard(uid)
            peers = self.choose(listed)
            if not peers:
                return replies
            backend = self.runtime.backend(uid)
            expected = {
                name: (p.dtype, tuple(p.shape)) for name, p in backend.module.named_parameters()
            }
            # A reply that fits has exactly these bytes: one over them is refused from its
            # prefix, or a replica could make this node read ~256 MiB (wire.max_body_bytes).
            max_bytes = self._param_bytes(uid)
            bound_s = fetch_bound_s(max_bytes)
            agreed = self._agreed.get(uid) if conditional else None
            if agreed is not None and agreed[0] != backend.weights_version():
                agreed = None  # ours changed since (a step, a write): fetched whole

            def unless_version(peer_id: str) -> str | None:
                """What ``peer_id`` is asked ``unless_version``: "" (its version is
                learnt) but for a replica of the agreeing round."""
                if not conditional:
                    return None
                if agreed is not None and peer_id in agreed[1]:
                    return self._versions.get((uid, peer_id), "")
                return ""

            async def fetch(peer_id: str) -> None:
                got: tuple[ParamsReply, list[WireTensor]] | None = None
                counted = max_bytes + FETCH_FRAME_BYTES
                if not self._fits(counted):
                    self._counts.skipped_for_quota += 1
                    return
                # Only this peer's own bound counts against it: a cut at the round's
                # deadline (an outer scope) propagates past this one, uncounted. A fetch
                # that brought no reply, cut by either, gives its bytes back to the
                # budget (what did arrive still counts in the throttle's quotas): a
                # silent replica beside each honest one spent half the averaging share
                # on nothing (a re-check).
                began = trio.current_time()
                unless = unless_version(peer_id)
                try:
                    with trio.move_on_after(bound_s + _SOURCE_GRACE_S):
                        try:
                            got = await self.source.fetch(
                                peer_id,
                                uid,
                                max_bytes=max_bytes,
                                timeout_s=bound_s,
                                unless_version=unless,
                            )
                        except FrameTooLarge as exc:  # refused from its prefix
                            self._unfetched(counted)
                            self._reject(peer_id, "too_large", str(exc))
                            return
                        except ReplyTooSlow as exc:
                            # It was sending, too slowly: what arrived counts, the rest
                            # goes back. Before, a reply cut at 60 s was "unreachable"
                            # and all of it went back, though ~60 MB had come.
                            self._unfetched(max(0, counted - exc.received))
                            took_s = trio.current_time() - began
                            self._warn_slow(
                                uid, max_bytes, bound_s, exc.received / max(took_s, 1e-3)
                            )
                            self._reject(peer_id, "too_slow", str(exc))
                            return
                        except RequestTimeout as exc:  # no reply began in time
                            self._unfetched(counted)
                            self._reject(peer_id, "timeout", str(exc))
                            return
                        except Paused:  # network use not allowed now: not the peer's fault
                            self._unfetched(counted)
                            return
                        except VolunteerdError as exc:
                            self._unfetched(counted)
                            until = _spent_for(exc)
                            if until is None or not self._spend(peer_id, until):
                                self._reject(peer_id, "unreachable", str(exc))
                            return
                except trio.Cancelled:
                    if got is None:
                        self._unfetched(counted)
                    raise
                if got is None:
                    self._unfetched(counted)
                    self._reject(peer_id, "timeout", f"{uid}: no reply within {bound_s:.3g} s")
                    return
                reply, tensors = got
                key = (uid, peer_id)
                params: Params
                if reply.unchanged and unless and reply.version == unless and reply.uid == uid:
                    self._unfetched(max_bytes)  # the header came, no tensors
                    self._counts.unchanged += 1
                    params = _UNCHANGED
                else:
                    # an "unchanged" not asked for has no names: refused as "names"
                    checked = await trio.to_thread.run_sync(
                        _check_reply, uid, expected, reply, tensors
                    )
                    if isinstance(checked, str):
                        self._versions.pop(key, None)
                        self._reject(peer_id, checked, f"{uid}: {checked}")
                        return
                    params = checked
                    if reply.version:
                        remember(self._versions, key, reply.version, _MAX_REMEMBERED * 4)
                    else:  # an older release, or no longer known
                        self._versions.pop(key, None)
                self._failed.pop(peer_id, None)
                self._spent_claims.pop(peer_id, None)  # it gives again: a new day
                remember(self._good, peer_id, self._clock(), _MAX_REMEMBERED)
                replies.append((peer_id, params))

            async with trio.open_nursery() as nursery:
                for peer_id in peers:
                    nursery.start_soon(fetch, peer_id)
        return replies

    def _warn_slow(self, uid: str, size: int, bound_s: float, rate: float) -> None:
        """Warn, once per expert, that its replicas' parameters do not arrive within
        their bound at the rate they came."""
        if uid in self._warned_slow:
            return
        self._warned_slow.add(uid)
        logger.warning(
            "averaging %s: its replicas' parameters (%.1f MB) cannot arrive within %.0f s: "
            "they came at %.0f kbit/s, %.0f needed; this expert is not averaged while the "
            "replicas' uploads (or this node's download limit) stay that slow",
            uid,
            size / 1e6,
            bound_s,
            rate * 8 / 1000,
            MIN_REPLY_RATE * 8 / 1000,
        )

    def _fits(self, size: int) -> bool:
        """Whether the budget lets ``size`` bytes be fetched (then counted)."""
        return self._budget is None or self._budget.fetch(size)

    def _unfetched(self, size: int) -> None:
        if self._budget is not None:
            self._budget.unfetched(size)

    def _param_bytes(self, uid: str) -> int:
        module = self.runtime.backend(uid).module
        return sum(p.numel() * p.element_size() for p in module.parameters())

    def choose(self, listed: list[str]) -> list[str]:
        """Up to ``max_peers`` of the peers the DHT lists for a uid (in its order): not
        those failing lately; replicas used before first (a random choice, one place
        kept for a new peer while there is one), then new ones in the listed order, those
        never asked before those asked again after a backoff or a spent refusal."""
        now, limit = self._clock(), self._config.max_peers
        usable = [
            p
            for p in dict.fromkeys(listed)
            if self._failed.get(p, (0.0, 0))[0] <= now and self._spent.get(p, 0.0) <= now
        ]
        good = [p for p in usable if p in self._good]
        # never asked first, then those whose backoff or claimed time is over (fewest
        # failures and spent refusals in a row first)
        new = sorted(
            (p for p in usable if p not in self._good),
            key=lambda p: self._failed.get(p, (0, 0))[1] + self._spent_claims.get(p, 0),
        )
        known = self._rng.sample(good, min(len(good), limit - 1 if new and limit > 1 else limit))
        chosen = known + new[: limit - len(known)]
        spare = [p for p in good if p not in known]
        return chosen + spare[: limit - len(chosen)]

    async def combine(
        self, uid: str, replies: list[tuple[str, Params]], *, own_weight: bool = True
    ) -> int:
        """Centered clipping of ``uid``'s weights with ``replies`` (from ``gather``),
        applied in the worker's turn; returns how many replicas went in. Without
        ``own_weight`` (weights known to be stale), the mean leaves them out: they move
        by the replicas' clipped mean, by tau at most, instead of tau*n/(n+1)."""
        return (await self._combine(uid, replies, own_weight=own_weight))[0]

    async def _combine(
        self, uid: str, replies: list[tuple[str, Params]], *, own_weight: bool = True
    ) -> tuple[int, bool]:
        """``combine``, and whether the move was held back by the clipping: some
        tensor moved by tau (99 % of it: float rounding), so the replicas are further
        away than one round can go."""
        if not replies:
            return 0, False
        counts = self._counts
        peers = frozenset(peer_id for peer_id, _ in replies)
        if all(params is _UNCHANGED for _, params in replies):
            # They agree, and neither side changed since the round that found so:
            # that round would write nothing again.
            counts.rounds += 1
            counts.averaged += len(replies)
            counts.last_shift[uid] = 0.0
            logger.debug("%s: its %d replicas are unchanged, as ours", uid, len(replies))
            return len(replies), False
        ratio = self._config.clip_ratio

        def apply(b: ExpertBackend) -> tuple[list[int], float, bool, str | None]:
            own = b.live_parameters()
            # a replica "unchanged" still has what the agreeing round left, ours
            others = [own if params is _UNCHANGED else params for _, params in replies]
            new, clipped = centered_clip(own, others, ratio)
            if not own_weight:  # own + sum/(n+1) -> own + sum/n
                scale = (len(others) + 1) / len(others)
                new = {k: own[k] + (new[k] - own[k]) * scale for k in own}
            moves = {k: float((new[k] - own[k]).norm()) for k in own}
            at_tau = any(moves[k] >= 0.99 * clip_bound(own[k], ratio) for k in own)
            moved = math.sqrt(sum(m**2 for m in moves.values()))
            size = math.sqrt(sum(float(own[k].norm()) ** 2 for k in own))
            # Replicas that agree (nobody trained since the last round) move each other
            # by float rounding or nothing: such a round writes nothing. Each write is a
            # new revision, and every revision was saved, every checkpoint period, for
            # as long as the daemon ran (an outside probe: 7.2 GB an hour of checkpoints
            # rewritten by two idle daemons of 4 default experts).
            rounding = max((torch.finfo(t.dtype).eps for t in own.values()), default=0.0)
            if moved > rounding * size:
                b.set_parameters(new)
                return clipped, moved / max(size, 1e-12), at_tau, None
            # Moved nothing: the replicas agree with these weights, as they are now.
            return clipped, moved / max(size, 1e-12), at_tau, b.weights_version()

        clipped, shift, at_tau, agreed = await self.runtime.with_expert(uid, apply)
        if agreed is not None and own_weight:
            self._agreed[uid] = (agreed, peers)
        else:
            self._agreed.pop(uid, None)
        counts.rounds += 1
        counts.averaged += len(replies)
        counts.last_shift[uid] = shift
        for (peer_id, _), n_clipped in zip(replies, clipped, strict=True):
            if n_clipped:
                _add(counts.clipped_by_peer, peer_id, n_clipped)
        logger.debug(
            "averaged %s with %d replicas (moved %.2e of its norm)", uid, len(replies), shift
        )
        return len(replies), at_tau

    def _spend(self, peer_id: str, retry_after_s: float) -> bool:
        """Leave ``peer_id`` unasked for ``retry_after_s`` (a day at most; at least the
        backoff a failure would get): its quota for bulk replies is used up. Not a
        failure: it stays a good replica, and its backoff is not lengthened. Logged once
        a claim, not each round. False when it has made ``_SPENT_CLAIMS`` such claims in
        a row already (a failure, then)."""
        now = self._clock()
        if self._spent.get(peer_id, 0.0) > now:
            return True  # another expert's fetch of the same round: said already
        claims = self._spent_claims.get(peer_id, 0)
        if claims >= _SPENT_CLAIMS:
            return False
        remember(self._spent_claims, peer_id, claims + 1, _MAX_REMEMBERED)
        failures = self._failed.get(peer_id, (0.0, 0))[1]
        left = max(min(retry_after_s, _SPENT_MOST_S), self._backoff_s(failures + 1))
        remember(self._spent, peer_id, now + left, _MAX_REMEMBERED)
        wall = self._wall_clock()
        logger.info(
            "replica %s: quota used up until %s (in %s); not asked until then",
            peer_id[-8:],
            clock_time(wall + left, wall),
            span(left),
        )
        return True

    def _backoff_s(self, failures: int) -> float:
        """How long a peer goes unasked after ``failures`` failures in a row."""
        return min(_MAX_BACKOFF_S, self._config.average_every_s * 2 ** min(failures - 1, 20))

    def _reject(self, peer_id: str, reason: str, detail: str) -> None:
        counts = self._counts
        counts.rejected[reason] = counts.rejected.get(reason, 0) + 1
        _add(counts.rejected_by_peer, peer_id, 1)
        self._good.pop(peer_id, None)
        now = self._clock()
        retry_at, failures = self._failed.get(peer_id, (0.0, 0))
        if retry_at > now:
            # Already backing off: it failed for another expert of the same round (the
            # experts are gathered at once), which counts as one failure, as in turn.
            logger.info("replica %s dropped (%s): %s", peer_id[-8:], reason, detail[:200])
            return
        failures += 1
        remember(
            self._failed, peer_id, (now + self._backoff_s(failures), failures), _MAX_REMEMBERED
        )
        logger.info("replica %s dropped (%s): %s", peer_id[-8:], reason, detail[:200])

    def statistics(self) -> AveragingStats:
        c = self._counts
        return AveragingStats(
            rounds=c.rounds,
            averaged=c.averaged,
            rejected=dict(c.rejected),
            rejected_by_peer=dict(c.rejected_by_peer),
            clipped_by_peer=dict(c.clipped_by_peer),
            last_shift=dict(c.last_shift),
            skipped_for_quota=c.skipped_for_quota,
            unchanged=c.unchanged,
        )


def _spent_for(exc: VolunteerdError) -> float | None:
    """How long a replica's refusal says it gives nothing (``retry_after_s`` with a
    ``busy``, ``rate_limited`` or ``paused``); None for any other failure."""
    if isinstance(exc, RemoteError) and exc.code in _SPENT_CODES and exc.retry_after_s:
        return exc.retry_after_s
    return None


def fetch_bound_s(param_bytes: int) -> float:
    """How long a replica may take to send parameters of ``param_bytes``: it must begin
    within ``FIRST_REPLY_S`` and go on at ``MIN_REPLY_RATE`` at least."""
    return FIRST_REPLY_S + param_bytes / MIN_REPLY_RATE


def _age(seconds: float) -> str:
    """``seconds`` for a log line: in hours from one hour on; a negative age (saved in
    the future) is unknown."""
    if seconds < 0:
        return "an unknown time (saved in the future)"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def _add(counter: dict[str, int], peer_id: str, n: int) -> None:
    """Count ``n`` for ``peer_id``; a new peer beyond the bound replaces the oldest."""
    if peer_id not in counter and len(counter) >= _MAX_REMEMBERED:
        del counter[next(iter(counter))]
    counter[peer_id] = counter.get(peer_id, 0) + n


def _check_reply(
    uid: str,
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    reply: ParamsReply,
    tensors: list[WireTensor],
) -> Params | str:
    """The reply's parameters, or why they are refused: "uid", "names", "dtype",
    "shape" or "non_finite"."""
    if reply.uid != uid:
        return "uid"
    if list(reply.names) != list(expected):
        return "names"
    out: Params = {}
    for name, tensor in zip(reply.names, tensors, strict=True):
        dtype, shape = expected[name]
        if tensor.dtype != "float32" or dtype != torch.float32:
            return "dtype"
        if tuple(tensor.shape) != shape:
            return "shape"
        value = from_wire(tensor)
        if not bool(torch.isfinite(value).all()):
            return "non_finite"
        out[name] = value
    return out
