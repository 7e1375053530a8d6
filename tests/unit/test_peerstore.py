"""What the node's peer store keeps of a peer's addresses (net/peerstore.py)."""

from __future__ import annotations

import os
import time

import pytest
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.identity.update import update_peerstore_from_identify
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import create_signed_peer_record
from multiaddr import Multiaddr

from volunteerd.identity import Identity
from volunteerd.net.host import build_host
from volunteerd.net.peers import key_pair_for, peer_id_for
from volunteerd.net.peerstore import MAX_ADDRS_PER_PEER, NodePeerStore, usable_addr

ME = Identity.generate()
OWN = peer_id_for(ME)
PEER = peer_id_for(Identity.generate())
RELAY = peer_id_for(Identity.generate())
LONG_NAME = ".".join(["a" * 60] * 4)
CIRCUIT = f"/ip4/203.0.113.5/tcp/38400/p2p/{RELAY}/p2p-circuit"
_ED25519_ID = b"\x00\x24\x08\x01\x12\x20"  # an identity multihash of an Ed25519 key


def _addrs(count: int, first_port: int = 1) -> list[Multiaddr]:
    return [
        Multiaddr(f"/ip4/127.0.0.1/tcp/{port}") for port in range(first_port, first_port + count)
    ]


def _stored(store: NodePeerStore, peer: ID = PEER) -> list[str]:
    return [str(a) for a in store.addrs(peer)]


@pytest.mark.parametrize(
    "addr",
    [
        "/ip4/127.0.0.1/tcp/38400",
        "/ip4/192.168.1.5/tcp/1",
        "/ip6/::1/tcp/2",
        f"/ip4/10.0.0.2/tcp/4001/p2p/{PEER}",
        CIRCUIT,
        f"{CIRCUIT}/p2p/{PEER}",
    ],
    # the peer ids are made afresh in each process: ids that every xdist worker agrees on
    ids=["loopback", "private", "ip6", "with-own-id", "circuit", "circuit-with-id"],
)
def test_usable_addresses_are_direct_tcp_or_circuits(addr: str) -> None:
    assert usable_addr(Multiaddr(addr))


@pytest.mark.parametrize(
    "addr",
    [
        f"/dns4/{LONG_NAME}/tcp/1",
        "/dns4/boot.example.org/tcp/38400",
        "/ip4/127.0.0.1/udp/1/quic-v1",
        "/ip4/127.0.0.1/tcp/1/tls",
        "/ip4/0.0.0.0/tcp/1",
        "/ip4/224.0.0.1/tcp/1",
        "/ip4/127.0.0.1/tcp/0",
        f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}/p2p/{PEER}",
        f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PEER}/p2p-circuit",
    ],
    ids=[
        "long-name",
        "dns",
        "quic",
        "tls",
        "unspecified",
        "multicast",
        "port-0",
        "two-ids",
        "relay-chain",
    ],
)
def test_other_addresses_are_not_usable(addr: str) -> None:
    assert not usable_addr(Multiaddr(addr))


def test_a_peer_keeps_at_most_eight_usable_addresses_the_first_that_came() -> None:
    store = NodePeerStore(OWN)
    fat = [Multiaddr(f"/dns4/{LONG_NAME}/tcp/{port}") for port in range(1, 101)]
    store.add_addrs(PEER, [*fat[:50], *_addrs(20), *fat[50:]], 7200)
    assert _stored(store) == [str(a) for a in _addrs(MAX_ADDRS_PER_PEER)]
    store.add_addr(PEER, Multiaddr("/ip4/127.0.0.1/tcp/999"), 7200)
    store.add_addrs(PEER, [Multiaddr(CIRCUIT)], 7200)
    assert len(store.addrs(PEER)) == MAX_ADDRS_PER_PEER


def test_a_peer_with_only_unusable_addresses_has_none() -> None:
    store = NodePeerStore(OWN)
    store.add_addrs(PEER, [Multiaddr(f"/dns4/{LONG_NAME}/tcp/1")], 7200)
    assert PEER not in store.peers_with_addrs()


def test_a_known_address_added_again_takes_no_room_and_refreshes_its_ttl() -> None:
    store = NodePeerStore(OWN)
    store.add_addrs(PEER, _addrs(MAX_ADDRS_PER_PEER), 60)
    store.add_addrs(PEER, _addrs(1), 7200)
    assert len(store.addrs(PEER)) == MAX_ADDRS_PER_PEER
    assert store.peer_data_map[PEER].get_ttl() == 7200


def test_expired_addresses_make_room_for_new_ones() -> None:
    store = NodePeerStore(OWN)
    store.add_addrs(PEER, _addrs(MAX_ADDRS_PER_PEER), 60)
    store.peer_data_map[PEER].last_identified = int(time.time()) - 120
    store.add_addrs(PEER, _addrs(2, first_port=100), 60)
    assert _stored(store) == [str(a) for a in _addrs(2, first_port=100)]


def test_addresses_this_node_chose_to_dial_may_be_names() -> None:
    store = NodePeerStore(OWN)
    store.add_own_addrs(PEER, [Multiaddr("/dns4/boot.example.org/tcp/38400")], 120)
    assert _stored(store) == ["/dns4/boot.example.org/tcp/38400"]
    store.add_own_addrs(PEER, _addrs(20), 120)
    assert len(store.addrs(PEER)) == MAX_ADDRS_PER_PEER


async def test_connect_dials_a_bootstrap_peer_by_the_name_it_was_given() -> None:
    host = build_host(Identity.generate())
    dialled: list[list[str]] = []

    async def dial_peer(peer_id: ID) -> list[object]:
        dialled.append([str(a) for a in host.get_peerstore().addrs(peer_id)])
        raise ConnectionError("no network in a unit test")

    host.get_network().dial_peer = dial_peer  # type: ignore[method-assign]
    boot = "/dns4/boot.example.org/tcp/38400"
    with pytest.raises(ConnectionError):
        await host.connect(PeerInfo(PEER, [Multiaddr(boot)]))
    assert dialled == [[boot]]


def test_a_signed_record_keeps_eight_usable_addresses_and_a_fat_one_is_refused() -> None:
    identity = Identity.generate()
    key_pair = key_pair_for(identity)
    peer = peer_id_for(identity)
    store = NodePeerStore(OWN)
    fat = [Multiaddr(f"/dns4/{LONG_NAME}/tcp/{port}") for port in range(1, 101)]
    refused = create_signed_peer_record(peer, fat, key_pair.private_key)
    assert not store.consume_peer_record(refused, 7200)
    assert store.get_peer_record(peer) is None

    addrs = [Multiaddr(CIRCUIT), *_addrs(20)]
    record = create_signed_peer_record(peer, addrs, key_pair.private_key)
    assert store.consume_peer_record(record, 7200)
    stored = store.addrs(peer)
    assert len(stored) == MAX_ADDRS_PER_PEER
    assert set(stored) <= set(addrs)
    assert store.get_peer_record(peer) is not None


def test_this_nodes_own_entry_is_never_evicted() -> None:
    store = NodePeerStore(OWN)
    store.add_key_pair(OWN, key_pair_for(ME))
    for _ in range(store.max_peers + 5):
        store.add_addrs(ID(_ED25519_ID + os.urandom(32)), _addrs(1), 7200)
    assert store.has_peer(OWN)


def _stranger() -> ID:
    return ID(_ED25519_ID + os.urandom(32))


async def _identified(store: NodePeerStore, identity: Identity, listen: list[Multiaddr]) -> ID:
    """What py-libp2p's identify (and identify-push) handler stores of ``identity``
    claiming ``listen``: its key, addresses and protocols."""
    key_pair = key_pair_for(identity)
    peer = ID.from_pubkey(key_pair.public_key)
    message = Identify(
        public_key=key_pair.public_key.serialize(),
        listen_addrs=[addr.to_bytes() for addr in listen],
        protocols=["/volunteerd/rpc/1", "/ipfs/id/1.0.0"],
        agent_version="stranger",
    )
    await update_peerstore_from_identify(store, peer, message)
    return peer


async def test_strangers_naming_no_usable_address_leave_at_most_max_peers_entries() -> None:
    """An identify that names no usable address stored the stranger's key and protocols
    and py-libp2p checked its bound only when an address was stored: every such
    stranger's entry stayed for good."""
    store = NodePeerStore(OWN)
    store.max_peers = 20
    store.add_key_pair(OWN, key_pair_for(ME))
    quic = [Multiaddr("/ip4/127.0.0.1/udp/1/quic-v1")]
    for _ in range(60):
        await _identified(store, Identity.generate(), quic if _ % 2 else [])
    assert len(store.peer_data_map) <= 20
    assert store.has_peer(OWN)
    assert store.pubkey(OWN) == key_pair_for(ME).public_key


def test_past_the_bound_expired_entries_go_first_then_those_without_addresses() -> None:
    store = NodePeerStore(OWN)
    store.max_peers = 10
    store.add_key_pair(OWN, key_pair_for(ME))
    expired = _stranger()
    store.add_addrs(expired, _addrs(1), 60)
    store.peer_data_map[expired].last_identified = int(time.time()) - 120
    with_addrs = [_stranger() for _ in range(4)]
    for peer in with_addrs:
        store.add_addrs(peer, _addrs(1), 7200)
    bare = [_stranger() for _ in range(5)]
    for peer in bare:
        store.add_protocols(peer, ["/volunteerd/rpc/1"])
    # the eleventh entry took the store past its bound: down to nine tenths of it
    assert len(store.peer_data_map) == 9
    assert not store.has_peer(expired)
    assert not store.has_peer(bare[0])  # the oldest of those without addresses
    assert all(store.has_peer(peer) for peer in [OWN, *with_addrs, *bare[1:]])


def test_connected_peers_and_this_node_keep_their_entries() -> None:
    store = NodePeerStore(OWN)
    store.max_peers = 10
    store.add_key_pair(OWN, key_pair_for(ME))
    connected = [_stranger() for _ in range(3)]
    store.connected = lambda peer_id: peer_id in connected
    for peer in connected:
        store.add_protocols(peer, ["/volunteerd/rpc/1"])
    for _ in range(40):
        store.add_addrs(_stranger(), _addrs(1), 7200)
        assert len(store.peer_data_map) <= 10
    assert all(store.has_peer(peer) for peer in [OWN, *connected])
