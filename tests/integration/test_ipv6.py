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

import pytest
import trio

from volunteerd.errors import PeerUnreachable, RemoteError
from volunteerd.identity import Identity
from volunteerd.net import Verb
from volunteerd.net.peers import peer_id_for
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


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback"),
]

FIND = FindRequest(keys=["ffn."])
PATIENT = {"connect_s": 30, "request_s": 30}


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
