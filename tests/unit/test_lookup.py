"""net/lookup.py: the iterative lookup believes only peers that answer, dials an
address once, and stops listening to a peer whose named peers cannot be reached."""

from __future__ import annotations

import hashlib
import os

import multiaddr
import pytest
import trio
import trio.lowlevel
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID

from volunteerd.identity import Identity
from volunteerd.net import lookup
from volunteerd.net.lookup import SUSPECT_S, Answer, LookupMemory, Referral, referrals_of, walk
from volunteerd.net.peers import peer_id_for

KEY = b"ffn.0."
_ED25519_ID = b"\x00\x24\x08\x01\x12\x20"  # an identity multihash of an Ed25519 key


def _distance(key: bytes, peer: ID) -> int:
    target = int.from_bytes(hashlib.sha256(key).digest(), "big")
    return target ^ int.from_bytes(hashlib.sha256(peer.to_bytes()).digest(), "big")


def _made_up(key: bytes, count: int) -> list[ID]:
    """Ids nobody holds, ground to be closer to ``key`` than any honest one here."""
    ids = [ID(_ED25519_ID + os.urandom(32)) for _ in range(3000)]
    return sorted(ids, key=lambda p: _distance(key, p))[:count]


class _Swarm:
    """Honest peers that each know everyone; ``liar`` names made-up peers, all at
    ``fake_addrs`` (round robin), and no made-up peer can be reached."""

    def __init__(self, size: int, fake_addrs: list[str], *, lying: bool = True) -> None:
        self.lying = lying
        self.honest = [ID(_ED25519_ID + os.urandom(32)) for _ in range(size)]
        self.me = self.honest[0]
        self.liar = ID(_ED25519_ID + os.urandom(32))
        self.fake_addrs = fake_addrs
        self.asked: list[tuple[ID, tuple[str, ...]]] = []
        self.made_up: set[ID] = set()

    def addr(self, peer: ID) -> str:
        everyone = [*self.honest, self.liar]
        return f"/ip4/10.0.0.{everyone.index(peer) + 1}/tcp/4001"

    async def ask(self, peer: ID, addrs: tuple[str, ...], key: bytes = KEY) -> Answer:
        self.asked.append((peer, addrs))
        await trio.lowlevel.checkpoint()
        if peer in self.made_up:
            return Answer(False, None)
        if peer == self.liar and self.lying:
            fakes = _made_up(key, 20)
            self.made_up.update(fakes)
            addrs_ = self.fake_addrs
            return Answer(
                True, [Referral(f, (addrs_[i % len(addrs_)],)) for i, f in enumerate(fakes)]
            )
        everyone = [*self.honest, self.liar]
        return Answer(True, [Referral(p, (self.addr(p),)) for p in everyone if p != peer])

    async def look(self, memory: LookupMemory, key: bytes = KEY, count: int = 5) -> list[ID]:
        result = await walk(
            key,
            count,
            [self.liar, *self.honest[1:3]],
            lambda peer, addrs: self.ask(peer, addrs, key),
            self_id=self.me,
            known=lambda peer: peer in (self.liar, *self.honest[1:3]),
            memory=memory,
        )
        return result.closest

    def fake_dials(self) -> int:
        return sum(1 for peer, _ in self.asked if peer in self.made_up)


def _truly_closest(swarm: _Swarm, key: bytes, count: int) -> list[ID]:
    real = [p for p in (*swarm.honest, swarm.liar) if p != swarm.me]
    return sorted(real, key=lambda p: _distance(key, p))[:count]


async def test_made_up_peers_are_never_found_and_one_address_is_dialled_once() -> None:
    swarm = _Swarm(12, ["/ip4/127.0.0.1/tcp/9"])
    found = await swarm.look(LookupMemory())
    assert found == _truly_closest(swarm, KEY, 5)
    # twenty made-up peers at one address: one dial, and the address is then dead
    assert swarm.fake_dials() == 1


async def test_a_referrer_whose_peers_cannot_be_reached_stops_being_heard() -> None:
    addrs = [f"/ip4/127.0.0.1/tcp/{port}" for port in range(2000, 2040)]
    swarm = _Swarm(12, addrs)
    memory = LookupMemory()
    found = await swarm.look(memory)
    assert found == _truly_closest(swarm, KEY, 5)
    first = swarm.fake_dials()
    assert 1 <= first <= 5  # one round of the 5 closest at most, before strikes count
    assert memory.distrusted(swarm.liar)
    for n in range(10):  # later lookups, other keys: the liar's names go unheard
        key = f"ffn.{n}.".encode()
        assert await swarm.look(memory, key) == _truly_closest(swarm, key, 5)
    assert swarm.fake_dials() == first


async def test_distrust_and_dead_addresses_are_forgotten_after_a_while() -> None:
    now = [0.0]
    memory = LookupMemory(clock=lambda: now[0])
    peer = ID(_ED25519_ID + os.urandom(32))
    for _ in range(lookup._STRIKES):
        memory.referral_failed(peer)
    memory.mark_dead(["/ip4/127.0.0.1/tcp/9"])
    assert memory.distrusted(peer)
    assert memory.address_dead("/ip4/127.0.0.1/tcp/9")
    now[0] = SUSPECT_S + 1
    assert not memory.distrusted(peer)
    assert not memory.address_dead("/ip4/127.0.0.1/tcp/9")


def test_answered_referrals_outweigh_a_few_failures() -> None:
    """Churn: an honest peer names a few peers that just left; it stays heard."""
    memory = LookupMemory()
    peer = ID(_ED25519_ID + os.urandom(32))
    for _ in range(10):
        memory.referral_answered(peer)
    for _ in range(5):
        memory.referral_failed(peer)
    assert not memory.distrusted(peer)


def test_suspicion_stays_bounded_under_a_flood() -> None:
    memory = LookupMemory()
    for n in range(lookup._REMEMBERED + 500):
        memory.mark_dead([f"/ip4/127.0.0.1/tcp/{n % 65535 + 1}/{n}"])
        memory.referral_failed(ID(n.to_bytes(4, "big")))
    assert len(memory._dead) == len(memory._record) == lookup._REMEMBERED


async def test_a_peer_that_fails_gives_way_to_the_next_closest() -> None:
    swarm = _Swarm(12, ["/ip4/127.0.0.1/tcp/9"])
    gone = _truly_closest(swarm, KEY, 1)[0]
    honest_ask = swarm.ask

    async def ask(peer: ID, addrs: tuple[str, ...], key: bytes = KEY) -> Answer:
        if peer == gone:
            return Answer(False, None)
        return await honest_ask(peer, addrs, key)

    swarm.ask = ask  # type: ignore[method-assign]
    found = await swarm.look(LookupMemory())
    assert gone not in found
    assert found == [p for p in _truly_closest(swarm, KEY, 6) if p != gone]


async def test_known_peers_are_asked_without_a_referrers_addresses() -> None:
    """What a third party says about a peer this node already knows is not dialled."""
    swarm = _Swarm(6, ["/ip4/127.0.0.1/tcp/9"])
    await swarm.look(LookupMemory())
    known = set(swarm.honest[1:3]) | {swarm.liar}
    assert all(peer not in known or addrs == () for peer, addrs in swarm.asked)


async def test_a_first_referrer_cannot_crowd_out_a_peers_real_address() -> None:
    """The liar names a real peer this node does not know yet, with eight addresses of
    its own choosing, before an honest peer names it with its real one: the real one is
    still among those dialled."""
    swarm = _Swarm(12, ["/ip4/127.0.0.1/tcp/9"], lying=False)
    # an honest start peer farther from the key than the liar: answers are read in
    # distance order, so the liar's comes first
    honest = max(swarm.honest[1:], key=lambda p: _distance(KEY, p))
    while _distance(KEY, swarm.liar) > _distance(KEY, honest):
        swarm.liar = ID(_ED25519_ID + os.urandom(32))
    target = min(swarm.honest[1:], key=lambda p: _distance(KEY, p))  # neither of them
    bogus = tuple(f"/ip4/127.0.0.1/tcp/{port}" for port in range(3000, 3008))
    honest_ask = swarm.ask

    async def ask(peer: ID, addrs: tuple[str, ...], key: bytes = KEY) -> Answer:
        answer = await honest_ask(peer, addrs, key)
        if peer == swarm.liar and answer.referrals is not None:
            return Answer(True, [Referral(target, bogus)])
        return answer

    swarm.ask = ask  # type: ignore[method-assign]
    result = await walk(
        KEY,
        5,
        [swarm.liar, honest],
        swarm.ask,
        self_id=swarm.me,
        known=lambda peer: peer in (swarm.liar, honest),
        memory=LookupMemory(),
    )
    [(_, dialled)] = [(p, addrs) for p, addrs in swarm.asked if p == target]
    # in turns: the liar's first, the honest peer's first, then the liar's others
    assert dialled[:2] == (bogus[0], swarm.addr(target))
    assert target in result.closest


async def test_a_referrer_answers_only_for_the_addresses_it_gave() -> None:
    """Peers the liar names first at dead addresses are reached at the address an
    honest referrer gives: the liar is blamed for each, the honest referrer is not, and
    only the addresses that were dialled and failed are held dead."""
    swarm = _Swarm(12, ["/ip4/127.0.0.1/tcp/9"], lying=False)
    honest = max(swarm.honest[1:], key=lambda p: _distance(KEY, p))
    while _distance(KEY, swarm.liar) > _distance(KEY, honest):
        swarm.liar = ID(_ED25519_ID + os.urandom(32))
    bogus = {p: (f"/ip4/127.0.0.2/tcp/{3000 + i}",) for i, p in enumerate(swarm.honest)}
    honest_ask = swarm.ask

    async def ask(peer: ID, addrs: tuple[str, ...], key: bytes = KEY) -> Answer:
        answer = await honest_ask(peer, addrs, key)
        if peer == swarm.liar and answer.referrals is not None:
            return Answer(True, [Referral(p, bogus[p]) for p in swarm.honest if p != swarm.me])
        if addrs:  # a stranger, dialled at each address in turn: only its own connects
            real = swarm.addr(peer)
            return Answer(True, answer.referrals, real, tuple(a for a in addrs if a != real))
        return answer

    memory = LookupMemory()
    result = await walk(
        KEY,
        5,
        [swarm.liar, honest],
        ask,
        self_id=swarm.me,
        known=lambda peer: peer in (swarm.liar, honest),
        memory=memory,
    )
    assert result.closest == _truly_closest(swarm, KEY, 5)
    assert memory.distrusted(swarm.liar)
    assert not memory.distrusted(honest)
    dialled = {a for _, addrs in swarm.asked for a in addrs}
    assert all(memory.address_dead(b) for (b,) in bogus.values() if b in dialled)
    assert not any(memory.address_dead(swarm.addr(p)) for p in swarm.honest)


def _answer(peers: list[tuple[bytes, list[bytes]]]) -> Message:
    message = Message(type=Message.MessageType.FIND_NODE, key=KEY)
    for raw, addrs in peers:
        peer = message.closerPeers.add()
        peer.id = raw
        peer.addrs.extend(addrs)
    return message


def _packed(text: str) -> bytes:
    return bytes(multiaddr.Multiaddr(text).to_bytes())


def test_an_answer_keeps_only_peer_ids_and_addresses_a_peer_may_dial() -> None:
    real = peer_id_for(Identity.generate())
    relay = peer_id_for(Identity.generate())
    message = _answer(
        [
            (
                real.to_bytes(),
                [
                    _packed("/ip4/10.1.2.3/tcp/4001"),
                    _packed(f"/ip4/10.1.2.4/tcp/4002/p2p/{real}"),  # suffix dropped
                    _packed("/ip4/0.0.0.0/tcp/4001"),  # unspecified
                    _packed("/ip4/224.0.0.1/tcp/4001"),  # multicast
                    _packed("/ip4/10.1.2.3/udp/4001"),  # not TCP
                    _packed(f"/ip4/10.1.2.5/tcp/1/p2p/{relay}/p2p-circuit"),  # not direct
                    b"\xff\xff\xff",  # not an address
                ],
            ),
            # not a multihash: sha2-256 says 32 bytes follow, 36 do (random bytes, as
            # here before, passed for one once in ~230: any code, a length that fits)
            (bytes([0x12, 0x20]) + bytes(36), [_packed("/ip4/10.1.2.3/tcp/4001")]),
            (b"", [_packed("/ip4/10.1.2.3/tcp/4001")]),
        ]
    )
    [referral] = referrals_of(message, KEY)
    assert referral == Referral(real, ("/ip4/10.1.2.3/tcp/4001", "/ip4/10.1.2.4/tcp/4002"))


def test_an_answer_names_at_most_twenty_peers_with_eight_addresses_each() -> None:
    many = [ID(_ED25519_ID + os.urandom(32)) for _ in range(300)]
    addrs = [_packed(f"/ip4/10.0.0.1/tcp/{port}") for port in range(1, 40)]
    referrals = referrals_of(_answer([(p.to_bytes(), addrs) for p in many]), KEY)
    assert [r.peer_id for r in referrals] == sorted(many, key=lambda p: _distance(KEY, p))[:20]
    assert all(len(r.addrs) == 8 for r in referrals)


@pytest.mark.parametrize("count", [1, 5, 20])
async def test_in_an_honest_swarm_the_lookup_finds_the_truly_closest(count: int) -> None:
    swarm = _Swarm(30, ["/ip4/127.0.0.1/tcp/9"], lying=False)
    result = await walk(
        KEY,
        count,
        swarm.honest[1:3],
        swarm.ask,
        self_id=swarm.me,
        known=lambda peer: peer in swarm.honest[1:3],
        memory=LookupMemory(),
    )
    truly = _truly_closest(swarm, KEY, count)
    # a walk of more than ALPHA peers may end (as py-libp2p's does) at a round that
    # changed nothing, before it asked them all: it finds those it asked
    assert result.closest == [p for p in truly if p in result.closest]
    assert len(result.closest) >= min(count, lookup.ALPHA)
    assert result.failed == 0
