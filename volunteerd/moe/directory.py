"""ExpertDirectory: which experts are alive, as the DHT says, cached for training.

Lives on the trainer node's trio loop. ``children`` answers from the cache and fetches
what it lacks in one batched DHT lookup; ``serve`` refreshes, every ``refresh_s``, the
keys used recently, so a training step seldom waits for the DHT. A step waits only for
keys it has never seen: a cached answer older than ``3 * refresh_s`` (the refreshes
failed) is still given while a refresh runs beside the step, and steps in flight at
once that ask for the same key share one lookup. Peers that failed a
call are banned for ``ban_s``: their experts are not offered to the beam search from the
next step on, whatever the DHT still says. A peer banned again within ``BAN_MEMORY_S`` of
its last ban's end is banned twice as long as the time before, up to ``BAN_GROWTH_MAX``
times: one that misbehaved, waited its ban out and misbehaved again cost every ban's
worth of steps again, for good. A ban for being slow or loaded (calls cut off late, or
refused with "later", round after round) is ``ban_s`` (``grow=False``: neither grown
nor counted toward a later offence's growth) for a peer that answered since its last
such ban (the layer judges), and grows to ``SLOW_BAN_GROWTH_MAX`` times at most for one
that did not: such a peer is not lying, only unhelpful for now (its own upload limit, a
pause, a quota). Grown to 64 times, a ban kept a volunteer that had recovered unused
15-25 min (a 45-minute soak), and one honestly late in half its rounds 32-64 min (a
re-check); never grown, a peer that answers nothing cost 57 bans' streaks an hour.

A peer that could not be dialled (``unreachable``) is no liar: a volunteer that
restarted, or whose router gave it a new address, is one. Its ban does not grow while it
signs a newer record between such bans (a restart announces itself again; dialled in
vain again with no newer record, its bans grow as any offence's), and it ends early when
the peer shows it is back: a record it signed after its newest one seen at the ban, and
an ``info`` answer at the address it announces (at most once per
``EARLY_RETURN_EVERY_S``). Growing, the bans kept an honest volunteer that restarted
once every three hours unused for 15 s after it was back the first time, 63 min from the
seventh on (outside probe ``ban_escalation``), while one that restarted under a fresh
identity was not. With a ``verify`` function, a peer banned so is offered again, after
the ban too, only once it has answered ``info`` again: a record that points at a dead
address costs one background dial per ``ban_s``, never a step's call.

Anyone can announce anything in the DHT, under as many fresh identities as it likes
(issue 12: 1,100 of them hid every honest server). So with a ``verify`` function (the
swarm client passes one that asks the peer ``info``), a peer is offered only after it
has answered once, at the address it announces, under the identity it announces
(the Noise handshake proves the key). Verification runs in the background, at most
``max_verifying`` at a time, in the order the DHT lists the peers (storing nodes list
the writers they have seen longest first), a few candidates per child at most, so a
flood of fake records costs the trainer a bounded number of refused dials. A peer that
failed is not asked again for ``ban_s``; a verified one is remembered. A prefix looked
up for the first time waits up to ``verify_wait_s`` for its first answers.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from volunteerd.bounded import remember
from volunteerd.errors import PeerError, RemoteError
from volunteerd.net import ExpertRecord, PeerAddress, RpcClient, Verb, short
from volunteerd.net.peers import parse_circuit_addr
from volunteerd.wire import ExpertInfo, InfoRequest

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["Children", "ExpertDirectory", "RecordLookup", "Verify", "info_verifier"]

logger = logging.getLogger(__name__)

# A peer banned again within this long of its last ban's end is banned twice as long as
# the time before, up to BAN_GROWTH_MAX times the ban asked for; offenders remembered:
BAN_MEMORY_S = 86_400.0
BAN_GROWTH_MAX = 64
_MAX_OFFENDERS = 4096
# A peer banned as unreachable is let back before its ban ends at most this often: a
# restart is rare, and one that answers ``info`` and then refuses to be dialled for
# calls would otherwise cost a failed call each time it announced itself (15 s).
EARLY_RETURN_EVERY_S = 3600.0
# A peer answering ``unknown_expert`` for more than this many of the experts it announces
# at once (each held out for ``ban_s``) is banned whole, growing, once it fails one that
# its records issued since list: one announcing experts it never serves lists them all
# (16 of them: 568 failed calls in 40 s, ban_s 1 s, where a ban costs 33); a volunteer
# that re-balanced, or dropped them all (a new build), announced so (``expert_gone``).
EXPERTS_GONE_BAN = 4
# The most a ban for being slow or loaded (and for ``unknown_expert`` of many experts:
# every volunteer of a project whose owner changed its build drops them all at once)
# grows: 4 minutes at the default ``ban_s``.
SLOW_BAN_GROWTH_MAX = 4
# A call to a relayed peer (one that announces only circuit addresses) that found no way
# through its relays is no fault of the peer: its relay went down or misbehaves, and the
# peer moves to another one and announces it within seconds. The peer is not banned;
# its circuits through those relays are left out this long (never longer on a repeat),
# and the records listing it are looked up again at once.
RELAY_HOLD_S = 10.0
# background refreshes timed out in a row before a WARNING (each one before is INFO)
REFRESH_MISSES_WARNED = 3

# prefix key -> next coordinate -> servers announcing it
Children = dict[int, list[PeerAddress]]
# (peer, a uid it announces) -> did it answer as a volunteerd server?
Verify = Callable[[PeerAddress, str], Awaitable[bool]]


class RecordLookup(Protocol):
    """What the directory needs of the DHT: ``net.ExpertDHT``, or an in-process test
    world's table of who serves what (``volunteerd.testing.inprocess``)."""

    async def get(self, keys: Sequence[str]) -> dict[str, list[ExpertRecord]]:
        """Records per key, in the order the storing nodes list them."""
        ...


_MAX_REMEMBERED = 65_536  # verified and failed peers, each
_CANDIDATES_PER_CHILD = 4  # unverified peers of one child being verified at once


def info_verifier(rpc: RpcClient, timeout_s: float) -> Verify:
    """A ``Verify`` that asks the peer ``info`` about the uid: any answer of our protocol
    (the expert's info, or a typed error such as ``busy``) from that peer id is a live
    server; a refused dial, a timeout or a broken reply is not."""

    async def verify(peer: PeerAddress, uid: str) -> bool:
        try:
            with trio.fail_after(timeout_s):
                reply, _ = await rpc.call(peer, Verb.INFO, InfoRequest(uid=uid))
        except RemoteError:
            return True  # a typed error (busy, unknown_expert...) is our protocol too
        except PeerError:
            return False
        except trio.TooSlowError:
            return False
        return isinstance(reply, ExpertInfo)

    return verify


@dataclass(slots=True)
class _Disowned:
    """An episode of more than ``EXPERTS_GONE_BAN`` experts of a peer held out at once
    (``ExpertDirectory._ban_relisted``)."""

    began: float
    uids: frozenset[str]  # held out
    issued: float  # the newest ``issued_at`` of the peer's records seen when it began
    # experts held out in earlier episodes (each within the hour of the next) that newer
    # records listed again: held out again, they ban the peer
    earlier: frozenset[str]
    relisted: frozenset[str] = frozenset()  # of ``uids``, listed again since
    relisted_at: float = math.inf  # when a lookup first found some of them listed again
    held_until: float = -math.inf  # when the holds of its last ``unknown_expert`` end


@dataclass(slots=True)
class _Entry:
    children: Children
    fetched_at: float
    used_at: float
    # (child, peer id) -> when a lookup last listed it
    seen: dict[tuple[int, str], float] = field(default_factory=dict)


class ExpertDirectory:
    def __init__(
        self,
        dht: RecordLookup,
        *,
        refresh_s: float = 5.0,
        ban_s: float = 60.0,
        verify: Verify | None = None,
        verify_wait_s: float = 5.0,
        max_verifying: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dht = dht
        self._refresh_s = refresh_s
        self._ban_s = ban_s
        self._verify = verify
        self._verify_wait_s = verify_wait_s
        self._verifying = trio.CapacityLimiter(max_verifying)
        self._clock = clock
        self._cache: dict[str, _Entry] = {}
        self._banned: dict[str, float] = {}
        # (peer id, relay id) -> until when that peer's circuits through that relay are
        # left out (RELAY_HOLD_S)
        self._relay_holds: dict[tuple[str, str], float] = {}
        # (peer id, uid) -> until when that peer is not offered for that expert
        # (``expert_gone``)
        self._expert_holds: dict[tuple[str, str], float] = {}
        # peer -> when its records were last looked up again for ``expert_gone``
        self._relooked: OrderedDict[str, float] = OrderedDict()
        # peer -> when it first answered ``unknown_expert`` of the experts held out for
        # it now, and key -> the uids its records list in the last lookup of that key
        # begun since (``expert_gone``)
        self._gone_since: OrderedDict[str, float] = OrderedDict()
        self._listed_since: dict[str, dict[str, set[str]]] = {}
        # peer -> the newest ``issued_at`` of its records seen when that episode began:
        # only records issued since count in ``_listed_since`` (older ones were signed
        # before it stopped serving them: a volunteer restarting, still loading)
        self._gone_issued: dict[str, float] = {}
        # peer -> (the episode's start, the newest ``issued_at``) of its records issued
        # before an episode that a lookup in it found listing experts: in a later
        # episode those count too (``_note_listed``)
        self._gone_stale: OrderedDict[str, tuple[float, float, set[str]]] = OrderedDict()
        # peer -> (its episodes' ``_gone_issued``, when the last one's holds end)
        self._gone_chain: OrderedDict[str, tuple[float, float]] = OrderedDict()
        # peers with more than EXPERTS_GONE_BAN experts held out, not offered until a
        # lookup begun since says whether their records still list them
        self._gone_suspects: set[str] = set()
        # peer -> its last episode of more than EXPERTS_GONE_BAN experts held out, for
        # EARLY_RETURN_EVERY_S: newer records listing them again mark them (``_relisted``),
        # and another such episode of those bans it (``expert_gone``)
        self._disowned: OrderedDict[str, _Disowned] = OrderedDict()
        # peer -> (bans in a row, when the last ends): for growing bans
        self._offences: OrderedDict[str, tuple[int, float]] = OrderedDict()
        # peer -> the ``issued_at`` of its newest record seen when a call failed to dial
        # it: until it answers ``info`` again (the module docstring)
        self._unanswered: OrderedDict[str, float] = OrderedDict()
        # peer -> the ``issued_at`` of its newest record seen at its last ban as
        # unreachable: dialled in vain again with none newer, its bans grow
        self._undialled: OrderedDict[str, float] = OrderedDict()
        # peer -> when it was last let back before its ban ended
        self._returned: OrderedDict[str, float] = OrderedDict()
        # peer -> the newest ``issued_at`` of its records seen (its own clock)
        self._issued: OrderedDict[str, float] = OrderedDict()
        self._verified: OrderedDict[str, float] = OrderedDict()  # peer -> when
        self._failed: OrderedDict[str, float] = OrderedDict()  # peer -> retry after
        self._pending: set[str] = set()
        self._fetching: dict[str, trio.Event] = {}  # key -> its lookup under way
        self._refresh_misses = 0  # background refreshes that timed out in a row
        self._inline: list[tuple[PeerAddress, str]] = []  # to verify when not served
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self.ban_reasons: Counter[str] = Counter()  # reason (first word) -> bans
        self.lookups = 0
        self.empty_answers = 0  # refreshes that found nobody and were not believed
        self.verifications: Counter[str] = Counter()  # "ok" / "failed" -> peers

    async def children(self, prefixes: Iterable[str]) -> dict[str, Children]:
        """Alive children of each prefix key: verified (when verifying), unbanned peers,
        those verified earliest first."""
        now = self._clock()
        wanted = list(dict.fromkeys(prefixes))
        stale_after = 3 * self._refresh_s
        cold = [p for p in wanted if p not in self._cache]
        stale = [
            p for p in wanted if p in self._cache and now - self._cache[p].fetched_at > stale_after
        ]
        if stale and self._nursery is not None:
            # Served: the cached answer stands while a refresh runs beside the step (a
            # DHT lookup over the internet costs round trips the step need not wait).
            self._nursery.start_soon(self._refresh, stale, None)
            stale = []
        if cold or stale:
            await self._fetch(cold + stale)
        if self._verify is not None:
            self._schedule(wanted)
            if cold:
                await self._wait_for_answers(cold)
        now = self._clock()
        self._banned = {p: t for p, t in self._banned.items() if t > now}
        self._relay_holds = {k: t for k, t in self._relay_holds.items() if t > now}
        self._expert_holds = {k: t for k, t in self._expert_holds.items() if t > now}
        if self._gone_suspects:
            self._gone_suspects &= {p for p, _ in self._expert_holds}
        out: dict[str, Children] = {}
        for prefix in wanted:
            entry = self._cache[prefix]
            entry.used_at = now
            out[prefix] = {}
            for child, peers in entry.children.items():
                uid = f"{prefix}{child}" if prefix.endswith(".") else prefix
                alive = [
                    q
                    for q in map(self._without_held_relays, peers)
                    if q is not None
                    and self._offered(q.peer_id)
                    and (q.peer_id, uid) not in self._expert_holds
                ]
                if self._verify is not None:
                    alive.sort(key=lambda p: self._verified[p.peer_id])
                if alive:
                    out[prefix][child] = alive
        return out

    async def look_again(self, prefixes: Iterable[str]) -> dict[str, Children]:
        """``children``, from a fresh DHT lookup of ``prefixes`` rather than the cache:
        for a layer that found no expert alive, in case its cached answer came back
        short (a lookup that reached too few storing nodes)."""
        wanted = list(dict.fromkeys(prefixes))
        await self._fetch(wanted)
        return await self.children(wanted)

    def _without_held_relays(self, peer: PeerAddress) -> PeerAddress | None:
        """``peer`` without its circuit addresses through relays held for it; None when
        nothing is left to dial."""
        if not self._relay_holds:
            return peer
        addrs = tuple(
            a for a in peer.addrs if (peer.peer_id, _relay_of(a)) not in self._relay_holds
        )
        if addrs == peer.addrs:
            return peer
        return PeerAddress(peer.peer_id, addrs) if addrs else None

    def relay_failed(self, peer: PeerAddress, reason: str, *, every_circuit: bool = True) -> bool:
        """A call to ``peer`` failed to get through: when ``peer`` announces only circuit
        addresses (the failure may be its relays'), look its records up again on the next
        ``children`` and return True: the caller bans nobody. False for a peer with a
        direct address (the caller judges it as usual).

        Its circuits are left out for ``RELAY_HOLD_S`` when it has one relay, or when
        ``every_circuit`` failed. A call through one of two relays that stalled or broke
        leaves them offered: the RPC client tries the other relay first next time
        (``Relaying.connect``)."""
        relays = {_relay_of(a) for a in peer.addrs}
        if not relays or "" in relays:
            return False
        for entry in self._cache.values():
            if any(p.peer_id == peer.peer_id for ps in entry.children.values() for p in ps):
                entry.fetched_at = -math.inf  # refreshed beside the next step
        if len(relays) > 1 and not every_circuit:
            logger.info(
                "%s: a call through a relay failed (not banned): %s", short(peer.peer_id), reason
            )
            return True
        until = self._clock() + RELAY_HOLD_S
        for relay in relays:
            self._relay_holds[(peer.peer_id, relay)] = until
        logger.info(
            "%s: not through relay %s for %.0fs (the peer is not banned): %s",
            short(peer.peer_id),
            ", ".join(short(r) for r in sorted(relays)),
            RELAY_HOLD_S,
            reason,
        )
        return True

    def expert_gone(self, peer_id: str, uid: str, reason: str) -> None:
        """``peer_id`` answered that it does not host ``uid`` (``unknown_expert``): offer
        it for that expert no more for ``ban_s`` (its other experts stay offered), and
        look the records listing it up again beside the next ``children`` (at most once
        per ``refresh_s`` for a peer). A volunteer that re-balanced onto other experts
        announces that within an announce period, and its new records no longer list
        ``uid``; banned for it, it went unused whole, and longer each time. One that
        keeps announcing an expert it does not serve costs a call for that expert per
        ``ban_s``. One with more than ``EXPERTS_GONE_BAN`` experts held out at once
        that fails one its records issued after its first such answer list (found by a
        lookup begun since) announces what it does not serve, and is banned whole, growing to
        ``SLOW_BAN_GROWTH_MAX`` times (each ``unknown_expert`` forced a DHT lookup and
        cost a call: 760 lookups and 568 failed calls in 40 s where a ban costs 9 and
        33). Banned on the count alone, a volunteer that dropped its experts at once (a
        project whose owner changed its build) was banned too, its new records
        notwithstanding."""
        now = self._clock()
        if not any(p == peer_id and t > now for (p, _), t in self._expert_holds.items()):
            remember(self._gone_since, peer_id, now, _MAX_OFFENDERS)  # a new episode
            self._listed_since.pop(peer_id, None)
            self._listed_since = {
                p: u for p, u in self._listed_since.items() if p in self._gone_since
            }
            # Episodes in a row (the next begins within ``ban_s`` of the last's holds or
            # ban ending) count records issued since the first began: at a short
            # ``ban_s`` a liar's episode ends before a lookup finds its next record.
            anchor, until = self._gone_chain.get(peer_id, (-math.inf, -math.inf))
            until = max(until, self._offences.get(peer_id, (0, -math.inf))[1])
            if now - until > self._ban_s:
                anchor = self._issued.get(peer_id, -math.inf)
            self._gone_issued[peer_id] = anchor
            _, stale, uids = self._gone_stale.get(peer_id, (math.inf, -math.inf, set()))
            if now - until <= self._ban_s and self._issued.get(peer_id, -math.inf) <= stale:
                # announced nothing since its records listed them a whole episode ago
                self._listed_since[peer_id] = {"": set(uids)}
            self._gone_issued = {
                p: t for p, t in self._gone_issued.items() if p in self._gone_since
            }
        self._expert_holds[(peer_id, uid)] = now + self._ban_s
        anchor = self._gone_issued.get(peer_id, self._issued.get(peer_id, -math.inf))
        remember(self._gone_chain, peer_id, (anchor, now + self._ban_s), _MAX_OFFENDERS)
        while len(self._expert_holds) > _MAX_OFFENDERS:
            del self._expert_holds[next(iter(self._expert_holds))]
        self.ban_reasons["unknown_expert"] += 1
        held = {u for (p, u), t in self._expert_holds.items() if p == peer_id and t > now}
        if self._ban_gone(peer_id, uid, held) or self._ban_relisted(peer_id, held, now):
            return
        if len(held) > EXPERTS_GONE_BAN and peer_id not in self._gone_suspects:
            # Not offered until its records are looked up again (beside the next step):
            # offered meanwhile, a liar's other experts cost a call each per ``ban_s``.
            self._gone_suspects.add(peer_id)
            self._relooked.pop(peer_id, None)
        logger.info(
            "not choosing %s for %s for %.0fs (its other experts still are): %s",
            short(peer_id),
            uid,
            self._ban_s,
            reason,
        )
        if now - self._relooked.get(peer_id, -math.inf) < self._refresh_s:
            return  # its records are being looked up again already
        remember(self._relooked, peer_id, now, _MAX_OFFENDERS)
        for entry in self._cache.values():
            if any(p.peer_id == peer_id for ps in entry.children.values() for p in ps):
                entry.fetched_at = -math.inf  # refreshed beside the next step

    def _ban_gone(self, peer_id: str, uid: str, held: set[str]) -> bool:
        """Ban ``peer_id`` whole (``false_records``) when more than ``EXPERTS_GONE_BAN``
        of its experts are ``held`` out and it just answered ``unknown_expert`` for
        ``uid``, which its records issued since its first such answer list, in a lookup
        begun since (``expert_gone``): it announces what it does not serve.

        Records issued before that answer did not count before: a volunteer restarted
        within their lifetime answers ``unknown_expert`` while loading, and its old
        records still list those experts (banned 60 s at each restart). Nor does a
        lookup finding them: loaded, it announces them again within the episode, and
        serves them. A liar re-announces within a record's lifetime and fails them."""
        if len(held) <= EXPERTS_GONE_BAN or self.is_banned(peer_id):
            return False
        listed = set().union(*self._listed_since.get(peer_id, {}).values())
        if uid not in listed:
            return False
        self.ban(
            peer_id,
            f"false_records: unknown_expert for {len(held)} experts it announces, "
            f"{len(held & listed)} of them in records issued since",
            most=SLOW_BAN_GROWTH_MAX,
        )
        self._gone_since.pop(peer_id, None)
        self._listed_since.pop(peer_id, None)
        self._gone_issued.pop(peer_id, None)
        self._gone_suspects.discard(peer_id)
        return True

    def _ban_relisted(self, peer_id: str, held: set[str], now: float) -> bool:
        """Remember an episode of more than ``EXPERTS_GONE_BAN`` experts ``held`` out
        for ``EARLY_RETURN_EVERY_S``, and ban ``peer_id`` whole (``false_records``,
        growing as ``_ban_gone``) when more than that many of them were held out in an
        earlier episode and listed again since by newer records (``_relisted``): it
        took them back and again does not serve them.

        A liar that withdrew its records right after its ``unknown_expert`` answers and
        announced them all again once its holds ended was never banned (928 failed
        calls an hour). Banned for announcing them again, an honest volunteer was too:
        one that re-balanced and took its experts back within the hour (capacity lowered
        then raised, a manifest republished; the Fill rule prefers experts it has
        checkpoints of). It serves them once back, and never answers ``unknown_expert``
        for them again. Nor is one that restarts (``unknown_expert`` for them all while
        it loads) after serving them again: an episode that begins more than ``ban_s``
        after they were found listed again, and after its last ban, while it was offered
        all that time, starts afresh (two restarts within the hour were banned 60 s and
        120 s). A liar fails them as soon as it is offered them."""
        if len(held) <= EXPERTS_GONE_BAN or self.is_banned(peer_id):
            return False
        began = self._gone_since.get(peer_id, now)
        last = self._disowned.get(peer_id)
        if last is not None and now - last.began >= EARLY_RETURN_EVERY_S:
            last = None
        if last is not None and last.began == began:
            last.uids = frozenset(held)  # the same episode, grown
        else:
            earlier: frozenset[str] = frozenset()
            if last is not None:
                # offered them since (listed again, neither held out nor banned) longer
                # than ban_s: it served them, and this is a new start (a restart)
                last_ban_end = self._offences.get(peer_id, (0, -math.inf))[1]
                offered_since = max(last.relisted_at, last.held_until, last_ban_end)
                if began - offered_since <= self._ban_s:
                    earlier = last.earlier | last.relisted
            last = _Disowned(began, frozenset(held), self._issued.get(peer_id, -math.inf), earlier)
            remember(self._disowned, peer_id, last, _MAX_OFFENDERS)
        last.held_until = now + self._ban_s
        again = held & last.earlier
        if len(again) <= EXPERTS_GONE_BAN:
            return False
        self.ban(
            peer_id,
            f"false_records: unknown_expert again for {len(again)} experts it announced again",
            most=SLOW_BAN_GROWTH_MAX,
        )
        self._gone_since.pop(peer_id, None)
        self._listed_since.pop(peer_id, None)
        self._gone_issued.pop(peer_id, None)
        self._gone_suspects.discard(peer_id)
        return True

    def _offered(self, peer_id: str) -> bool:
        if peer_id in self._banned or peer_id in self._gone_suspects:
            return False
        return self._verify is None or self._answered(peer_id)

    def _answered(self, peer_id: str) -> bool:
        """Verified, and dialled since the last call that could not dial it."""
        return peer_id in self._verified and peer_id not in self._unanswered

    def _back(self, peer_id: str) -> bool:
        """Banned as ``unreachable`` and has signed a record since (and was not let
        back early within ``EARLY_RETURN_EVERY_S``): worth an ``info`` call before its
        ban ends."""
        since = self._unanswered.get(peer_id)
        returned = self._returned.get(peer_id, -math.inf)
        return (
            since is not None
            and self._issued.get(peer_id, -math.inf) > since
            and self._clock() - returned >= EARLY_RETURN_EVERY_S
        )

    def ban(
        self,
        peer_id: str,
        reason: str,
        seconds: float | None = None,
        *,
        grow: bool = True,
        most: int = BAN_GROWTH_MAX,
    ) -> None:
        """Offer none of ``peer_id``'s experts for ``seconds`` (default ``ban_s``), or
        longer for a peer banned again; a peer that could not be dialled (``reason``
        ``unreachable: ...``) for ``seconds`` at most (the module docstring). Not
        ``grow``: for ``seconds`` however often, neither grown nor growing the next
        offence's ban (a peer too slow or too loaded for now: the module docstring);
        growing, to ``most`` times at most."""
        seconds = self._ban_s if seconds is None else seconds
        now = self._clock()
        unreachable = reason.split(":", 1)[0] == "unreachable"
        banned = self.is_banned(peer_id)
        if unreachable and not banned:
            issued = self._issued.get(peer_id, -math.inf)
            before = self._undialled.get(peer_id)
            remember(self._undialled, peer_id, issued, _MAX_OFFENDERS)
            self._unanswered[peer_id] = issued
            self._unanswered.move_to_end(peer_id)
            while len(self._unanswered) > _MAX_OFFENDERS:
                self._unanswered.popitem(last=False)
            # Dialled in vain again with no newer record since the last time: not a
            # restart. Its bans grow as any offence's (one that answered ``info`` and
            # whose calls failed cost a step's call every ~70 s, for good; a re-check).
            again = ""
            if before is not None and issued <= before:
                seconds, bans = self._grown(peer_id, seconds, now)
                again = f" (dialled in vain {bans} times in a row)" if bans > 1 else ""
            logger.info(
                "not choosing %s for %.0fs%s, or until it announces itself again and answers: %s",
                short(peer_id),
                seconds,
                again,
                reason,
            )
            self.ban_reasons["unreachable"] += 1
        elif not unreachable and (self._unanswered.pop(peer_id, None) is not None or not banned):
            # A new offence (failures of the same moment are not). A peer still marked
            # unanswered is banned, if at all, only as unreachable: this is a new offence
            # too, and it ends that ban's early way out.
            again = ""
            if grow:
                seconds, bans = self._grown(peer_id, seconds, now, most)
                again = f" (banned {bans} times in a row)" if bans > 1 else ""
            logger.info("not choosing %s for %.0fs%s: %s", short(peer_id), seconds, again, reason)
            self.ban_reasons[reason.split(":", 1)[0]] += 1
        until = max(now + seconds, self._banned.get(peer_id, -math.inf))
        self._banned[peer_id] = until
        if grow and peer_id in self._offences:  # its memory counts from the ban's real end
            self._offences[peer_id] = (self._offences[peer_id][0], until)

    def _grown(
        self, peer_id: str, seconds: float, now: float, most: int = BAN_GROWTH_MAX
    ) -> tuple[float, int]:
        """``seconds`` grown for a peer banned again within ``BAN_MEMORY_S`` of its last
        ban's end (twice the time before, up to ``most`` times), and the bans
        in a row; remembered."""
        bans, last_end = self._offences.pop(peer_id, (0, -math.inf))
        bans = bans + 1 if now - last_end <= BAN_MEMORY_S else 1
        seconds *= min(2 ** min(bans - 1, 30), most)
        self._offences[peer_id] = (bans, now + seconds)
        while len(self._offences) > _MAX_OFFENDERS:
            self._offences.popitem(last=False)
        return seconds, bans

    def is_banned(self, peer_id: str) -> bool:
        until = self._banned.get(peer_id)
        return until is not None and until > self._clock()

    @property
    def banned(self) -> Mapping[str, float]:
        return dict(self._banned)

    # -- verification -----------------------------------------------------------------

    def _schedule(self, prefixes: Iterable[str]) -> None:
        """Start verifying, for every child of ``prefixes``, the first few unverified
        candidates in the DHT's order (at most ``_CANDIDATES_PER_CHILD`` at a time, so
        every replica is verified in turn -- spot checks and failover need them all --
        while junk records cost one failed `info` each per ``ban_s``)."""
        now = self._clock()
        for prefix in prefixes:
            entry = self._cache.get(prefix)
            if entry is None:
                continue
            for child, peers in entry.children.items():
                started = 0
                for peer in peers:
                    if started >= _CANDIDATES_PER_CHILD:
                        break
                    pid = peer.peer_id
                    if self._answered(pid):
                        continue
                    if self.is_banned(pid) and not self._back(pid):
                        continue
                    if pid in self._pending:
                        started += 1
                        continue
                    retry_at = self._failed.get(pid)
                    if retry_at is not None and retry_at > now:
                        continue
                    self._pending.add(pid)
                    started += 1
                    self._start(peer, f"{prefix}{child}" if prefix.endswith(".") else prefix)

    def _start(self, peer: PeerAddress, uid: str) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._verify_one, peer, uid)
        else:
            # Not served (a bare directory in a test): nothing runs in the background,
            # so the first wait verifies inline.
            self._inline.append((peer, uid))

    async def _verify_one(self, peer: PeerAddress, uid: str) -> None:
        verify = self._verify
        if verify is None:
            return
        try:
            async with self._verifying:
                try:
                    ok = await verify(peer, uid)
                except Exception as exc:  # a verifier must not end the directory
                    logger.debug("verifying %s failed: %r", short(peer.peer_id), exc)
                    ok = False
        finally:
            self._pending.discard(peer.peer_id)
        if ok:
            # one verified before keeps its place (verified earliest first)
            self._verified.setdefault(peer.peer_id, self._clock())
            self._failed.pop(peer.peer_id, None)
            _bound(self._verified)
            if self._unanswered.pop(peer.peer_id, None) is not None and self.is_banned(
                peer.peer_id
            ):
                del self._banned[peer.peer_id]  # banned only as unreachable: back
                self._returned[peer.peer_id] = self._clock()
                self._returned.move_to_end(peer.peer_id)
                while len(self._returned) > _MAX_OFFENDERS:
                    self._returned.popitem(last=False)
                logger.info("%s answers again: chosen again", short(peer.peer_id))
        else:
            self._failed[peer.peer_id] = self._clock() + self._ban_s
            self._failed.move_to_end(peer.peer_id)
            _bound(self._failed)
        self.verifications["ok" if ok else "failed"] += 1
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_for_answers(self, prefixes: list[str]) -> None:
        """Until every child of ``prefixes`` has a verified peer or nobody left to try,
        for at most ``verify_wait_s``."""
        with trio.move_on_after(self._verify_wait_s):
            if self._nursery is None:
                async with trio.open_nursery() as nursery:
                    for peer, uid in self._take_inline():
                        nursery.start_soon(self._verify_one, peer, uid)
                return
            while self._waiting_on(prefixes):
                await self._changed.wait()
                self._schedule(prefixes)

    def _take_inline(self) -> list[tuple[PeerAddress, str]]:
        inline, self._inline = self._inline, []
        return inline

    def _waiting_on(self, prefixes: list[str]) -> bool:
        for prefix in prefixes:
            entry = self._cache.get(prefix)
            if entry is None:
                continue
            for peers in entry.children.values():
                if any(self._answered(p.peer_id) for p in peers):
                    continue
                if any(p.peer_id in self._pending for p in peers):
                    return True
        return False

    # -- lookups ----------------------------------------------------------------------

    async def _fetch(self, keys: list[str]) -> None:
        """Look ``keys`` up, sharing lookups already under way: concurrent steps asking
        for the same prefix wait for one lookup rather than each making their own.
        Keys a shared lookup failed to bring are looked up again here."""
        mine = [k for k in keys if k not in self._fetching]
        theirs = {self._fetching[k] for k in keys if k in self._fetching}
        if mine:
            done = trio.Event()
            for key in mine:
                self._fetching[key] = done
            try:
                await self._lookup(mine)
            finally:
                for key in mine:
                    del self._fetching[key]
                done.set()
        for event in theirs:
            await event.wait()
        missed = [k for k in keys if k not in mine and k not in self._cache]
        if missed:
            await self._lookup(missed)

    async def _refresh(self, keys: list[str], timeout_s: float | None) -> None:
        """``_fetch`` in the background: a failure is logged, not raised. The periodic
        refresh bounds it by ``timeout_s`` to keep its period; a stale key's refresh
        waits as long as the DHT's own lookup timeout, as a step's lookup would (on a
        loaded machine a lookup can take longer than a refresh period)."""
        try:
            with trio.fail_after(math.inf if timeout_s is None else timeout_s):
                await self._fetch(keys)
        except trio.TooSlowError:  # the periodic refresh retries
            # One timeout is routine on a slow or lossy link (a trainer 400 ms of round
            # trip away logged nine WARNINGs in 267 s while training went on); a
            # streak means the cached addresses are getting old.
            self._refresh_misses += 1
            if self._refresh_misses == REFRESH_MISSES_WARNED:
                logger.warning(
                    "refreshing %d DHT keys timed out %d times in a row; the addresses "
                    "already known are used meanwhile",
                    len(keys),
                    self._refresh_misses,
                )
            else:
                logger.info("refreshing %d DHT keys timed out", len(keys))
        except Exception as exc:
            logger.warning("refreshing %d DHT keys failed: %s", len(keys), exc)

    async def _lookup(self, keys: list[str]) -> None:
        self.lookups += 1
        started = self._clock()
        records = await self._dht.get(keys)
        if self._refresh_misses >= REFRESH_MISSES_WARNED:
            logger.info("refreshing DHT keys works again")
        self._refresh_misses = 0
        now = self._clock()
        stale_after = 3 * self._refresh_s
        for key in keys:
            children: Children = {}
            seen: dict[tuple[int, str], float] = {}
            for record in records.get(key, []):  # in the DHT's order: seen longest first
                peer = PeerAddress(record.peer_id, tuple(dict.fromkeys(record.addrs)))
                if record.issued_at > self._issued.get(record.peer_id, -math.inf):
                    self._issued[record.peer_id] = record.issued_at
                    self._issued.move_to_end(record.peer_id)
                for child in record.children:
                    children.setdefault(child, []).append(peer)
                    seen[(child, record.peer_id)] = now
            old = self._cache.get(key)
            answered = bool(children)
            if old is not None:
                # A lookup may come back short (a loaded machine, a storing node that did
                # not answer in time): a server listed moments ago stays until it has
                # been missing for stale_after. Servers that are really gone fail their
                # calls and are banned meanwhile. Believing a short answer once left a
                # layer with only a banned peer, and NoExpertsAvailable.
                for child, peers in old.children.items():
                    listed = {p.peer_id for p in children.get(child, [])}
                    for peer in peers:
                        last = old.seen.get((child, peer.peer_id), old.fetched_at)
                        if peer.peer_id not in listed and now - last < stale_after:
                            children.setdefault(child, []).append(peer)
                            seen[(child, peer.peer_id)] = last
            if children and not answered:
                self.empty_answers += 1
            self._cache[key] = _Entry(children, now, old.used_at if old else now, seen)
            self._note_listed(key, records.get(key, []), started)
        if self._disowned:
            self._relisted(records, started, now)
        _bound(self._issued)
        if self._gone_since:
            held: dict[str, set[str]] = {}
            for (peer_id, uid), until in self._expert_holds.items():
                if until > now and peer_id in self._gone_since:
                    held.setdefault(peer_id, set()).add(uid)
            for peer_id in list(self._gone_since):
                if peer_id not in held:  # its holds ended: so did the episode
                    del self._gone_since[peer_id]
                    self._listed_since.pop(peer_id, None)
                    self._gone_issued.pop(peer_id, None)
                elif self._gone_since[peer_id] <= started:
                    # offered again: its next ``unknown_expert`` of an expert its records
                    # issued since list bans it (``_ban_gone``)
                    self._gone_suspects.discard(peer_id)

    def _relisted(
        self, records: Mapping[str, Sequence[ExpertRecord]], started: float, now: float
    ) -> None:
        """Mark the experts of a peer's last episode of more than ``EXPERTS_GONE_BAN``
        held out that its records issued since list again, in a lookup begun since:
        another such episode of more than that many of them bans it
        (``_ban_relisted``)."""
        while self._disowned:
            first = next(iter(self._disowned))
            if now - self._disowned[first].began < EARLY_RETURN_EVERY_S:
                break
            del self._disowned[first]
        for key, found in records.items():
            for record in found:
                episode = self._disowned.get(record.peer_id)
                if episode is None or episode.began > started or record.issued_at <= episode.issued:
                    continue  # looked up before, or older than the episode
                uids = {f"{key}{c}" if key.endswith(".") else key for c in record.children}
                again = (uids & episode.uids) - episode.relisted
                if again:
                    episode.relisted = episode.relisted | again
                    episode.relisted_at = min(episode.relisted_at, now)

    def _note_listed(self, key: str, records: Sequence[ExpertRecord], started: float) -> None:
        """What a lookup of ``key`` begun at ``started`` lists of each peer that answered
        ``unknown_expert`` before it began (``expert_gone``)."""
        if not self._gone_since:
            return
        listed: dict[str, set[str]] = {}
        for record in records:
            peer_id = record.peer_id
            since = self._gone_since.get(peer_id)
            if since is None or since > started or not record.children:
                continue
            old = record.issued_at <= self._gone_issued.get(peer_id, math.inf)
            if old:
                # Issued before the episode. Still listed in a later episode, it was not
                # announced anew since it failed: not a restart (which announces once
                # loaded, and an honest record lives ``dht.record_ttl_s``, 30 s, less
                # than ``ban_s``), but a liar signing seldom, long-lived records.
                # So is one still listed ``ban_s`` into the episode (its peer failing
                # all along, past an honest record's lifetime).
                seen_in, stale, were = self._gone_stale.get(peer_id, (math.inf, -math.inf, set()))
                lasting = started - since > self._ban_s
                if not lasting and not (seen_in < since and record.issued_at <= stale):
                    if seen_in != since:
                        stale, were = -math.inf, set()
                    stale = max(stale, record.issued_at)
                    were = were | {
                        f"{key}{c}" if key.endswith(".") else key for c in record.children
                    }
                    remember(self._gone_stale, peer_id, (since, stale, were), _MAX_OFFENDERS)
                    continue
            uids = {f"{key}{c}" if key.endswith(".") else key for c in record.children}
            listed.setdefault(peer_id, set()).update(uids)
        for peer_id, since in self._gone_since.items():
            if since <= started:
                self._listed_since.setdefault(peer_id, {})[key] = listed.get(peer_id, set())

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh recently used keys every ``refresh_s`` and verify announced peers in
        the background, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for peer, uid in self._take_inline():
                nursery.start_soon(self._verify_one, peer, uid)
            task_status.started()
            try:
                await self._refresh_forever()
            finally:
                self._nursery = None

    async def _refresh_forever(self) -> None:
        while True:
            await trio.sleep(self._refresh_s)
            now = self._clock()
            recent = [k for k, e in self._cache.items() if now - e.used_at < 10 * self._refresh_s]
            for key in [k for k in self._cache if k not in recent]:
                del self._cache[key]
            if recent:
                await self._refresh(recent, max(self._refresh_s, 5.0))
                if self._verify is not None:
                    self._schedule(recent)


def _bound(remembered: OrderedDict[str, float]) -> None:
    while len(remembered) > _MAX_REMEMBERED:
        remembered.popitem(last=False)


def _relay_of(addr: str) -> str:
    """The relay's peer id of a circuit address; "" for a direct one."""
    parts = parse_circuit_addr(addr)
    return "" if parts is None else parts[1]
