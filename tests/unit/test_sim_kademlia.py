"""The Kademlia cost model against py-libp2p's routing table and the lookup code of
``net/lookup.py`` (and py-libp2p's own, where both must agree)."""

from __future__ import annotations

import random

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht import common, peer_routing
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.kad_dht.peer_routing import PeerRouting
from libp2p.kad_dht.routing_table import KBucket, RoutingTable
from libp2p.peer.envelope import seal_record
from libp2p.peer.id import ID
from libp2p.peer.peer_record import PeerRecord
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr
from trio.testing import MockClock

from volunteerd.config import DHTConfig
from volunteerd.net.lookup import Answer, LookupMemory, Referral, walk
from volunteerd.sim import kademlia
from volunteerd.sim.kademlia import (
    ALPHA,
    BUCKET_SIZE,
    FIND_NODE_REPLY_BYTES,
    FIND_NODE_REQUEST_BYTES,
    MAX_LOOKUP_ROUNDS,
    MAXIMUM_BUCKETS,
    KademliaModel,
    Lookup,
    lookup_cost,
    store_messages,
)


def test_constants_are_py_libp2ps() -> None:
    assert BUCKET_SIZE == common.BUCKET_SIZE
    assert ALPHA == common.ALPHA
    assert MAXIMUM_BUCKETS == common.MAXIMUM_BUCKETS
    assert MAX_LOOKUP_ROUNDS == peer_routing.MAX_PEER_LOOKUP_ROUNDS


def _signed_peer(seed: int) -> tuple[ID, list[Multiaddr], bytes]:
    keys = create_new_key_pair(random.Random(seed).randbytes(32))
    peer_id = ID.from_pubkey(keys.public_key)
    addrs = [
        Multiaddr("/ip4/203.0.113.7/tcp/40123"),
        Multiaddr("/ip4/203.0.113.7/udp/40123/quic-v1"),
    ]
    return (
        peer_id,
        addrs,
        seal_record(PeerRecord(peer_id, addrs), keys.private_key).marshal_envelope(),
    )


def test_message_sizes_cover_py_libp2ps_messages_and_little_more() -> None:
    _, _, own_record = _signed_peer(0)
    request = Message(
        type=Message.MessageType.FIND_NODE, key=b"expert.12.34", senderRecord=own_record
    )
    reply = Message(type=Message.MessageType.FIND_NODE, key=request.key, senderRecord=own_record)
    for seed in range(1, BUCKET_SIZE + 1):
        peer_id, addrs, record = _signed_peer(seed)
        reply.closerPeers.add(
            id=peer_id.to_bytes(), addrs=[a.to_bytes() for a in addrs], signedRecord=record
        )
    request_bytes, reply_bytes = len(request.SerializeToString()), len(reply.SerializeToString())
    assert request_bytes < FIND_NODE_REQUEST_BYTES < request_bytes + 150
    assert reply_bytes < FIND_NODE_REPLY_BYTES < reply_bytes + 400


# -- py-libp2p's lookup, run over the model's tables --------------------------------------


class _Host:
    def __init__(self, peer_id: ID) -> None:
        self._peer_id = peer_id

    def get_id(self) -> ID:
        return self._peer_id

    def get_connected_peers(self) -> list[ID]:
        return []


class _Table:
    """The origin's routing table: the model's."""

    def __init__(self, model: KademliaModel, origin: int) -> None:
        self._model, self._origin = model, origin

    def find_local_closest_peers(self, key: bytes, count: int = 20) -> list[ID]:
        target = self._model.target(key)
        return [
            ID(self._model.peer_id(n))
            for n in self._model.closest_known(self._origin, target, count)
        ]


class _ModelNetwork(PeerRouting):
    """py-libp2p's PeerRouting of ``origin`` whose FIND_NODE answers come from the
    model's tables, each after one (virtual) second: a lookup's seconds are its rounds."""

    def __init__(self, model: KademliaModel, origin: int, index: dict[bytes, int]) -> None:
        super().__init__(_Host(ID(model.peer_id(origin))), _Table(model, origin))  # type: ignore[arg-type]
        self._model, self._origin, self._index = model, origin, index
        self.requests = 0

    async def _query_peer_for_closest(self, peer: ID, target_key: bytes) -> list[ID]:
        self.requests += 1
        await trio.sleep(1)
        known = self._model.closest_known(
            self._index[peer.to_bytes()], self._model.target(target_key), common.BUCKET_SIZE
        )
        # as py-libp2p's own reader does: the asker is never among the results
        return [ID(self._model.peer_id(n)) for n in known if n != self._origin]


def _py_libp2p_lookup(
    model: KademliaModel, index: dict[bytes, int], origin: int, key: bytes, count: int
) -> Lookup:
    network = _ModelNetwork(model, origin, index)

    async def run() -> tuple[float, list[ID]]:
        start = trio.current_time()
        found = await network.find_closest_peers_network(key, count=count)
        return trio.current_time() - start, found

    seconds, found = trio.run(run, clock=MockClock(autojump_threshold=0))
    return Lookup(round(seconds), network.requests, tuple(index[p.to_bytes()] for p in found))


def _our_lookup(
    model: KademliaModel, index: dict[bytes, int], origin: int, key: bytes, count: int
) -> Lookup:
    """``net/lookup.walk`` from ``origin``, its FIND_NODE answers from the model's
    tables, each after one (virtual) second."""
    requests = 0

    async def ask(peer: ID, addrs: tuple[str, ...]) -> Answer:
        nonlocal requests
        requests += 1
        await trio.sleep(1)
        known = model.closest_known(index[peer.to_bytes()], model.target(key), BUCKET_SIZE)
        return Answer(True, [Referral(ID(model.peer_id(n)), ()) for n in known if n != origin])

    start = [ID(model.peer_id(n)) for n in model.closest_known(origin, model.target(key), count)]

    async def run() -> tuple[float, list[ID]]:
        begin = trio.current_time()
        result = await walk(
            key,
            count,
            start,
            ask,
            self_id=ID(model.peer_id(origin)),
            known=lambda peer: True,
            memory=LookupMemory(),
        )
        return trio.current_time() - begin, result.closest

    seconds, found = trio.run(run, clock=MockClock(autojump_threshold=0))
    return Lookup(round(seconds), requests, tuple(index[p.to_bytes()] for p in found))


@pytest.mark.parametrize("nodes", [300, 30_000])
def test_lookup_takes_the_rounds_requests_and_result_of_the_lookup_code(nodes: int) -> None:
    """py-libp2p's lookup and ours (net/lookup.walk) take the model's steps; ours finds
    the peers among the model's result that it asked (all of them when ``count`` is at
    most ALPHA, as for records: a lookup of 20 may end with some of them not asked)."""
    model = KademliaModel(nodes, seed=3)
    index = {model.peer_id(n): n for n in range(nodes)}
    rng = random.Random(4)
    hops = []
    for count in (DHTConfig().replication, BUCKET_SIZE):
        for _ in range(15):
            key, origin = rng.randbytes(16), rng.randrange(nodes)
            modelled = model.lookup(origin, model.target(key), count=count)
            assert modelled == _py_libp2p_lookup(model, index, origin, key, count)
            ours = _our_lookup(model, index, origin, key, count)
            assert (ours.hops, ours.messages) == (modelled.hops, modelled.messages)
            assert ours.closest == tuple(n for n in modelled.closest if n in ours.closest)
            if count <= ALPHA:
                assert ours == modelled
            hops.append(modelled.hops)
    if nodes > 10_000:  # the tables are partial: lookups need several rounds
        assert max(hops) >= 3


def test_tables_fill_as_py_libp2ps_routing_table_does() -> None:
    """A py-libp2p RoutingTable that meets every node of a 6,000-node swarm (its full
    buckets' oldest peers answering their pings) holds as many as the model's tables."""
    model = KademliaModel(6_000, seed=2)

    async def alive(self: KBucket, peer_id: ID) -> bool:
        return True

    addrs = [Multiaddr("/ip4/127.0.0.1/tcp/4001")]  # loopback: no subnet-diversity cap

    async def fill() -> RoutingTable:
        table = RoutingTable(ID(model.peer_id(0)), host=None)  # type: ignore[arg-type]
        order = list(range(1, model.nodes))
        random.Random(5).shuffle(order)
        for n in order:
            await table.add_peer(PeerInfo(ID(model.peer_id(n)), addrs), skip_server_mode_check=True)
        return table

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(KBucket, "_ping_peer", alive)
        real = trio.run(fill)
    assert len(real.buckets) == MAXIMUM_BUCKETS
    modelled = [len(model.table(n)) for n in range(40)]
    mean = sum(modelled) / len(modelled)
    assert mean < model.nodes - 1  # the tables are full, not everyone is known
    assert abs(real.size() - mean) < 0.04 * mean


def test_closest_known_is_the_closest_of_the_table() -> None:
    model = KademliaModel(20_000, seed=1)
    rng = random.Random(2)
    for node in (0, 777, 19_999):
        table = model.table(node)
        assert node not in table
        assert len(table) <= MAXIMUM_BUCKETS * BUCKET_SIZE
        for _ in range(20):
            target = model.target(rng.randbytes(8))
            expected = sorted(table, key=lambda n: model.keys[n] ^ target)[:BUCKET_SIZE]
            assert model.closest_known(node, target, BUCKET_SIZE) == expected


def test_small_swarms_know_everyone_and_find_in_one_round() -> None:
    cost = lookup_cost(500, samples=30)
    assert KademliaModel(500).table(7) == [n for n in range(500) if n != 7]
    assert (cost.hops_mean, cost.hops_p95) == (1.0, 1.0)
    assert cost.messages_mean == DHTConfig().replication
    assert cost.found_closest == cost.found_record == 1.0


def test_lookups_cost_more_when_tables_hold_a_share_of_the_swarm() -> None:
    small = lookup_cost(1_000, samples=40)
    large = lookup_cost(40_000, samples=40)
    assert large.hops_mean > small.hops_mean
    assert large.messages_mean > small.messages_mean
    assert large.hops_p95 <= MAX_LOOKUP_ROUNDS
    assert large.found_closest < 1.0


def test_deterministic_given_seed() -> None:
    uncached = lookup_cost.__wrapped__
    assert uncached(20_000, samples=20, seed=5) == uncached(20_000, samples=20, seed=5)
    assert KademliaModel(50, seed=5).keys == KademliaModel(50, seed=5).keys
    assert KademliaModel(50, seed=5).keys != KademliaModel(50, seed=6).keys


def test_store_is_a_lookup_plus_one_request_per_replica() -> None:
    assert store_messages(1_000, 5) == lookup_cost(1_000, count=5).messages_mean + 5 == 10
    assert kademlia.find_messages(1_000, 5) == store_messages(1_000, 5)


def test_lookup_needs_two_nodes() -> None:
    with pytest.raises(ValueError):
        KademliaModel(1)
