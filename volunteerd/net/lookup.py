"""Iterative Kademlia lookups that believe only peers that answer.

py-libp2p's ``PeerRouting.find_closest_peers_network`` takes every peer a FIND_NODE
answer names as found: it puts the named addresses in the peerstore for an hour and
the peers in the routing table without contacting them, returns them whether or not
they ever answered, and dials each one it queries. One hostile Kademlia peer answering
with made-up ids ground close to a key therefore owned that key's lookups, filled
routing tables with peers that do not exist (handed on to everyone who asked), and
made honest nodes dial an address of its choice over and over (a third party's port).

``PeerLookup.closest`` replaces it (``open_node`` installs it on the node's KadDHT, so
its own refreshes use it too). It walks the key space the same way, round by round:
query the (at most ``ALPHA``) closest peers not yet queried among the ``count`` closest
seen, merge their answers, and end at a round that leaves the closest as they were,
when none is left to query, or after ``MAX_LOOKUP_ROUNDS``. In a swarm where everyone
answers it sends the same requests (``tests/unit/test_sim_kademlia.py`` runs both over
the simulator's tables) and finds the same peers, those it asked: all of them for the
5 that records live on; a lookup of more than ``ALPHA`` can end before asking them all.
What differs is what it believes:

* **Found means answered.** The result holds only peers that answered this lookup's
  FIND_NODE; only they enter the routing table. A named peer is a candidate until then.
* **Answers are checked.** At most ``BUCKET_SIZE`` named peers per answer (the closest
  to the key), each with at most ``_ADDRS_PER_PEER`` direct TCP addresses that a peer
  can dial (``is_record_addr``); an answer over ``_MAX_ANSWER_BYTES`` is no answer. A
  referrer adds at most ``_ADDRS_PER_REFERRAL`` addresses to a candidate's, so the first
  to name a peer cannot crowd out the addresses a later one gives. The addresses of a
  peer this node already knows (connected or in its routing table) are never replaced
  by what a third party says about it.
* **Every referrer's addresses are dialled.** py-libp2p's swarm dials one address of a
  peer (the first of its transport class), so the first referrer's first address was
  the only one ever tried: one that accepts and never speaks hid the real address a
  later referrer gave. A candidate's addresses are dialled in turns (each referrer's
  first, then each one's second...), one every ``DIAL_STAGGER_S`` or as soon as the
  one before failed, within the query's time; the first to connect wins, and only it
  is kept in the peer store (handed on in this node's answers).
* **One dial per address.** Two candidates this node knows nothing about that share an
  address are not dialled in the same round (honest peers never share ip:port), and an
  address that was dialled and failed is not dialled again for ``SUSPECT_S``; one whose
  dial was cut short when another connected was not found out and is not held.
* **A silent peer is skipped.** A peer this node holds a connection to needs no dial:
  one that does not answer within half the query's time (frozen, or its connection
  dead without a close) is held silent for ``SUSPECT_S`` and asked by no walk
  meanwhile (``ExpertDHT`` holds the peers it finds silent here too), so one silent
  peer costs a reader one such wait, not one per lookup.
* **Referrers answer for their referrals.** A peer whose named peers cannot be reached
  at the addresses it gave (``_STRIKES`` more failures than successes within
  ``SUSPECT_S``) is distrusted for that long: what it names is ignored, though it may
  still answer for itself. A referrer answers for its own addresses only: one whose
  address connected did well, one whose dialled addresses all failed did not, and one
  whose addresses were not dialled is not judged, so a stranger's dead addresses for a
  peer cost the honest referrer of that peer nothing.

Together: a responder that names made-up peers costs each honest node at most a few
dials a minute, never a routing-table entry, never a place among the closest.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.kad_dht.common import ALPHA, BUCKET_SIZE, PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.kad_dht.peer_routing import MAX_PEER_LOOKUP_ROUNDS, MIN_PEERS_THRESHOLD
from libp2p.kad_dht.routing_table import RoutingTable
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError
from libp2p.utils.varint import (
    decode_varint_with_size,
    encode_varint_prefixed,
    read_varint_prefixed_bytes_limited,
)

from volunteerd.net.dialback import tcp_endpoint
from volunteerd.net.host import DIAL_STAGGER_S, dial_in_turn
from volunteerd.net.peers import dialable_part, short
from volunteerd.net.records import is_record_addr

__all__ = [
    "ALPHA",
    "MAX_LOOKUP_ROUNDS",
    "SUSPECT_S",
    "Answer",
    "LookupMemory",
    "LookupResult",
    "PeerLookup",
    "Referral",
    "walk",
]

logger = logging.getLogger(__name__)

MAX_LOOKUP_ROUNDS = MAX_PEER_LOOKUP_ROUNDS
SUSPECT_S = 60.0
"""How long an address that could not be dialled, a silent peer, or a distrusted
referrer, is held."""
# A real answer names 20 peers with a few addresses and signed records each (~5.5 KB).
_MAX_ANSWER_BYTES = 64 * 1024
_ADDRS_PER_PEER = 8
# Of those, what one referrer adds to a candidate's addresses, and what a candidate
# keeps from all of them: a first referrer cannot fill the list with addresses of its
# choice and so hide the ones an honest referrer gives.
_ADDRS_PER_REFERRAL = 4
_ADDRS_PER_CANDIDATE = 12
# Failures of a referrer's named peers beyond their successes before it is distrusted.
_STRIKES = 3
# What LookupMemory remembers at most (oldest forgotten first): bounded under any flood.
_REMEMBERED = 4096
# Named peers' addresses live in the peerstore this long unless they answer.
_CANDIDATE_ADDR_TTL_S = 600


@dataclass(frozen=True, slots=True)
class Referral:
    """A peer an answer named, with the addresses it gave (checked, dialable ones)."""

    peer_id: ID
    addrs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Answer:
    """What asking one peer gave: whether it was reached (a connection exists), and its
    FIND_NODE answer (None: none usable: refused, reset, malformed, too slow).

    Where the peer was dialled at the addresses handed to ``ask``: ``via``, the one that
    connected, and ``dead``, those that were dialled and failed (None: the asker does not
    say; then all of them failed if the peer was not reached, none if it was)."""

    reached: bool
    referrals: list[Referral] | None
    via: str | None = None
    dead: tuple[str, ...] | None = None


UNREACHABLE = Answer(False, None)


@dataclass(frozen=True, slots=True)
class LookupResult:
    closest: list[ID]
    """The ``count`` closest peers that answered, closest first."""
    rounds: int
    queries: int
    failed: int
    """Queried peers that could not be reached."""


def _held(table: dict[Any, float], key: Any, now: float) -> bool:
    """Whether ``key`` is held in ``table`` (until a time) at ``now``; forgotten once
    its time is over."""
    until = table.get(key)
    if until is None:
        return False
    if until <= now:
        del table[key]
        return False
    return True


class LookupMemory:
    """What lookups remember between them for ``SUSPECT_S``: addresses that could not be
    dialled, peers that held a connection but did not answer, and how the peers each
    referrer named fared."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._dead: dict[str, float] = {}
        self._silent: dict[ID, float] = {}
        # referrer -> (failures, successes, forgotten at)
        self._record: dict[ID, tuple[int, int, float]] = {}

    def address_dead(self, addr: str) -> bool:
        return _held(self._dead, addr, self._clock())

    def mark_dead(self, addrs: Iterable[str]) -> None:
        for addr in addrs:
            self._dead.pop(addr, None)
            self._dead[addr] = self._clock() + SUSPECT_S
        _trim(self._dead)

    def silent(self, peer: ID) -> bool:
        return _held(self._silent, peer, self._clock())

    def mark_silent(self, peer: ID, seconds: float = SUSPECT_S) -> None:
        self._silent.pop(peer, None)
        self._silent[peer] = self._clock() + seconds
        _trim(self._silent)

    def distrusted(self, referrer: ID) -> bool:
        failures, successes, until = self._record.get(referrer, (0, 0, 0.0))
        if until <= self._clock():
            self._record.pop(referrer, None)
            return False
        return failures - successes >= _STRIKES

    def referral_failed(self, referrer: ID) -> None:
        self._count(referrer, 1, 0)

    def referral_answered(self, referrer: ID) -> None:
        self._count(referrer, 0, 1)

    def _count(self, referrer: ID, failures: int, successes: int) -> None:
        old_failures, old_successes, until = self._record.pop(referrer, (0, 0, 0.0))
        now = self._clock()
        if until <= now:
            old_failures = old_successes = 0
        self._record[referrer] = (
            old_failures + failures,
            old_successes + successes,
            now + SUSPECT_S,
        )
        _trim(self._record)


def _trim(entries: dict[Any, Any]) -> None:
    while len(entries) > _REMEMBERED:
        del entries[next(iter(entries))]


def _distance_to(key: bytes) -> Callable[[ID], int]:
    """XOR distance of a peer to ``key`` in Kademlia's key space (sha256 of both),
    as py-libp2p's routing table measures it."""
    target = int.from_bytes(hashlib.sha256(key).digest(), "big")
    cache: dict[ID, int] = {}

    def distance(peer: ID) -> int:
        value = cache.get(peer)
        if value is None:
            value = target ^ int.from_bytes(hashlib.sha256(peer.to_bytes()).digest(), "big")
            cache[peer] = value
        return value

    return distance


async def walk(
    key: bytes,
    count: int,
    start: Sequence[ID],
    ask: Callable[[ID, tuple[str, ...]], Awaitable[Answer]],
    *,
    self_id: ID,
    known: Callable[[ID], bool],
    memory: LookupMemory,
    alpha: int = ALPHA,
    max_rounds: int = MAX_LOOKUP_ROUNDS,
) -> LookupResult:
    """The iterative lookup (module docstring), with the network behind ``ask(peer,
    addrs)``; ``known(peer)``: this node holds a connection to ``peer`` or has it in its
    routing table (its addresses are its own business, not a referrer's)."""
    distance = _distance_to(key)
    pool: set[ID] = {p for p in start if p != self_id}
    queried: set[ID] = set()
    answered: set[ID] = set()
    referrers: dict[ID, list[ID]] = {}
    addrs_of: dict[ID, tuple[str, ...]] = {}
    # what each referrer gave for a candidate: its dial order, and whom a dial blames
    given: dict[ID, dict[ID, tuple[str, ...]]] = {}
    dialled: dict[ID, tuple[str, ...]] = {}
    failed: set[ID] = set()
    # A peer that failed leaves the closest, and one seen earlier moves up: a walk for
    # records (``count`` at most ALPHA, each of the few matters) asks it next. A walk
    # that fills the routing table judges its progress as py-libp2p does, with the
    # failed ones in their places: else every peer that left would cost a round.
    filling = count > alpha
    rounds = queries = 0

    def to_dial(peer: ID) -> tuple[str, ...]:
        """A stranger's addresses not known dead, in turns: every referrer's first, then
        every one's second...: a first referrer's cannot all come before a later one's."""
        if known(peer):
            return ()
        turns = sorted(
            ((i, a) for addrs in given.get(peer, {}).values() for i, a in enumerate(addrs)),
            key=lambda turn: turn[0],
        )
        order = dict.fromkeys(a for _, a in turns)
        return tuple(a for a in order if not memory.address_dead(a))

    async def one(peer: ID, answers: dict[ID, Answer]) -> None:
        answers[peer] = await ask(peer, dialled[peer])

    def judge(peer: ID, answer: Answer) -> None:
        """Hold the addresses that were dialled and failed dead, and count the ask for
        or against the peer's referrers. Where the asker says which addresses it
        dialled, a referrer answers for its own: one whose address connected did well;
        one whose dialled addresses all failed did not; one none of whose addresses
        failed or connected (never dialled, or cut short when another connected) is
        not judged. Else every referrer answers for the peer."""
        tried = dialled[peer]
        says = answer.via is not None or answer.dead is not None
        dead = answer.dead if answer.dead is not None else (() if answer.reached else tried)
        memory.mark_dead(dead)
        for referrer in referrers.get(peer, ()):
            if not tried or not says:
                good = answer.reached
            else:
                theirs = [a for a in given.get(peer, {}).get(referrer, ()) if a in tried]
                if answer.via is not None and answer.via in theirs:
                    good = True
                elif theirs and all(a in dead for a in theirs):
                    good = False
                else:
                    continue
            if good:
                memory.referral_answered(referrer)
            else:
                memory.referral_failed(referrer)

    def closest(*, failed_too: bool = False) -> list[ID]:
        return sorted(pool | failed if failed_too else pool, key=distance)[:count]

    def pick() -> list[ID]:
        """Up to ``alpha`` peers to ask next among the ``count`` closest of the pool;
        a candidate with nothing left to dial, or only distrusted referrers, leaves
        the pool and the next one moves up."""
        chosen: list[ID] = []
        dialling: set[str] = set()
        ranked = 0
        for peer in sorted(pool, key=distance):
            if len(chosen) == alpha or ranked == count:
                break
            if peer in queried:
                ranked += 1
                continue
            if memory.silent(peer):
                pool.discard(peer)  # it held a connection and answered nothing
                continue
            if not known(peer):
                named_by = referrers.get(peer, [])
                addrs = [a for a in addrs_of.get(peer, ()) if not memory.address_dead(a)]
                if not addrs or (named_by and all(memory.distrusted(r) for r in named_by)):
                    pool.discard(peer)  # nothing left to dial, or nobody to believe
                    continue
                if dialling.intersection(addrs):
                    ranked += 1
                    continue  # another stranger at this address is asked first
                dialling.update(addrs)
            ranked += 1
            chosen.append(peer)
        return chosen

    while rounds < max_rounds:
        chosen = pick()
        if not chosen:
            break
        before = closest(failed_too=filling)
        rounds += 1
        named_any = False
        answers: dict[ID, Answer] = {}
        async with trio.open_nursery() as nursery:
            for peer in chosen:
                queried.add(peer)
                queries += 1
                dialled[peer] = to_dial(peer)
                nursery.start_soon(one, peer, answers)
        for peer in chosen:  # in distance order: results never depend on timing
            answer = answers[peer]
            if answer.reached and answer.referrals is None:
                pool.discard(peer)  # it was reached and said nothing usable: no verdict
                memory.mark_dead(answer.dead or ())
                continue
            judge(peer, answer)
            if answer.referrals is None:  # not reached
                pool.discard(peer)
                failed.add(peer)
                continue
            answered.add(peer)
            if memory.distrusted(peer):
                continue
            named = [r for r in answer.referrals if r.peer_id != self_id]
            named_any = named_any or bool(named)
            for referral in sorted(named, key=lambda r: distance(r.peer_id))[:BUCKET_SIZE]:
                other = referral.peer_id
                if other in queried and other not in pool:
                    continue  # failed or dropped earlier in this lookup
                referrers.setdefault(other, []).append(peer)
                held = addrs_of.get(other, ())
                fresh = [a for a in referral.addrs if a not in held][:_ADDRS_PER_REFERRAL]
                addrs_of[other] = kept = (*held, *fresh)[:_ADDRS_PER_CANDIDATE]
                given.setdefault(other, {})[peer] = tuple(a for a in referral.addrs if a in kept)
                pool.add(other)
        # py-libp2p's ends: a round that named nobody ends the walk unless some of the
        # closest are still to ask; a round after which no peer is among the closest
        # that was not before ends it.
        if not named_any:
            if any(p not in queried for p in closest()):
                continue
            break
        if set(closest(failed_too=filling)) <= set(before):
            break
    found = [p for p in closest() if p in answered]
    return LookupResult(found, rounds, queries, len(failed))


def _is_multihash(raw: bytes) -> bool:
    """``<varint code><varint length><digest of that length>``, at most 64 bytes: the
    shape of every peer id."""
    if not 2 <= len(raw) <= 64:
        return False
    try:
        _, code_size = decode_varint_with_size(raw)
        length, length_size = decode_varint_with_size(raw[code_size:])
    except ValueError:
        return False
    terminated = raw[code_size - 1] < 0x80 and raw[code_size + length_size - 1] < 0x80
    return terminated and code_size + length_size + length == len(raw)


def referrals_of(message: Message, key: bytes) -> list[Referral]:
    """The ``BUCKET_SIZE`` peers closest to ``key`` that a FIND_NODE answer names, each
    with the addresses a peer may dial (direct ``/ip4|ip6/<ip>/tcp/<port>``, checked as
    records' are; ``/p2p/<id>`` suffixes dropped), at most ``_ADDRS_PER_PEER``. A named
    peer whose id is no multihash is left out; one without a usable address is kept (it
    may be known already)."""
    named: dict[ID, Message.Peer] = {}
    for peer in message.closerPeers:
        raw = bytes(peer.id)
        if not _is_multihash(raw):
            continue
        named.setdefault(ID(raw), peer)
    out: list[Referral] = []
    for peer_id in sorted(named, key=_distance_to(key))[:BUCKET_SIZE]:
        addrs: dict[str, None] = {}
        for packed in named[peer_id].addrs:
            if len(addrs) == _ADDRS_PER_PEER:
                break
            try:
                text = dialable_part(str(multiaddr.Multiaddr(bytes(packed))))
            except Exception:  # undecodable bytes: not an address
                continue
            if tcp_endpoint(text) is not None and is_record_addr(text):
                addrs[text] = None
        out.append(Referral(peer_id, tuple(addrs)))
    return out


class PeerLookup:
    """``closest(key, count)``: a lookup over the live network, in place of py-libp2p's
    ``find_closest_peers_network`` (same signature, so its refreshes call it too)."""

    def __init__(self, host: IHost, table: RoutingTable, query_timeout_s: float) -> None:
        self._host = host
        self._table = table
        self._timeout_s = query_timeout_s
        self._self_id = host.get_id()
        self.memory = LookupMemory()

    async def closest(self, target_key: bytes, count: int = BUCKET_SIZE) -> list[ID]:
        start = self._table.find_local_closest_peers(target_key, count)
        if len(start) < MIN_PEERS_THRESHOLD:
            start = [*start, *self._host.get_connected_peers()]
        result = await walk(
            target_key,
            count,
            start,
            lambda peer, addrs: self._ask(peer, addrs, target_key),
            self_id=self._self_id,
            known=self._known,
            memory=self.memory,
        )
        logger.debug(
            "lookup: %d rounds, %d queries (%d unreachable), %d found",
            result.rounds,
            result.queries,
            result.failed,
            len(result.closest),
        )
        return result.closest

    def _connected(self, peer: ID) -> bool:
        return bool(self._host.get_network().connections.get(peer))

    def _known(self, peer: ID) -> bool:
        return self._connected(peer) or self._table.peer_in_table(peer)

    async def _ask(self, peer: ID, addrs: tuple[str, ...], key: bytes) -> Answer:
        """FIND_NODE ``key`` of ``peer``, dialling ``addrs`` if this node knows nothing
        about it (``_dial``). Answered: the peer joins the routing table, and of the
        addresses referrers gave only the one that connected is kept. Unreachable: it
        leaves the routing table, and its addresses are forgotten.

        A peer already connected needs no dial: it opens the stream and answers within
        half the query's time, or it is silent (module docstring) and leaves the
        routing table. The caller's own deadline (a trainer's refresh is bounded by a
        few seconds) must not end the wait first, or the silent peer would never be
        found out and would cost every lookup the whole wait again."""
        if not self._connected(peer):
            return await self._query(peer, addrs, key)
        with trio.move_on_after(self._timeout_s / 2):
            return await self._query(peer, addrs, key)
        logger.debug("lookup: %s is connected but silent", short(peer))
        self.memory.mark_silent(peer)
        self._table.remove_peer(peer)
        return Answer(True, None)

    async def _query(self, peer: ID, addrs: tuple[str, ...], key: bytes) -> Answer:
        via: str | None = None
        dead: tuple[str, ...] | None = None
        if addrs and not self._known(peer):
            via, dead = await self._dial(peer, addrs)
            if via is None:
                self._table.remove_peer(peer)
                return Answer(False, None, None, dead)
            # only the address that connected: the others a referrer gave are not
            # handed on (the peer's identify adds the ones it announces)
            self._host.get_peerstore().add_addrs(
                peer, [multiaddr.Multiaddr(via)], _CANDIDATE_ADDR_TTL_S
            )
        stream = None
        try:
            try:
                with trio.fail_after(self._timeout_s):
                    stream = await self._host.new_stream(peer, [PROTOCOL_ID])
            except Exception as exc:  # refused, timed out, no address: not reached
                logger.debug(
                    "lookup: %s unreachable: %s", short(peer), str(exc) or type(exc).__name__
                )
                self._table.remove_peer(peer)
                if not self._connected(peer):
                    with contextlib.suppress(PeerStoreError, KeyError):
                        self._host.get_peerstore().clear_addrs(peer)
                return Answer(False, None, via, dead)
            try:
                with trio.fail_after(self._timeout_s):
                    request = Message(type=Message.MessageType.FIND_NODE, key=key)
                    await stream.write(encode_varint_prefixed(request.SerializeToString()))
                    raw = await read_varint_prefixed_bytes_limited(stream, _MAX_ANSWER_BYTES)
                answer = Message()
                answer.ParseFromString(raw)
                if answer.type != Message.MessageType.FIND_NODE:
                    raise ValueError(f"a {answer.type} message")
                referrals = referrals_of(answer, key)
            except Exception as exc:  # reset, too large, malformed, too slow: no answer
                logger.debug(
                    "lookup: %s gave no answer: %s", short(peer), str(exc) or type(exc).__name__
                )
                return Answer(True, None, via, dead)
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.close()
        try:
            await self._table.add_peer(peer, skip_server_mode_check=True)
        except Exception:  # a full bucket's ping failing, a peerstore race: no entry
            logger.debug("lookup: could not add %s to the routing table", short(peer))
        return Answer(True, referrals, via, dead)

    async def _dial(self, peer: ID, addrs: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
        """Dial ``addrs`` in their order (``dial_in_turn``), all within the query's time:
        the address that connected (None: none did), and those that failed or were
        still under way at the end.

        py-libp2p's swarm dials one address of a peer (one per transport class, and
        this node has one: TCP), the first in its peer store: one that a stranger named
        first, a port that accepts and never speaks, hid the real one an honest
        referrer gave, which was then held dead with it, and its referrer blamed."""
        stagger = min(DIAL_STAGGER_S, self._timeout_s / 2 / len(addrs))
        return await dial_in_turn(self._host, peer, addrs, self._timeout_s, stagger)
