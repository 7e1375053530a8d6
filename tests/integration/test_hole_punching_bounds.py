"""Hole punching (DCUtR) over real libp2p on 127.0.0.1: what a peer with a relayed
connection to a node can make it dial is a few addresses, once in a while.

A peer reaches the node through its relay (as anyone may) and asks for a hole punch
whose CONNECT lists a hundred addresses of a third party, here TCP listeners that
count the connections they accept. py-libp2p dialled every one, three rounds, in as
many sessions at once as the peer opened (8 messages: 10,105 connections in 27 s).
Honest hole punching, which upgrades a relayed connection: test_reachability.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trio
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR_PROTOCOL_ID
from libp2p.relay.circuit_v2.pb.dcutr_pb2 import HolePunch
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from multiaddr import Multiaddr

from volunteerd.identity import Identity
from volunteerd.net import Node, open_node
from volunteerd.net.holepunching import punchable_addrs
from volunteerd.testing import local_config, open_peer

# Real libp2p nodes on loopback, in wall-clock time.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_VICTIM_PORTS = 100  # a CONNECT's worth: ~1 KiB of addresses


@dataclass
class _Victim:
    """TCP listeners on 127.0.0.1 that count the connections they accept."""

    ports: list[int] = field(default_factory=list)
    accepted: int = 0

    def addrs(self) -> list[str]:
        return [f"/ip4/127.0.0.1/tcp/{port}" for port in self.ports]


@asynccontextmanager
async def _open_victim(listeners: int) -> AsyncIterator[_Victim]:
    victim = _Victim()

    async def count(stream: trio.SocketStream) -> None:
        victim.accepted += 1
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        sockets = [
            listener
            for _ in range(listeners)
            for listener in await trio.open_tcp_listeners(0, host="127.0.0.1")
        ]
        victim.ports = [s.socket.getsockname()[1] for s in sockets]
        nursery.start_soon(trio.serve_listeners, count, sockets)
        yield victim
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def _relayed_node_and_stranger() -> AsyncIterator[tuple[Node, Node]]:
    """A node reached through its relay (it listens on 127.0.0.1 too), and a stranger
    that listens nowhere and punches no holes (it will connect through the relay)."""
    async with open_node(Identity.generate(), local_config(), relay=True) as relay:
        node_config = local_config(bootstrap=relay.multiaddrs, reachability={"mode": "relay"})
        stranger_config = local_config(
            reachability={
                "mode": "relay",
                "listen": False,
                "hole_punching": False,
                "relays": relay.multiaddrs,
            }
        )
        async with open_peer(node_config) as node, open_peer(stranger_config) as stranger:
            yield node, stranger


async def _connect_through_relay(stranger: Node, node: Node) -> None:
    await stranger.streams.connect(node.address)
    conns = stranger.host.get_network().connections.get(node.host.get_id()) or []
    assert conns
    assert all("/p2p-circuit" in str(a) for c in conns for a in c.get_transport_addresses())


async def _ask_hole_punch(stranger: Node, node: Node, addrs: list[str]) -> bool:
    """Ask ``node`` for a hole punch to ``addrs`` (CONNECT, then SYNC); True when it
    answered, False when it reset the stream."""
    stream = await stranger.host.new_stream(node.host.get_id(), [DCUTR_PROTOCOL_ID])
    try:
        connect = HolePunch()
        connect.type = HolePunch.CONNECT
        connect.ObsAddrs.extend(Multiaddr(a).to_bytes() for a in addrs)
        with trio.fail_after(30):
            await write_delimited_msg(stream, connect)
            await read_delimited_msg(stream, HolePunch)
            sync = HolePunch()
            sync.type = HolePunch.SYNC
            await write_delimited_msg(stream, sync)
    except trio.TooSlowError:
        raise
    except Exception:  # reset: refused
        return False
    finally:
        with contextlib.suppress(Exception):
            await stream.close()
    return True


async def test_a_peers_connect_makes_the_node_dial_a_few_addresses_in_one_session() -> None:
    """Two CONNECTs at once listing 100 addresses: one session runs and dials at most
    4 of them (3 rounds), the other is refused; a third, after the first ended, is
    refused too (one session per peer per few minutes)."""
    async with (
        _relayed_node_and_stranger() as (node, stranger),
        _open_victim(_VICTIM_PORTS) as victim,
    ):
        assert node.reachability is not None
        relaying = node.reachability.relaying
        await _connect_through_relay(stranger, node)
        answered: list[bool] = []

        async def ask() -> None:
            answered.append(await _ask_hole_punch(stranger, node, victim.addrs()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            nursery.start_soon(ask)
        # The listeners are not the stranger (Noise fails there): the session ends
        # without a direct connection, counted as a failed hole punch.
        with trio.fail_after(120):
            while relaying.upgrades().failed < 1:  # noqa: ASYNC110
                await trio.sleep(0.2)
        await trio.sleep(1)  # connections accepted at the end are counted by now
        assert 1 <= victim.accepted <= 4 * 3, f"{victim.accepted} connections to the victim"
        assert sorted(answered) == [False, True]
        assert not await _ask_hole_punch(stranger, node, victim.addrs())
        assert relaying.upgrades().refused == 2
        assert victim.accepted <= 4 * 3
        # The addresses were not kept: nothing dials them later on the peer's behalf.
        known = {str(a) for a in node.host.get_peerstore().addrs(stranger.host.get_id())}
        assert not known & set(victim.addrs())


async def test_addresses_a_relayed_peer_told_identify_are_dialled_a_few_at_a_time() -> None:
    """Before a hole punch the node plainly dials the peer's known direct addresses,
    which the peer itself told identify (up to 1,000 kept): at most 4 of them, once
    per few minutes, however many it named."""
    async with (
        _relayed_node_and_stranger() as (node, stranger),
        _open_victim(_VICTIM_PORTS) as victim,
    ):
        # The stranger names them as its listen addresses in identify.
        fake = [Multiaddr(a) for a in victim.addrs()]
        stranger.host.get_addrs = lambda: fake  # type: ignore[method-assign]
        await _connect_through_relay(stranger, node)
        # The node looks for relayed connections to upgrade every 2 s.
        with trio.fail_after(60):
            while not victim.accepted:  # noqa: ASYNC110
                await trio.sleep(0.2)
        await trio.sleep(8)  # four more looks
        assert victim.accepted <= 4, f"{victim.accepted} connections to the victim"


def test_hole_punch_dials_only_networks_no_narrower_than_the_relays() -> None:
    """A peer reached through a relay is beyond it: loopback addresses are dialled only
    through a relay on loopback, private ones only through a loopback or private one."""
    loopback, lan, public = "/ip4/127.0.0.1/tcp/1", "/ip4/192.168.1.5/tcp/2", "/ip4/8.8.8.8/tcp/3"
    cgnat, loopback6, public6 = "/ip4/100.64.0.9/tcp/4", "/ip6/::1/tcp/5", "/ip6/2001:4860::8/tcp/6"
    mapped_loopback = "/ip6/::ffff:127.0.0.1/tcp/7"
    addrs = [loopback, lan, public, cgnat, loopback6, public6, mapped_loopback]
    assert punchable_addrs(addrs, ["127.0.0.1"]) == [loopback, lan, public, cgnat]
    assert punchable_addrs(addrs, ["10.200.0.1"]) == [lan, public, cgnat, public6]
    assert punchable_addrs(addrs, ["93.184.216.34"]) == [public, public6]
    assert punchable_addrs(addrs, []) == [public, public6]  # relay's IP unknown
    # Two relays: the narrower network is the one both reach.
    assert punchable_addrs(addrs, ["127.0.0.1", "93.184.216.34"]) == [public, public6]


def test_hole_punch_dials_at_most_four_plain_tcp_addresses() -> None:
    relay = "12D3KooWJQP6vxWApWkpPvKJbpkFvXug7xjJWMcV59tZFMyJqFTL"
    junk = [
        "/ip4/0.0.0.0/tcp/1",
        "/ip6/::/tcp/1",
        "/ip4/224.0.0.1/tcp/1",
        "/ip4/255.255.255.255/tcp/1",
        "/ip4/127.0.0.1/tcp/0",
        "/dns4/localhost/tcp/1",
        "/ip4/127.0.0.1/udp/1/quic-v1",
        f"/ip4/127.0.0.1/tcp/1/p2p/{relay}/p2p-circuit",
        "/ip4/127.0.0.1/tcp/1/tls",
    ]
    assert punchable_addrs(junk, ["127.0.0.1"]) == []
    many = [f"/ip4/127.0.0.1/tcp/{port}" for port in range(1000, 1100)]
    assert punchable_addrs([many[0], *many], ["127.0.0.1"]) == many[:4]
    # The relay's own address (a peer's observed addresses may hold it) is not one.
    assert punchable_addrs(many, ["127.0.0.1"], exclude={many[0]}) == many[1:5]
