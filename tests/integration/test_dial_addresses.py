"""A peer announced at several addresses is reached at any of them that works (real
libp2p nodes on loopback).

py-libp2p's swarm dials one address of a peer, the first: a volunteer announces the
public address peers dialled back first, then its own (a LAN address, an IPv6 one),
and a caller for whom the first does not work (a trainer on the same LAN behind a
router without hairpin NAT, one without IPv6) never reached it, though a later one
would have answered."""

from __future__ import annotations

import socket

import pytest
import trio

from volunteerd.errors import PeerUnreachable, StreamTimedOut
from volunteerd.net import PeerAddress, Verb
from volunteerd.net.host import _direct_addrs
from volunteerd.net.records import FindRequest
from volunteerd.testing import local_config, open_peer


def _refusing_port() -> int:
    """A loopback port nobody listens on (a connection to it is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _hold(stream: trio.SocketStream) -> None:
    async with stream:  # accepts and never speaks, as a forgotten port forward may
        await trio.sleep_forever()


@pytest.mark.slow
async def test_a_call_reaches_a_peer_at_its_third_address_when_the_first_two_are_dead() -> None:
    async with (
        open_peer(local_config()) as server,
        open_peer(local_config()) as client,
        trio.open_nursery() as nursery,
    ):
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, _hold, [listener])
        silent = listener.socket.getsockname()[1]
        dead = (f"/ip4/127.0.0.1/tcp/{silent}", f"/ip4/127.0.0.1/tcp/{_refusing_port()}")
        with trio.fail_after(20):
            await client.rpc.call(
                PeerAddress(server.peer_id, (*dead, *server.addrs)),
                Verb.DHT_FIND,
                FindRequest(keys=["ffn."]),
            )
        assert server.peer_id in client.connected_peers()

        # none that works: the caller is told, within its connect_s
        other = await _nobody_at(dead)
        with trio.fail_after(20), pytest.raises((PeerUnreachable, StreamTimedOut)):
            await client.rpc.call(other, Verb.DHT_FIND, FindRequest(keys=["ffn."]))
        nursery.cancel_scope.cancel()


async def _nobody_at(addrs: tuple[str, ...]) -> PeerAddress:
    async with open_peer(local_config()) as gone:  # a real identity, then gone
        peer_id = gone.peer_id
    return PeerAddress(peer_id, addrs)


def test_several_direct_addresses_are_dialled_in_turn_remote_ones_first() -> None:
    lan, public = "/ip4/192.168.1.5/tcp/38400", "/ip4/203.0.113.7/tcp/38400"
    loop, v6 = "/ip4/127.0.0.1/tcp/38400", "/ip6/2001:db8::5/tcp/38400"
    circuit = "/ip4/203.0.113.9/tcp/4001/p2p/QmRelay/p2p-circuit"
    assert _direct_addrs([public, loop, lan, public, circuit, v6]) == [public, lan, v6]
    assert _direct_addrs([loop, "/ip4/127.0.0.2/tcp/9"]) == [loop, "/ip4/127.0.0.2/tcp/9"]
    many = [f"/ip4/203.0.113.{i}/tcp/38400" for i in range(1, 9)]
    assert _direct_addrs(many) == many[:4]  # a record's 8 addresses: 4 dials at most
    assert _direct_addrs(["/dns4/example.org/tcp/38400"]) == []
