"""IPv4 packets as the router sees them: the few header fields it reads, and the
address/port rewrites NAT makes, keeping the IP and TCP/UDP checksums right by
incremental update (RFC 1624, eq. 3) instead of summing the whole packet again.

Addresses are 32-bit ints here (the router compares them per packet), strings only at
the edges (`address_int`, `address_str`).
"""

from __future__ import annotations

import ipaddress
import struct

PROTO_ICMP = 1
PROTO_TCP = 6
PROTO_UDP = 17

_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
# offset of the checksum inside the transport header
_CHECKSUM_AT = {PROTO_TCP: 16, PROTO_UDP: 6}


def address_int(address: str) -> int:
    return int(ipaddress.IPv4Address(address))


def address_str(address: int) -> str:
    return str(ipaddress.IPv4Address(address))


def checksum(data: bytes | bytearray) -> int:
    """The internet checksum (RFC 1071) of `data`: what a receiver verifies."""
    if len(data) % 2:
        data = bytes(data) + b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _adjust16(csum: int, old: int, new: int) -> int:
    # RFC 1624 eq. 3: HC' = ~(~HC + ~m + m'); never yields a -0 where +0 was meant
    total = (~csum & 0xFFFF) + (~old & 0xFFFF) + new
    total = (total & 0xFFFF) + (total >> 16)
    total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _adjust32(csum: int, old: int, new: int) -> int:
    csum = _adjust16(csum, old >> 16, new >> 16)
    return _adjust16(csum, old & 0xFFFF, new & 0xFFFF)


def is_fragment(packet: bytes | bytearray) -> bool:
    """A piece of a fragmented datagram (more-fragments flag or an offset): its ports, if
    any, are in another packet, so NAT cannot translate it."""
    return bool(_U16.unpack_from(packet, 6)[0] & 0x3FFF)


def ports(packet: bytes | bytearray) -> tuple[int, int]:
    """(source port, destination port) of a TCP or UDP packet."""
    ihl = (packet[0] & 0x0F) * 4
    return _U16.unpack_from(packet, ihl)[0], _U16.unpack_from(packet, ihl + 2)[0]


def rewrite_source(packet: bytearray, address: int, port: int) -> None:
    """Set a TCP/UDP packet's source address and port, checksums updated."""
    _rewrite(packet, 12, 0, address, port)


def rewrite_destination(packet: bytearray, address: int, port: int) -> None:
    """Set a TCP/UDP packet's destination address and port, checksums updated."""
    _rewrite(packet, 16, 2, address, port)


def _rewrite(packet: bytearray, address_at: int, port_at: int, address: int, port: int) -> None:
    old_address = _U32.unpack_from(packet, address_at)[0]
    _U32.pack_into(packet, address_at, address)
    _U16.pack_into(packet, 10, _adjust32(_U16.unpack_from(packet, 10)[0], old_address, address))
    ihl = (packet[0] & 0x0F) * 4
    protocol = packet[9]
    old_port = _U16.unpack_from(packet, ihl + port_at)[0]
    _U16.pack_into(packet, ihl + port_at, port)
    checksum_at = ihl + _CHECKSUM_AT[protocol]
    csum = _U16.unpack_from(packet, checksum_at)[0]
    if protocol == PROTO_UDP and csum == 0:
        return  # the sender sent no UDP checksum: there is none to keep right
    # the TCP/UDP checksum covers a pseudo-header with both addresses, and the ports
    csum = _adjust16(_adjust32(csum, old_address, address), old_port, port)
    if protocol == PROTO_UDP and csum == 0:
        csum = 0xFFFF  # 0 means "no checksum" in UDP; 0xFFFF is the same sum
    _U16.pack_into(packet, checksum_at, csum)
