"""A peer's address from its socket, either family (``net/host.py:peer_endpoint``)."""

from __future__ import annotations

from volunteerd.net.host import peer_endpoint
from volunteerd.net.limits import address_key


def test_an_ipv6_socket_peer_has_an_address_and_its_slash_64_is_its_key() -> None:
    # What getpeername() gives for an AF_INET6 socket: host, port, flowinfo, scope id.
    assert peer_endpoint(("2001:db8:1:2::7", 4001, 0, 0)) == ("2001:db8:1:2::7", 4001)
    assert address_key("2001:db8:1:2::7") == "2001:db8:1:2::/64"
    assert peer_endpoint(("fe80::1%eth0", 4001, 0, 2)) == ("fe80::1", 4001)


def test_an_ipv4_peer_of_an_ipv6_listener_is_its_ipv4_address() -> None:
    assert peer_endpoint(("::ffff:198.51.100.7", 4001, 0, 0)) == ("198.51.100.7", 4001)
    assert peer_endpoint(("198.51.100.7", 4001)) == ("198.51.100.7", 4001)


def test_what_is_no_address_stays_none() -> None:
    assert peer_endpoint(None) is None
    assert peer_endpoint(("only-one",)) is None
    assert peer_endpoint("/tmp/socket") is None
