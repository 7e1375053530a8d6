"""The transfer quotas count what crosses the wire: every byte of a node's TCP
connections (Kademlia, identify, ping, multistream, Noise and Yamux framing, the RPC
streams), once. Only the RPC streams' payload used to count: an idle joined daemon's
ledger held ~12 % of what its veth carried, and a daily quota "used up" let ~23 MB an
hour through (an outside probe)."""

from __future__ import annotations

import hashlib
import socket
import struct
import sys
from contextlib import AsyncExitStack

import pytest
import trio

from volunteerd.identity import Identity
from volunteerd.net import flow
from volunteerd.net.node import Node, open_node
from volunteerd.net.throttle import Throttle, TransferLedger
from volunteerd.testing import local_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="reads the kernel's TCP_INFO"),
]

DHT = {"replication": 3, "record_ttl_s": 120.0, "announce_period_s": 60.0}
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked and tcpi_bytes_received, u64 each
_TCP_INFO_BYTES_AT = 120


def socket_bytes(node: Node) -> int:
    """What the kernel says ``node``'s open TCP connections moved (payload sent and
    acknowledged, payload received), all of them together."""
    total = 0
    for conns in node.host.get_network().connections.values():
        for conn in conns:
            tcp = flow._tcp_of(conn.muxed_conn)
            assert tcp is not None
            info = tcp.stream.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            acked, received = struct.unpack_from("=QQ", info, _TCP_INFO_BYTES_AT)
            total += acked + received
    return total


async def test_the_ledger_counts_every_byte_of_a_lookup_on_the_wire_once() -> None:
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(
            open_node(Identity.generate(), local_config(dht=DHT))
        )
        joining = local_config(bootstrap=boot.multiaddrs, dht=DHT)
        throttle = Throttle(joining.limits, TransferLedger(None))
        node = await stack.enter_async_context(
            open_node(Identity.generate(), joining, throttle=throttle)
        )
        with trio.fail_after(30):  # a hang guard
            await node.rpc.connect(boot.address)
            before = throttle.ledger.total
            # Kademlia's own lookup (py-libp2p's protocol, no RPC stream of ours),
            # and the identify and ping it brings
            for i in range(20):
                key = hashlib.sha256(f"key {i}".encode()).digest()
                await node.dht._kad.peer_routing.find_closest_peers_network(key)
            assert node.host.get_network().connections.get(boot.host.get_id())
            counted = throttle.ledger.total
            on_the_wire = socket_bytes(node)
        # the lookups moved bytes no RPC stream of ours saw, and they count
        assert counted - before > 2_000
        # ... in the traffic since start too (what the statistics and rates show)
        assert throttle.bytes_up + throttle.bytes_down == counted
        # every byte of the node's open connection is in its ledger (the kernel's
        # count of sent bytes waits for their acknowledgement), and once: beyond it
        # only a reachability probe's short connection, closed since (~630 bytes)
        assert on_the_wire > 10_000
        assert 0.98 * on_the_wire <= counted < 1.2 * on_the_wire
