"""What an address a node announces looks like, for the configuration's checks and the
network layer alike (``net/records.py``, ``net/dialback.py``): ``/ip4|ip6/<ip>/tcp/<port>``,
or a circuit address through a relay at one, ``<relay transport>/p2p/<relay id>/p2p-circuit``
(docs/protocol.md). Plain text, no libp2p: the network layer adds what needs it (that a
relay id decodes). A peer to dial (``network.bootstrap_peers``, ``reachability.relays``,
an invitation's peers) is checked by ``peer_multiaddr_problem``, for the configuration
and ``net.peers.parse_peer_multiaddr`` alike, so that what one lets through the other
can use."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

__all__ = [
    "CIRCUIT_SUFFIX",
    "circuit_parts",
    "is_dialable_addr",
    "is_ed25519_peer_id",
    "is_peer_id",
    "peer_multiaddr_problem",
    "tcp_endpoint",
]

CIRCUIT_SUFFIX = "/p2p-circuit"

# What an address may be made of: the characters of ``/ip4|ip6/<ip>/tcp/<port>`` and of
# a base58 relay id. Anything else (control or non-ASCII characters, which JSON writes
# as six-byte escapes) is no address a node announces.
_ADDR_CHARS = re.compile(r"[A-Za-z0-9./:-]+")
_BASE58 = re.compile(r"[1-9A-HJ-NP-Za-km-z]+")
_PORT = re.compile(r"[0-9]{1,5}")
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*"
    r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
)
_BASE58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
# The peer id of an Ed25519 key (12D3KooW...): an identity multihash (0x00) of 36 bytes
# (0x24), the key's protobuf: field 1, type Ed25519 (0x08 0x01); field 2, 32 bytes (0x12 0x20).
_ED25519_PEER_ID = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
_MAX_PEER_ID_LENGTH = 128  # as an invitation's (swarm.invitation)


def tcp_endpoint(addr: str) -> tuple[str, int] | None:
    """``/ip4/1.2.3.4/tcp/38400`` -> ("1.2.3.4", 38400); None for any other shape. The
    port is 1 to 5 ASCII digits: ``int()`` also takes " 38400", "+38400", "38_400" and
    Arabic-Indic digits, which multiaddr and the wire's patterns do not (dial-back
    echoed them and failed inside its handler: a fuzzing audit); the IP has no scope
    (``fe80::1%eth0``: no multiaddr)."""
    parts = addr.split("/")
    if len(parts) != 5 or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    if not _PORT.fullmatch(parts[4]):
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return None
    port = int(parts[4])
    if (parts[1] == "ip4") != (ip.version == 4) or not 0 < port < 65536:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
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


def peer_multiaddr_problem(text: str) -> str | None:
    """What is wrong with ``text`` as a peer to dial (``network.bootstrap_peers``,
    ``reachability.relays``, an invitation's peers), or None: it must be
    ``/ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>/p2p/<peer id>``. Plain text, no
    multiaddr: a shape that merely looked right (``/unix/a/p2p/<id>``, whose socket path
    takes in the /p2p/ part; an unknown protocol; an IP out of range) started a daemon
    that then stopped with a traceback when the network layer parsed it."""
    if len(text) > 400 or not _ADDR_CHARS.fullmatch(text):
        return "it is not a multiaddr of the characters one is made of"
    transport, sep, peer_id = text.rpartition("/p2p/")
    if not sep or not is_peer_id(peer_id):
        return "it does not end in /p2p/<peer id>"
    if "/p2p" in transport:
        return "a peer to dial is a direct address: one /p2p/ part, no relay circuit"
    if not transport:
        return None  # a bare peer id: where a transport is needed, the caller says so
    parts = transport.split("/")
    if len(parts) != 5 or parts[0] or parts[3] != "tcp":
        return "expected /<ip4|ip6|dns|dns4|dns6>/<host>/tcp/<port> before /p2p/"
    kind, host, port = parts[1], parts[2], parts[4]
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"port {port!r} is not 1..65535"
    if kind in ("ip4", "ip6"):
        if tcp_endpoint(transport) is None:
            return f"{host!r} is not an {kind} address"
    elif kind in ("dns", "dns4", "dns6"):
        if not _HOSTNAME.fullmatch(host):
            return f"{host!r} is not a host name"
    else:
        return f"/{kind}/ is no transport volunteerd dials (ip4, ip6, dns, dns4, dns6)"
    return None


def is_ed25519_peer_id(text: str) -> bool:
    """Whether ``text`` is the base58 peer id of an Ed25519 key (``12D3KooW...``), the
    only kind that signs manifests: what ``net.peers.public_key_of`` finds a key in (a
    unit test keeps the two alike), without importing libp2p."""
    raw = _base58(text)
    return (
        raw is not None
        and len(raw) == len(_ED25519_PEER_ID) + 32
        and (raw.startswith(_ED25519_PEER_ID))
    )


def is_peer_id(text: str) -> bool:
    """Whether ``text`` decodes as a peer id: a multihash, identity (``12D3KooW...``: 0x00,
    its length, the key) or SHA-256 (``Qm...``: 0x12 0x20, 32 bytes)."""
    raw = _base58(text)
    if raw is None or len(raw) < 2:
        return False
    if raw[0] == 0x00:
        return 0 < raw[1] == len(raw) - 2
    return raw[:2] == b"\x12\x20" and len(raw) == 34


def _base58(text: str) -> bytes | None:
    if not 0 < len(text) <= _MAX_PEER_ID_LENGTH or not _BASE58.fullmatch(text):
        return None
    number = 0
    for char in text:
        number = number * 58 + _BASE58_ALPHABET.index(char)
    zeros = len(text) - len(text.lstrip("1"))
    return bytes(zeros) + number.to_bytes((number.bit_length() + 7) // 8, "big")
