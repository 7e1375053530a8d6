"""The link scheduler on a fake clock: serialisation, queueing delay, drop-tail."""

from __future__ import annotations

import math

import pytest

from volunteerd.testing.wan.link import Link


def test_an_idle_link_sends_a_packet_in_its_serialisation_time() -> None:
    link = Link(mbit=8, queue_ms=100, mtu=1500)  # 1 byte per microsecond
    assert link.admit(10.0, 1000) == pytest.approx(10.001)


def test_back_to_back_packets_queue_behind_each_other() -> None:
    link = Link(mbit=8, queue_ms=100, mtu=1500)
    departures = [link.admit(0.0, 1000) for _ in range(3)]
    assert departures == pytest.approx([0.001, 0.002, 0.003])
    assert link.backlog_bytes(0.0015) == pytest.approx(1500)
    # a packet arriving after the queue drained waits for nothing
    assert link.admit(1.0, 1000) == pytest.approx(1.001)


def test_a_full_queue_drops_the_arriving_packet() -> None:
    link = Link(mbit=8, queue_ms=10, mtu=1500)  # holds 10000 bytes
    admitted = [link.admit(0.0, 1000) for _ in range(12)]
    assert [a is not None for a in admitted] == [True] * 10 + [False] * 2
    # the last admitted packet waited the whole queue: queueing delay == queue_ms
    assert admitted[9] == pytest.approx(0.010)
    # once a packet's worth has been sent, one more fits
    assert link.admit(0.001, 1000) == pytest.approx(0.011)
    assert link.admit(0.001, 1000) is None


def test_a_tiny_queue_still_holds_two_full_packets() -> None:
    link = Link(mbit=1, queue_ms=0, mtu=1500)
    assert link.admit(0.0, 1500) is not None
    assert link.admit(0.0, 1500) is not None
    assert link.admit(0.0, 1500) is None


def test_an_unlimited_link_adds_no_delay() -> None:
    link = Link(mbit=math.inf, queue_ms=0, mtu=1500)
    assert all(link.admit(5.0, 1500) == 5.0 for _ in range(1000))
    assert link.backlog_bytes(5.0) == 0
