"""Kademlia over real libp2p keeps nothing for others: volunteerd routes with it only."""

from __future__ import annotations

import os

import multiaddr
import pytest
import trio
import varint
from libp2p.kad_dht.common import MAX_DHT_MESSAGE_SIZE, PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.utils.varint import read_varint_prefixed_bytes_limited

from volunteerd.testing import local_config, open_peer

pytestmark = pytest.mark.slow


def _add_provider(sender_id: bytes, key: bytes) -> bytes:
    """An ADD_PROVIDER naming its sender (the only provider py-libp2p accepts) with
    many addresses: what a node that serves providers keeps for 48 h."""
    message = Message()
    message.type = Message.MessageType.ADD_PROVIDER
    message.key = key
    provider = message.providerPeers.add()
    provider.id = sender_id
    provider.addrs.extend(
        multiaddr.Multiaddr(f"/ip4/10.0.{j >> 8}.{j & 255}/tcp/1").to_bytes() for j in range(1000)
    )
    data = message.SerializeToString()
    return bytes(varint.encode(len(data))) + data


async def test_an_add_provider_message_is_not_stored() -> None:
    async with (
        open_peer(local_config()) as victim,
        open_peer(local_config(bootstrap=victim.multiaddrs)) as sender,
    ):
        await sender.rpc.connect(victim.address)
        providers = victim.dht._kad.provider_store.providers
        for _ in range(3):
            stream = await sender.host.new_stream(victim.host.get_id(), [PROTOCOL_ID])
            await stream.write(_add_provider(sender.host.get_id().to_bytes(), os.urandom(32)))
            with trio.move_on_after(5):
                try:
                    await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
                except Exception:  # refused: the stream is reset
                    pass
            await stream.close()
        await trio.sleep(0.5)
        assert providers == {}
        # Kademlia's routing still works between them.
        closest = await sender.dht._kad.peer_routing.find_closest_peers_network(b"ffn.0.")
        assert victim.host.get_id() in closest
