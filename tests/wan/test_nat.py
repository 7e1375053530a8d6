"""NAT translation tables and checksum rewriting on synthetic packets."""

from __future__ import annotations

import random
import struct

import pytest

from tests.wan.synthetic import checksums_hold, packet
from volunteerd.testing.wan.nat import UDP_TIMEOUT_S, Nat
from volunteerd.testing.wan.packet import (
    PROTO_ICMP,
    PROTO_TCP,
    PROTO_UDP,
    address_int,
    checksum,
    ports,
    rewrite_destination,
    rewrite_source,
)

PRIVATE = "192.168.1.2"
PUBLIC = "10.200.0.2"
PEER = "10.200.0.1"
THIRD = "10.200.0.3"


def addresses(data: bytearray) -> tuple[str, int, str, int]:
    source_port, destination_port = ports(data)
    return (
        ".".join(map(str, data[12:16])),
        source_port,
        ".".join(map(str, data[16:20])),
        destination_port,
    )


@pytest.mark.parametrize("protocol", [PROTO_TCP, PROTO_UDP])
def test_rewrites_keep_every_checksum_valid(protocol: int) -> None:
    rng = random.Random(5)
    for _ in range(300):
        data = packet(
            protocol,
            f"192.168.{rng.randrange(256)}.{rng.randrange(256)}",
            rng.randrange(65536),
            f"10.200.{rng.randrange(256)}.{rng.randrange(256)}",
            rng.randrange(65536),
            payload=rng.randbytes(rng.randrange(0, 60)),
        )
        rewrite_source(data, rng.getrandbits(32), rng.randrange(65536))
        assert checksums_hold(data)
        rewrite_destination(data, rng.getrandbits(32), rng.randrange(65536))
        assert checksums_hold(data)


def test_a_udp_packet_without_checksum_keeps_none() -> None:
    data = packet(PROTO_UDP, PRIVATE, 5000, PEER, 6000)
    struct.pack_into("!H", data, 26, 0)
    rewrite_source(data, address_int(PUBLIC), 7000)
    assert struct.unpack_from("!H", data, 26)[0] == 0
    assert checksum(data[:20]) == 0


def nat(kind: str) -> Nat:
    return Nat(kind, address_int(PRIVATE), address_int(PUBLIC), random.Random(0))  # type: ignore[arg-type]


def test_cone_keeps_the_port_and_lets_anyone_answer() -> None:
    cone = nat("cone")
    out = packet(PROTO_UDP, PRIVATE, 4000, PEER, 9000)
    assert cone.outbound(out, now=0.0)
    assert addresses(out) == (PUBLIC, 4000, PEER, 9000)
    assert checksums_hold(out)
    # the same internal port to another destination: the same mapping
    other = packet(PROTO_UDP, PRIVATE, 4000, THIRD, 9100)
    assert cone.outbound(other, now=0.0)
    assert addresses(other)[1] == 4000
    assert cone.mappings() == 1
    # a host it never sent to gets in (full cone)
    knock = packet(PROTO_UDP, "10.200.0.9", 1234, PUBLIC, 4000)
    assert cone.inbound(knock, now=1.0)
    assert addresses(knock) == ("10.200.0.9", 1234, PRIVATE, 4000)
    assert checksums_hold(knock)


def test_symmetric_maps_each_destination_apart_and_filters_by_it() -> None:
    symmetric = nat("symmetric")
    first = packet(PROTO_TCP, PRIVATE, 4000, PEER, 9000)
    second = packet(PROTO_TCP, PRIVATE, 4000, THIRD, 9000)
    assert symmetric.outbound(first, now=0.0)
    assert symmetric.outbound(second, now=0.0)
    external_first, external_second = addresses(first)[1], addresses(second)[1]
    assert external_first != external_second
    assert checksums_hold(first)
    reply = packet(PROTO_TCP, PEER, 9000, PUBLIC, external_first)
    assert symmetric.inbound(reply, now=0.1)
    assert addresses(reply) == (PEER, 9000, PRIVATE, 4000)
    # the third host may not use the peer's mapping, nor the peer from another port
    assert not symmetric.inbound(packet(PROTO_TCP, THIRD, 9000, PUBLIC, external_first), now=0.1)
    assert not symmetric.inbound(packet(PROTO_TCP, PEER, 9001, PUBLIC, external_first), now=0.1)


@pytest.mark.parametrize("kind", ["cone", "symmetric"])
def test_nothing_gets_in_without_a_mapping(kind: str) -> None:
    assert not nat(kind).inbound(packet(PROTO_TCP, PEER, 9000, PUBLIC, 22), now=0.0)


def test_a_taken_port_is_not_preserved_across_protocols_only_within() -> None:
    cone = nat("cone")
    udp = packet(PROTO_UDP, PRIVATE, 4000, PEER, 9000)
    tcp = packet(PROTO_TCP, PRIVATE, 4000, PEER, 9000)
    assert cone.outbound(udp, now=0.0)
    assert cone.outbound(tcp, now=0.0)
    assert addresses(udp)[1] == addresses(tcp)[1] == 4000


def test_idle_udp_mappings_expire() -> None:
    cone = nat("cone")
    assert cone.outbound(packet(PROTO_UDP, PRIVATE, 4000, PEER, 9000), now=0.0)
    cone.expire(now=UDP_TIMEOUT_S / 2)
    assert cone.inbound(packet(PROTO_UDP, PEER, 9000, PUBLIC, 4000), now=UDP_TIMEOUT_S / 2)
    cone.expire(now=UDP_TIMEOUT_S * 2)
    assert cone.mappings() == 0
    assert not cone.inbound(packet(PROTO_UDP, PEER, 9000, PUBLIC, 4000), now=UDP_TIMEOUT_S * 2)


def test_icmp_and_fragments_do_not_cross() -> None:
    cone = nat("cone")
    icmp = packet(PROTO_UDP, PRIVATE, 4000, PEER, 9000)
    icmp[9] = PROTO_ICMP
    assert not cone.outbound(icmp, now=0.0)
    fragment = packet(PROTO_UDP, PRIVATE, 4000, PEER, 9000)
    struct.pack_into("!H", fragment, 6, 0x2000)  # more fragments follow
    assert not cone.outbound(fragment, now=0.0)
