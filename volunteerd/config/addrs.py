"""What an address a node announces looks like, for the configuration's checks and the
network layer alike (``net/records.py``, ``net/dialback.py``): ``/ip4|ip6/<ip>/tcp/<port>``,
or a circuit address through a relay at one, ``<relay transport>/p2p/<relay id>/p2p-circuit``
(docs/protocol.md). Plain text, no libp2p: the network layer adds what needs it (that a
relay id decodes)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

__all__ = ["CIRCUIT_SUFFIX", "circuit_parts", "is_dialable_addr", "tcp_endpoint"]

CIRCUIT_SUFFIX = "/p2p-circuit"

# What an address may be made of: the characters of ``/ip4|ip6/<ip>/tcp/<port>`` and of
# a base58 relay id. Anything else (control or non-ASCII characters, which JSON writes
# as six-byte escapes) is no address a node announces.
_ADDR_CHARS = re.compile(r"[A-Za-z0-9./:-]+")
_BASE58 = re.compile(r"[1-9A-HJ-NP-Za-km-z]+")
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


def tcp_endpoint(addr: str) -> tuple[str, int] | None:
    """``/ip4/1.2.3.4/tcp/38400`` -> ("1.2.3.4", 38400); None for any other shape."""
    parts = addr.split("/")
    if len(parts) != 5 or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
        port = int(parts[4])
    except ValueError:
        return None
    if (parts[1] == "ip4") != (ip.version == 4) or not 0 < port < 65536:
        return None
    return str(ip), port


def circuit_parts(text: str) -> tuple[str, str] | None:
    """``<transport>/p2p/<relay id>/p2p-circuit`` -> (transport, relay id), by its shape
    alone; None for anything else (a direct address, a relay chain)."""
    if len(text) > 300 or not text.startswith("/") or not text.endswith(CIRCUIT_SUFFIX):
        return None
    transport, sep, relay_id = text.removesuffix(CIRCUIT_SUFFIX).rpartition("/p2p/")
    if not sep or not transport.startswith("/") or "/p2p" in transport:
        return None
    return (transport, relay_id) if _BASE58.fullmatch(relay_id) else None


def is_dialable_addr(
    value: str, circuit: Callable[[str], tuple[str, str] | None] = circuit_parts
) -> bool:
    """Whether peers can dial ``value`` where a node announces it. The IP is never the
    unspecified address (0.0.0.0 or ::, which a peer's system takes for itself), a
    multicast or the broadcast address; the port is 1..65535. Loopback and private
    addresses are addresses (tests and LANs use them). ``circuit`` parses a circuit
    address (the network layer passes one that also decodes the relay's id)."""
    if len(value) > 200 or not _ADDR_CHARS.fullmatch(value):
        return False
    parts = circuit(value)
    endpoint = tcp_endpoint(parts[0] if parts is not None else value)
    if endpoint is None:
        return False
    ip = ipaddress.ip_address(endpoint[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_unspecified or ip.is_multicast or ip == _BROADCAST)
