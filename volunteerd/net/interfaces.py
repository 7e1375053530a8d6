"""What a node announces for a wildcard listen address: this machine's own addresses.

``0.0.0.0`` and ``::`` are no address a peer can dial; they stand for the machine's
interface addresses. Which ones, and in which order, matters: peers keep 8 of a node's
addresses and dial 4 of them (``net/peerstore.py``, ``net/host.py``). So ``::`` stands
for the IPv4 addresses too where its socket takes IPv4 callers, and IPv6 addresses the
kernel no longer or not yet uses (an expired privacy address, one still checked for
duplicates) are left out, stable ones before temporary ones.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import socket
from collections.abc import Callable, Iterable, Sequence

import multiaddr
from multiaddr.utils import get_network_addrs

from volunteerd.net.dialback import tcp_endpoint

__all__ = ["dialable_addrs", "expand_wildcards", "ipv6_by_preference"]


def dialable_addrs(candidates: Sequence[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
    """What the host advertises (to identify, Kademlia and our records) for its listen
    addresses: a wildcard one (``0.0.0.0``, ``::``) is no address a peer can dial, but
    stands for this machine's interface addresses, one entry each, leaving out loopback
    and link-local ones (another machine to a peer). A machine with no other address
    offers its loopback address.

    ``::`` stands for the IPv4 addresses too where an IPv6 socket takes IPv4 callers
    (Linux's default, ``net.ipv6.bindv6only=0``; py-libp2p's listener sets nothing).
    IPv6 addresses the kernel marks deprecated, tentative or failed (an expired
    privacy address, one still being checked) are left out, and temporary (privacy)
    ones come after the stable ones: peers keep 8 of a node's addresses and dial 4."""
    return expand_wildcards(
        candidates,
        interfaces=get_network_addrs,
        ipv4_on_ipv6=_ipv6_sockets_take_ipv4(),
        if_inet6=_read_if_inet6(),
    )


_IF_INET6 = "/proc/net/if_inet6"
# Flags of an IPv6 address in /proc/net/if_inet6 (linux/if_addr.h, IFA_F_*).
_IFA_TEMPORARY = 0x01
_IFA_UNUSABLE = 0x08 | 0x20 | 0x40  # DAD failed, deprecated, tentative


def expand_wildcards(
    candidates: Sequence[multiaddr.Multiaddr],
    *,
    interfaces: Callable[[int], list[str]],
    ipv4_on_ipv6: bool,
    if_inet6: str | None,
) -> list[multiaddr.Multiaddr]:
    """``dialable_addrs`` given the machine's addresses of a family (4 or 6:
    ``interfaces``), whether a ``::`` socket takes IPv4, and the text of
    /proc/net/if_inet6 (None where there is none: IPv6 addresses as they come)."""
    out: list[multiaddr.Multiaddr] = []
    for addr in candidates:
        endpoint = tcp_endpoint(str(addr))
        ip = ipaddress.ip_address(endpoint[0]) if endpoint else None
        if endpoint is None or ip is None or not ip.is_unspecified:
            out.append(addr)
            continue
        port = endpoint[1]
        families = [ip.version] if ip.version == 4 or not ipv4_on_ipv6 else [6, 4]
        hosts: list[str] = []
        for family in families:
            found = [h for h in interfaces(family) if not _loopback_or_link_local(h)]
            hosts += ipv6_by_preference(found, if_inet6) if family == 6 else found
        if not hosts:
            hosts = ["::1" if family == 6 else "127.0.0.1" for family in families]
        out += [multiaddr.Multiaddr(f"/{_ip_proto(h)}/{h}/tcp/{port}") for h in hosts]
    return list({str(a): a for a in out}.values())


def ipv6_by_preference(hosts: Iterable[str], if_inet6: str | None) -> list[str]:
    """``hosts`` (IPv6 addresses of this machine) without those the kernel marks
    deprecated, tentative or failed in ``if_inet6`` (/proc/net/if_inet6's text), the
    stable ones first; as they are where that text is None."""
    hosts = list(hosts)
    if if_inet6 is None:
        return hosts
    flags: dict[str, int] = {}
    for line in if_inet6.splitlines():
        fields = line.split()
        try:
            address = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
            value = int(fields[4], 16)
        except (IndexError, ValueError):
            continue
        # on several interfaces: usable, and stable, if it is so on one of them
        flags[address] = flags.get(address, 0xFF) & value

    def flags_of(host: str) -> int:
        with contextlib.suppress(ValueError):
            return flags.get(str(ipaddress.IPv6Address(host.split("%", 1)[0])), 0)
        return 0

    usable = [h for h in hosts if not flags_of(h) & _IFA_UNUSABLE]
    return sorted(usable, key=lambda h: bool(flags_of(h) & _IFA_TEMPORARY))


def _read_if_inet6() -> str | None:
    try:
        with open(_IF_INET6, encoding="ascii") as table:
            return table.read()
    except OSError:  # not Linux, or no IPv6: addresses as they come
        return None


@functools.cache
def _ipv6_sockets_take_ipv4() -> bool:
    """Whether an IPv6 socket that sets nothing (py-libp2p's listener) takes IPv4
    callers too: ``IPV6_V6ONLY`` off by default (``net.ipv6.bindv6only=0``)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            return probe.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    except OSError:  # no IPv6 at all
        return False


def _loopback_or_link_local(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return True
    return ip.is_loopback or ip.is_link_local


def _ip_proto(host: str) -> str:
    return "ip6" if ":" in host else "ip4"
