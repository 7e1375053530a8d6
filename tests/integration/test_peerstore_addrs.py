"""A stranger's claimed addresses cannot eclipse newcomers: what a node stores of them
and what its Kademlia answers hand on are bounded (net/peerstore.py, net/kademlia.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import multiaddr
import pytest
import trio
from libp2p.abc import IHost, INetStream
from libp2p.identity.identify.identify import ID as IDENTIFY
from libp2p.identity.identify.identify import _mk_identify_protobuf
from libp2p.identity.identify_push.identify_push import push_identify_to_peer
from libp2p.kad_dht.common import MAX_DHT_MESSAGE_SIZE, PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import PeerStore, create_signed_peer_record
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

from volunteerd.identity import Identity
from volunteerd.net import Node
from volunteerd.net.host import open_host
from volunteerd.net.peers import key_pair_for
from volunteerd.net.peerstore import MAX_ADDRS_PER_PEER, usable_addr
from volunteerd.testing import local_config, open_peer

pytestmark = pytest.mark.slow

# What readers take of a Kademlia answer (net/lookup.py).
READER_LIMIT = 64 * 1024
# Addresses as the probe's: a valid 243-character DNS name, ~250 bytes each; 300 of
# them (~76 KB) are more than readers take of an answer.
LONG_NAME = ".".join(["a" * 60] * 4)
FAT = [multiaddr.Multiaddr(f"/dns4/{LONG_NAME}/tcp/{port}") for port in range(1, 301)]
HONEST_PEERS = 5


def _claiming(host: IHost, listen: Sequence[multiaddr.Multiaddr], record: bytes = b"") -> Any:
    """An identify handler for ``host`` that claims ``listen`` as its listen addresses
    and sends ``record`` as its signed peer record (none if empty)."""

    async def identify(stream: INetStream) -> None:
        message = _mk_identify_protobuf(host, None)
        del message.listen_addrs[:]
        message.listen_addrs.extend(addr.to_bytes() for addr in listen)
        message.ClearField("signedPeerRecord")
        if record:
            message.signedPeerRecord = record
        with contextlib.suppress(Exception):
            await stream.write(encode_varint_prefixed(message.SerializeToString()))
            await stream.close()

    return identify


async def _find_node(asker: IHost, node: IHost, key: bytes) -> tuple[int, Message]:
    """``node``'s answer to a FIND_NODE for ``key``: its size in bytes and the message,
    read with py-libp2p's own limit (4 MiB), not a reader's."""
    stream = await asker.new_stream(node.get_id(), [PROTOCOL_ID])
    try:
        request = Message(type=Message.MessageType.FIND_NODE, key=key)
        await stream.write(encode_varint_prefixed(request.SerializeToString()))
        raw = await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
    finally:
        with contextlib.suppress(Exception):
            await stream.close()
    answer = Message()
    answer.ParseFromString(raw)
    return len(raw), answer


def _stored(node: Node, peer_id: ID) -> list[multiaddr.Multiaddr]:
    try:
        return list(node.host.get_peerstore().addrs(peer_id))
    except Exception:  # py-libp2p raises for a peer it keeps nothing of
        return []


@asynccontextmanager
async def _swarm(stack: AsyncExitStack) -> AsyncIterator[tuple[Node, list[Node]]]:
    """A bootstrap node and ``HONEST_PEERS`` nodes that joined through it, all in its
    routing table."""
    boot = await stack.enter_async_context(open_peer(local_config()))
    joining = local_config(bootstrap=boot.multiaddrs)
    honest = [await stack.enter_async_context(open_peer(joining)) for _ in range(HONEST_PEERS)]
    table = boot.dht._kad.routing_table
    with trio.fail_after(30):
        while not {n.host.get_id() for n in honest} <= set(table.get_peer_ids()):  # noqa: ASYNC110 - polling
            await trio.sleep(0.1)
    yield boot, honest


@asynccontextmanager
async def _stranger(
    boot: Node,
    listen: Sequence[multiaddr.Multiaddr],
    record: bytes = b"",
    identity: Identity | None = None,
) -> AsyncIterator[IHost]:
    """A bare host that claims ``listen`` (and ``record``) in identify, connects to
    ``boot`` and asks it one FIND_NODE, so that ``boot`` puts it in its routing table
    as the probe's attacker did."""
    async with open_host(identity or Identity.generate(), None) as host:
        host.set_stream_handler(IDENTIFY, _claiming(host, listen, record))
        boot_addrs = [multiaddr.Multiaddr(a) for a in boot.addrs]
        await host.connect(PeerInfo(boot.host.get_id(), boot_addrs))
        with trio.fail_after(30):
            await _find_node(host, boot.host, host.get_id().to_bytes())
        # identify has run on boot's side once it holds the claimed protocols
        with trio.fail_after(30):
            while not boot.host.get_peerstore().get_protocols(host.get_id()):  # noqa: ASYNC110 - polling
                await trio.sleep(0.05)
        yield host


async def test_a_stranger_claiming_long_addresses_does_not_eclipse_newcomers() -> None:
    """The probe: a stranger claimed many addresses of ~250 bytes or more (/dns4/<243-
    character name>/tcp/N) and asked the bootstrap node one FIND_NODE. py-libp2p stored
    them all and copied them into every answer naming the stranger (~76 KB here, 103 KB
    in the probe): past what readers take, so a newcomer joining through the node learnt
    no one else, for the two hours the addresses lived. The node now keeps at most 8
    dialable addresses of the stranger, its answers stay small, and the newcomer finds
    the honest peers."""
    claimed = [
        *FAT[:150],
        *(multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}") for port in range(1, 21)),
        *FAT[150:],
    ]
    async with AsyncExitStack() as stack:
        boot, honest = await stack.enter_async_context(_swarm(stack))
        stranger = await stack.enter_async_context(_stranger(boot, claimed))
        newcomer = await stack.enter_async_context(
            open_peer(local_config(bootstrap=boot.multiaddrs))
        )
        wanted = {n.host.get_id() for n in honest}
        table = newcomer.dht._kad.routing_table
        for _ in range(3):  # a lookup on a busy machine may miss a peer; three do not
            if wanted <= set(table.get_peer_ids()):
                break
            with trio.fail_after(30):
                await newcomer.dht._kad.peer_routing.find_closest_peers_network(
                    newcomer.host.get_id().to_bytes()
                )
        assert wanted <= set(table.get_peer_ids()), "the newcomer knows every honest peer"

        with trio.fail_after(30):
            size, answer = await _find_node(newcomer.host, boot.host, stranger.get_id().to_bytes())
        assert size < 8 * 1024  # 6 peers with a few addresses each
        named = {ID(peer.id): peer for peer in answer.closerPeers}
        assert stranger.get_id() in named
        assert len(named[stranger.get_id()].addrs) <= MAX_ADDRS_PER_PEER

        stored = _stored(boot, stranger.get_id())
        assert 0 < len(stored) <= MAX_ADDRS_PER_PEER
        assert all(usable_addr(addr) for addr in stored)


async def test_a_fat_signed_peer_record_is_neither_kept_nor_handed_on() -> None:
    """A signed peer record is handed on whole in every answer naming its peer: one
    with 300 long addresses (~76 KB) is refused, and one with many dialable addresses
    leaves at most 8 of them stored."""
    async with AsyncExitStack() as stack:
        boot, honest = await stack.enter_async_context(_swarm(stack))
        identity = Identity.generate()
        key_pair = key_pair_for(identity)
        me = ID.from_pubkey(key_pair.public_key)
        fat = create_signed_peer_record(me, FAT, key_pair.private_key).marshal_envelope()
        loopback = [multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}") for port in range(1, 41)]
        stranger = await stack.enter_async_context(
            _stranger(boot, loopback[:2], fat, identity=identity)
        )
        assert boot.host.get_peerstore().get_peer_record(me) is None
        assert len(_stored(boot, me)) == 2
        with trio.fail_after(30):
            size, _ = await _find_node(honest[0].host, boot.host, me.to_bytes())
        assert size < 8 * 1024

        many = create_signed_peer_record(me, loopback, key_pair.private_key)
        assert boot.host.get_peerstore().consume_peer_record(many, 7200)
        stored = _stored(boot, stranger.get_id())
        assert len(stored) == MAX_ADDRS_PER_PEER
        assert set(stored) <= set(loopback)


async def test_a_kademlia_answer_stays_within_what_readers_take() -> None:
    """Whatever the peerstore holds (here 300 long addresses written past its bounds,
    straight into py-libp2p's store), an answer names each peer with at most 8 dialable
    addresses and stays under the readers' 64 KiB: honest peers are still named."""
    async with AsyncExitStack() as stack:
        boot, honest = await stack.enter_async_context(_swarm(stack))
        stranger = await stack.enter_async_context(
            _stranger(boot, [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/1")])
        )
        peerstore = boot.host.get_peerstore()
        dialable = [multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}") for port in range(2, 40)]
        PeerStore.add_addrs(peerstore, stranger.get_id(), [*FAT, *dialable], 7200)  # type: ignore[arg-type]
        with trio.fail_after(30):
            size, answer = await _find_node(honest[0].host, boot.host, stranger.get_id().to_bytes())
        assert size <= READER_LIMIT
        named = {ID(peer.id): peer for peer in answer.closerPeers}
        assert {n.host.get_id() for n in honest[1:]} <= set(named)
        for peer in answer.closerPeers:
            assert len(peer.addrs) <= MAX_ADDRS_PER_PEER
            assert all(usable_addr(multiaddr.Multiaddr(raw)) for raw in peer.addrs)


async def test_strangers_pushing_an_identify_without_addresses_leave_bounded_entries() -> None:
    """A stranger listening nowhere that pushes an identify (key and protocols, no
    address) left an entry in the node's peer store for good: py-libp2p checked its
    bound only when an address was stored (200 such strangers, 201 entries against a
    bound of 50). Entries now stay within ``max_peers``; the node's own and a connected
    peer's are kept."""
    async with open_host(Identity.generate(), "/ip4/127.0.0.1/tcp/0") as node:
        peerstore = node.get_peerstore()
        peerstore.max_peers = 10
        node_info = PeerInfo(node.get_id(), node.get_addrs())
        async with open_host(Identity.generate(), None) as staying:
            await staying.connect(node_info)
            await push_identify_to_peer(staying, node.get_id())
            for _ in range(25):
                async with open_host(Identity.generate(), None) as stranger:
                    await stranger.connect(node_info)
                    assert await push_identify_to_peer(stranger, node.get_id())
                    with trio.fail_after(30):
                        while not peerstore.has_peer(stranger.get_id()):  # noqa: ASYNC110 - polling
                            await trio.sleep(0.02)
                assert len(peerstore.peer_data_map) <= 10
            assert peerstore.get_protocols(staying.get_id())
        assert peerstore.pubkey(node.get_id()) == node.get_public_key()
