"""The router's forwarding on a fake clock: hosts are datagram socket pairs instead of
TUN devices (one write, one packet)."""

from __future__ import annotations

import random
import socket
import struct
from collections.abc import Iterator

import pytest

from tests.wan.synthetic import checksums_hold, packet
from volunteerd.testing.wan.nat import Nat
from volunteerd.testing.wan.packet import PROTO_UDP, address_int
from volunteerd.testing.wan.profile import LinkSpec
from volunteerd.testing.wan.router import HostLink, Router

MTU = 1500


class World:
    """Hosts whose deliveries land in socket pairs; `run_until` plays the router's clock."""

    def __init__(self, specs: list[LinkSpec], seed: int = 0) -> None:
        self.pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in specs]
        for reader, _ in self.pairs:
            reader.setblocking(False)
        self.hosts = [
            HostLink(i, writer.fileno(), address_int(f"10.200.0.{i + 1}"), spec, MTU)
            for i, (spec, (_, writer)) in enumerate(zip(specs, self.pairs, strict=True))
        ]
        self.router = Router(self.hosts, seed=seed, mtu=MTU)
        self.arrivals: list[tuple[float, int, bytes]] = []

    def send(
        self, source: int, destination: int, now: float, sequence: int = 0, size: int = 100
    ) -> None:
        data = packet(
            PROTO_UDP,
            f"10.200.0.{source + 1}",
            5000,
            f"10.200.0.{destination + 1}",
            6000,
            payload=struct.pack("!I", sequence) + b"x" * (size - 32),
        )
        self.router.receive(self.hosts[source], bytes(data), now)

    def run_until(self, end: float, start: float = 0.0, step: float = 0.0001) -> None:
        now = start
        while now <= end:
            self.router.release_due(now)
            for index, (reader, _) in enumerate(self.pairs):
                while True:
                    try:
                        data = reader.recv(1 << 16)
                    except BlockingIOError:
                        break
                    self.arrivals.append((now, index, data))
            now += step

    def close(self) -> None:
        for reader, writer in self.pairs:
            reader.close()
            writer.close()


@pytest.fixture
def world_of() -> Iterator[type[World]]:
    made: list[World] = []

    class Closing(World):
        def __init__(self, specs: list[LinkSpec], seed: int = 0) -> None:
            super().__init__(specs, seed)
            made.append(self)

    yield Closing
    for world in made:
        world.close()


def test_a_packet_takes_both_delays_and_both_serialisations(world_of: type[World]) -> None:
    world = world_of([LinkSpec(delay_ms=10, up_mbit=8), LinkSpec(delay_ms=30, down_mbit=8)])
    world.send(0, 1, now=0.0, size=1000)  # 1000 bytes at 8 Mbit/s: 1 ms per link
    world.run_until(0.05)
    ((arrived_at, index, _),) = world.arrivals
    assert index == 1
    assert arrived_at == pytest.approx(0.001 + 0.010 + 0.001 + 0.030, abs=0.0002)


def test_jitter_never_reorders_one_direction_of_a_pair(world_of: type[World]) -> None:
    world = world_of([LinkSpec(delay_ms=5, jitter_ms=20), LinkSpec(delay_ms=5, jitter_ms=20)])
    for sequence in range(200):
        world.send(0, 1, now=sequence * 0.0002, sequence=sequence)
    world.run_until(0.2)
    order = [struct.unpack_from("!I", data, 28)[0] for _, _, data in world.arrivals]
    assert order == list(range(200))
    times = [at for at, _, _ in world.arrivals]
    assert max(times) - min(times) > 0.02  # the jitter was there


def test_loss_is_drawn_from_the_seed(world_of: type[World]) -> None:
    def delivered(seed: int) -> list[int]:
        world = world_of([LinkSpec(loss=0.3), LinkSpec()], seed=seed)
        for sequence in range(100):
            world.send(0, 1, now=0.0, sequence=sequence)
        world.run_until(0.01)
        return [struct.unpack_from("!I", data, 28)[0] for _, _, data in world.arrivals]

    assert delivered(1) == delivered(1)
    assert delivered(1) != delivered(2)
    assert 50 < len(delivered(1)) < 90


def test_a_nat_host_is_translated_both_ways(world_of: type[World]) -> None:
    world = world_of([LinkSpec(), LinkSpec(nat="cone")])
    world.hosts[1].nat = Nat(
        "cone", address_int("192.168.1.2"), address_int("10.200.0.2"), random.Random(0)
    )
    unsolicited = packet(PROTO_UDP, "10.200.0.1", 6000, "10.200.0.2", 5000)
    world.router.receive(world.hosts[0], bytes(unsolicited), 0.0)
    world.run_until(0.01)
    outbound = packet(PROTO_UDP, "192.168.1.2", 5000, "10.200.0.1", 6000)
    world.router.receive(world.hosts[1], bytes(outbound), 0.02)
    world.router.receive(world.hosts[0], bytes(unsolicited), 0.02)
    world.run_until(0.03, start=0.02)
    (_, first_to, first), (_, second_to, second) = world.arrivals
    assert (first_to, first[12:16]) == (0, bytes([10, 200, 0, 2]))
    assert (second_to, second[16:20]) == (1, bytes([192, 168, 1, 2]))
    assert checksums_hold(bytearray(first))
    assert checksums_hold(bytearray(second))
    assert world.hosts[1].counters.nat_dropped == 1


def test_unroutable_and_non_ipv4_packets_are_counted_not_sent(world_of: type[World]) -> None:
    world = world_of([LinkSpec(), LinkSpec()])
    world.router.receive(
        world.hosts[0], bytes(packet(PROTO_UDP, "10.200.0.1", 1, "10.200.9.9", 2)), 0.0
    )
    world.router.receive(world.hosts[0], b"\x60" + bytes(60), 0.0)
    world.run_until(0.01)
    assert world.arrivals == []
    assert world.hosts[0].counters.unroutable == 2
