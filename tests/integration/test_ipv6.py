"""IPv6 peers have addresses, and a node on "::" serves both families.

py-libp2p 0.8.1 gave no remote address for a connection whose socket is IPv6 (its
``getpeername()`` has four fields, the library took only two-field ones), so every
limit kept by address let IPv6 peers by: 100 identities from one IPv6 address held
100 connections where one IPv4 address holds 64. These tests run real nodes on ::1
and on "::" dialled over 127.0.0.1; they assert outcomes, not timings.
"""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack

import multiaddr
import pytest
import trio

from volunteerd.errors import PeerUnreachable, RemoteError
from volunteerd.identity import Identity
from volunteerd.net import Node, Verb
from volunteerd.net.limits import address_key
from volunteerd.net.peers import PeerAddress, peer_id_for
from volunteerd.net.reachability import observed_ips
from volunteerd.net.records import FindRequest
from volunteerd.testing import local_config, open_peer
from volunteerd.testing.clients import open_bare_client


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def _dual_stack() -> bool:
    """Whether an IPv6 socket that sets nothing takes IPv4 too (bindv6only=0)."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
        return probe.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback"),
]

FIND = FindRequest(keys=["ffn."])
PATIENT = {"connect_s": 30, "request_s": 30}


def _port(node: Node) -> int:
    return int(str(node.address).split("/tcp/")[1].split("/")[0])


def _at(node: Node, host: str) -> PeerAddress:
    """``node`` dialled at ``host`` (its listening port) and nowhere else."""
    family = "ip6" if ":" in host else "ip4"
    return PeerAddress(node.peer_id, (f"/{family}/{host}/tcp/{_port(node)}",))


async def test_a_caller_over_ipv6_is_known_by_its_address_and_held_to_its_connection_cap() -> None:
    """A node on ::1 sees its callers come from ::1 (it saw no address at all, and took
    them for relayed callers), counts their connections against ::1's /64 (with
    ``limit_loopback``, as another machine's address would be counted), and shares
    one address's budget among their identities."""
    limits = {
        "limit_loopback": True,
        "max_connections_per_address": 2,
        "per_address": 1,
        "requests_per_s": 0.1,
        "request_burst": 4,
    }
    config = local_config(network={"listen_host": "::1"}, peer_limits=limits)
    patient = config.model_copy(update={"timeouts": config.timeouts.model_copy(update=PATIENT)})
    async with open_peer(config) as node, AsyncExitStack() as stack:
        assert str(node.address).startswith("/ip6/::1/tcp/")
        first_identity = Identity.generate()
        first = await stack.enter_async_context(open_bare_client(patient, first_identity))
        second = await stack.enter_async_context(open_bare_client(patient))
        for _ in range(3):
            await first.call(node.address, Verb.DHT_FIND, FIND)
        assert observed_ips(node.host, str(peer_id_for(first_identity))) == ["::1"]
        await second.call(node.address, Verb.DHT_FIND, FIND)  # the address's 4th request
        with pytest.raises(RemoteError, match=r"peers at ::1") as refused:
            await second.call(node.address, Verb.DHT_FIND, FIND)  # its own 2nd: refused
        assert refused.value.code == "rate_limited"
        assert [reason for _, reason in node.server.stats.refused] == ["address_requests"]

        # A third identity from the same address finds its connection slots taken.
        with pytest.raises(BaseExceptionGroup) as closed, trio.fail_after(120):
            async with open_bare_client(patient) as third:
                await third.call(node.address, Verb.DHT_FIND, FIND)
        assert closed.group_contains(PeerUnreachable, depth=None)
        assert node.address_slots is not None
        assert node.address_slots.refused >= 1
        assert node.address_slots.open("::1") == 2


@pytest.mark.skipif(not _dual_stack(), reason="IPv6 sockets here take no IPv4 (bindv6only=1)")
async def test_a_node_on_the_ipv6_wildcard_serves_ipv4_callers_by_their_ipv4_address() -> None:
    """A node listening on "::" takes IPv4 callers too (Linux's default): it announces
    IPv4 addresses next to its IPv6 ones (it announced IPv6 ones only, so IPv4-only
    peers had nothing to dial), and knows such a caller by its IPv4 address (the
    socket says '::ffff:127.0.0.1', which py-libp2p gave as no address)."""
    config = local_config(network={"listen_host": "::"})
    async with open_peer(config) as node:
        announced = [str(addr) for addr in node.host.get_addrs()]
        assert any(addr.startswith("/ip4/") for addr in announced), announced
        assert any(addr.startswith("/ip6/") for addr in announced), announced
        # Every IPv4 address announced is one an IPv4 caller reaches the node at.
        ipv4 = [
            multiaddr.Multiaddr(addr).value_for_protocol("ip4")
            for addr in announced
            if addr.startswith("/ip4/")
        ]
        for host in [*ipv4, "127.0.0.1"]:
            caller = Identity.generate()
            async with open_bare_client(config, caller) as client:
                await client.call(_at(node, host), Verb.DHT_FIND, FIND)
                assert observed_ips(node.host, str(peer_id_for(caller))) == [host]
                assert address_key(host, loopback=True) == host
