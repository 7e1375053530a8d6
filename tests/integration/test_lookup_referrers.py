"""A lookup dials the addresses every referrer gave for a peer, not only the first
referrer's, and blames only the referrers whose addresses failed (net/lookup.py)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
from contextlib import AsyncExitStack
from typing import Any

import multiaddr
import pytest
import trio
import varint
from libp2p.kad_dht.common import MAX_DHT_MESSAGE_SIZE, PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.utils.varint import read_varint_prefixed_bytes_limited

from volunteerd.testing import local_config, open_peer

pytestmark = pytest.mark.slow


def _distance(key: bytes, peer: ID) -> int:
    target = int.from_bytes(hashlib.sha256(key).digest(), "big")
    return target ^ int.from_bytes(hashlib.sha256(peer.to_bytes()).digest(), "big")


def _naming(named: dict[ID, list[str]]) -> Any:
    """A Kademlia handler whose every FIND_NODE answer names ``named``'s peers, each at
    the addresses given there."""

    async def answer(stream: Any) -> None:
        try:
            while True:
                raw = await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
                request = Message()
                request.ParseFromString(raw)
                reply = Message(type=request.type, key=request.key)
                for peer_id, addrs in named.items():
                    peer = reply.closerPeers.add()
                    peer.id = peer_id.to_bytes()
                    peer.addrs.extend(multiaddr.Multiaddr(a).to_bytes() for a in addrs)
                data = reply.SerializeToString()
                await stream.write(bytes(varint.encode(len(data))) + data)
        except Exception:  # the asker hung up
            pass
        finally:
            with contextlib.suppress(Exception):
                await stream.close()

    return answer


async def _silent(stream: trio.SocketStream) -> None:
    await trio.sleep_forever()


async def test_a_first_referrers_silent_addresses_neither_hide_a_peer_nor_blame_its_referrer() -> (
    None
):
    """The liar answers first and names every honest peer at four ports that accept a
    connection and never speak; the honest bootstrap names them at their real address.
    py-libp2p's swarm dialled only the first address it held for a peer (the liar's):
    every honest peer timed out, its real address was held dead with the liar's, and
    the bootstrap was blamed for each and then not heard (the audit's newcomer knew
    only the bootstrap and the liar for 140 s). Now every address is dialled in turn:
    the honest peers are found in this first lookup and the bootstrap keeps its
    standing."""
    # a query gives up after 3 s (the old code's failed dials cost that once); a busy
    # machine's honest dial on loopback needs far less
    timeouts = {"dht_rpc_s": 3.0}
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        holes = []
        for _ in range(12):
            [server] = await nursery.start(
                functools.partial(trio.serve_tcp, _silent, 0, host="127.0.0.1")
            )
            holes.append(f"/ip4/127.0.0.1/tcp/{server.socket.getsockname()[1]}")
        boot = await stack.enter_async_context(open_peer(local_config(timeouts=timeouts)))
        joining = local_config(bootstrap=boot.multiaddrs, timeouts=timeouts)
        honest = [await stack.enter_async_context(open_peer(joining)) for _ in range(3)]
        liar = await stack.enter_async_context(open_peer(joining))
        liar.host.set_stream_handler(
            PROTOCOL_ID,
            _naming(
                {node.host.get_id(): holes[4 * i : 4 * i + 4] for i, node in enumerate(honest)}
            ),
        )
        newcomer = await stack.enter_async_context(open_peer(local_config(timeouts=timeouts)))
        for node in honest:  # the bootstrap knows them all: it names them
            await node.rpc.connect(boot.address)
            await boot.dht._kad.routing_table.add_peer(node.host.get_id())
        await newcomer.rpc.connect(liar.address)
        await newcomer.rpc.connect(boot.address)
        boot_id, liar_id = boot.host.get_id(), liar.host.get_id()
        # a key the liar is closer to than the bootstrap: its answer is merged first
        key = next(
            k
            for n in range(1000)
            if _distance(k := f"ffn.{n}.".encode(), liar_id) < _distance(k, boot_id)
        )
        with trio.fail_after(4 * local_config().timeouts.dht_lookup_s):
            found = await newcomer.dht._kad.peer_routing.find_closest_peers_network(key)
        honest_ids = {node.host.get_id() for node in honest}
        assert honest_ids <= set(found)
        assert honest_ids <= set(newcomer.dht._kad.routing_table.get_peer_ids())
        memory = newcomer.dht._lookup_memory
        assert not memory.distrusted(boot_id)
        # the real address is not held dead, and the liar's are not handed on
        for node in honest:
            assert not memory.address_dead(str(node.host.get_addrs()[0]).split("/p2p/")[0])
            kept = {str(a) for a in newcomer.host.get_peerstore().addrs(node.host.get_id())}
            assert not kept.intersection(holes)
        nursery.cancel_scope.cancel()
