"""A peer's address from its socket, either family (``net/host.py:peer_endpoint``), and
what a node on a wildcard address announces (``net/interfaces.py``)."""

from __future__ import annotations

import multiaddr

from volunteerd.net.host import peer_endpoint
from volunteerd.net.interfaces import expand_wildcards, ipv6_by_preference
from volunteerd.net.limits import address_key


def test_an_ipv6_socket_peer_has_an_address_and_its_slash_64_is_its_key() -> None:
    # What getpeername() gives for an AF_INET6 socket: host, port, flowinfo, scope id.
    assert peer_endpoint(("2001:db8:1:2::7", 4001, 0, 0)) == ("2001:db8:1:2::7", 4001)
    assert address_key("2001:db8:1:2::7") == "2001:db8:1:2::/64"
    assert peer_endpoint(("fe80::1%eth0", 4001, 0, 2)) == ("fe80::1", 4001)


def test_machines_of_one_lan_keep_a_key_each_over_ipv6_as_over_ipv4() -> None:
    """A LAN's unique-local (fc00::/7) and link-local addresses share a /64 (one per
    link): keyed by it, a lab's machines shared one budget of connections, requests and
    relay reservations, where over private IPv4 each has its own."""
    assert address_key("fd41:1::3") == "fd41:1::3"
    assert address_key("fd41:1::6") == "fd41:1::6"
    assert address_key("fe80::1") != address_key("fe80::2")
    assert address_key("192.168.1.3") != address_key("192.168.1.6")
    # a public /64 is still one key: one host is routinely given the whole of it
    assert address_key("2a01:4f8:1:2::3") == address_key("2a01:4f8:1:2::6")


def test_an_ipv4_peer_of_an_ipv6_listener_is_its_ipv4_address() -> None:
    assert peer_endpoint(("::ffff:198.51.100.7", 4001, 0, 0)) == ("198.51.100.7", 4001)
    assert peer_endpoint(("198.51.100.7", 4001)) == ("198.51.100.7", 4001)


def test_what_is_no_address_stays_none() -> None:
    assert peer_endpoint(None) is None
    assert peer_endpoint(("only-one",)) is None
    assert peer_endpoint("/tmp/socket") is None


# /proc/net/if_inet6 of a home machine: a stable SLAAC address (flags 0x00), a
# permanent one (0x80), a current privacy address (0x01), an expired one still held
# (0x21: temporary, deprecated), one being checked (0x40), one that failed DAD (0x08).
IF_INET6 = """\
20010db8000100000000000000000001 02 40 00 00     eth0
20010db8000100000000000000000002 02 40 00 80     eth0
20010db80001000011112222333344a1 02 40 00 01     eth0
20010db80001000055556666777788a2 02 40 00 21     eth0
20010db8000100000000000000000003 02 40 00 40     eth0
20010db8000100000000000000000004 02 40 00 08     eth0
00000000000000000000000000000001 01 80 10 80       lo
fe800000000000000000000000000001 02 40 20 80     eth0
"""
EXPIRED = "2001:db8:1:0:5555:6666:7777:88a2"
PRIVATE = "2001:db8:1:0:1111:2222:3333:44a1"
V6 = [EXPIRED, PRIVATE, "2001:db8:1::1", "2001:db8:1::2", "2001:db8:1::3", "2001:db8:1::4"]
V4 = ["192.0.2.10", "127.0.0.1", "169.254.3.3"]


def interfaces(family: int) -> list[str]:
    return [*V6, "::1", "fe80::1%eth0"] if family == 6 else list(V4)


def expanded(listen: str, *, ipv4_on_ipv6: bool, if_inet6: str | None = IF_INET6) -> list[str]:
    addrs = expand_wildcards(
        [multiaddr.Multiaddr(listen)],
        interfaces=interfaces,
        ipv4_on_ipv6=ipv4_on_ipv6,
        if_inet6=if_inet6,
    )
    return [str(addr) for addr in addrs]


def test_expired_and_unchecked_ipv6_addresses_are_not_announced_stable_ones_first() -> None:
    assert ipv6_by_preference(V6, IF_INET6) == ["2001:db8:1::1", "2001:db8:1::2", PRIVATE]
    # Without the kernel's table: every address, as it comes (as before).
    assert ipv6_by_preference(V6, None) == V6
    assert expanded("/ip6/::/tcp/4001", ipv4_on_ipv6=False) == [
        "/ip6/2001:db8:1::1/tcp/4001",
        "/ip6/2001:db8:1::2/tcp/4001",
        f"/ip6/{PRIVATE}/tcp/4001",
    ]


def test_the_ipv6_wildcard_announces_ipv4_addresses_where_its_socket_takes_ipv4() -> None:
    assert expanded("/ip6/::/tcp/4001", ipv4_on_ipv6=True) == [
        "/ip6/2001:db8:1::1/tcp/4001",
        "/ip6/2001:db8:1::2/tcp/4001",
        f"/ip6/{PRIVATE}/tcp/4001",
        "/ip4/192.0.2.10/tcp/4001",
    ]
    # 0.0.0.0 is IPv4 only; a named address is itself.
    assert expanded("/ip4/0.0.0.0/tcp/4001", ipv4_on_ipv6=True) == ["/ip4/192.0.2.10/tcp/4001"]
    assert expanded("/ip6/::1/tcp/4001", ipv4_on_ipv6=True) == ["/ip6/::1/tcp/4001"]


def test_a_machine_with_no_other_address_offers_its_loopback_ones() -> None:
    addrs = expand_wildcards(
        [multiaddr.Multiaddr("/ip6/::/tcp/4001")],
        interfaces=lambda family: ["::1"] if family == 6 else ["127.0.0.1"],
        ipv4_on_ipv6=True,
        if_inet6=None,
    )
    assert [str(a) for a in addrs] == ["/ip6/::1/tcp/4001", "/ip4/127.0.0.1/tcp/4001"]
