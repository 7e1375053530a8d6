"""Synthetic IPv4 packets for the NAT and router tests."""

from __future__ import annotations

import struct

from volunteerd.testing.wan.packet import PROTO_TCP, address_int, checksum


def packet(
    protocol: int,
    source: str,
    source_port: int,
    destination: str,
    destination_port: int,
    payload: bytes = b"payload!",
) -> bytearray:
    """An IPv4 TCP or UDP packet with correct checksums."""
    if protocol == PROTO_TCP:
        transport = bytearray(
            struct.pack(
                "!HHIIBBHHH", source_port, destination_port, 1, 0, 5 << 4, 0x02, 65535, 0, 0
            )
        )
        checksum_at = 16
    else:
        transport = bytearray(
            struct.pack("!HHHH", source_port, destination_port, 8 + len(payload), 0)
        )
        checksum_at = 6
    transport += payload
    src, dst = address_int(source), address_int(destination)
    pseudo = struct.pack("!IIBBH", src, dst, 0, protocol, len(transport))
    struct.pack_into("!H", transport, checksum_at, checksum(pseudo + transport))
    header = bytearray(
        struct.pack(
            "!BBHHHBBHII", 0x45, 0, 20 + len(transport), 7, 0x4000, 64, protocol, 0, src, dst
        )
    )
    struct.pack_into("!H", header, 10, checksum(header))
    return header + transport


def checksums_hold(data: bytearray) -> bool:
    """What the receiving kernel verifies: the IP header and the TCP/UDP checksum."""
    protocol = data[9]
    transport = data[20:]
    pseudo = data[12:20] + struct.pack("!BBH", 0, protocol, len(transport))
    return checksum(data[:20]) == 0 and checksum(pseudo + transport) == 0
