"""py-libp2p's identify and ping, the negotiation of any inbound stream and small Yamux
frames, handled for others at a paced rate (real libp2p on 127.0.0.1): a peer asking as
fast as it can gets the burst and then the rate, while another peer is answered at
once."""

from __future__ import annotations

import contextlib
import os
import struct
from typing import Any

import pytest
import trio
import trio.lowlevel
from libp2p.host.ping import ID as PING_ID
from libp2p.identity.identify.identify import ID as IDENTIFY_ID
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.utils.varint import encode_delim, read_varint_prefixed_bytes_limited

from volunteerd.config import PeerLimitsConfig
from volunteerd.net.protocols import Verb
from volunteerd.net.records import FindRequest
from volunteerd.testing import local_config, open_node_and_peers, open_peer

pytestmark = pytest.mark.slow

SECONDS = 3.0
DEFAULTS = PeerLimitsConfig()
BURST = DEFAULTS.identify_ping_burst


def _most(elapsed: float) -> float:
    """What the pacer lets one peer have in ``elapsed`` seconds, with one for luck."""
    return BURST + DEFAULTS.identify_ping_per_s * elapsed + 1


async def _identify(asker: Any, node: Any) -> Identify:
    stream = await asker.host.new_stream(node.host.get_id(), [IDENTIFY_ID])
    try:
        data = await read_varint_prefixed_bytes_limited(stream, 1 << 20)
    finally:
        with contextlib.suppress(Exception):
            await stream.close()
    answer = Identify()
    answer.ParseFromString(data)
    return answer


async def test_a_peer_identifying_in_a_loop_gets_the_burst_then_the_rate() -> None:
    async with open_node_and_peers({}, peers=1) as (node, attacker):
        answered = 0
        started = trio.current_time()

        async def loop() -> None:
            nonlocal answered
            while True:
                try:
                    stream = await attacker.host.new_stream(node.host.get_id(), [IDENTIFY_ID])
                    if await stream.read(65536):
                        answered += 1
                    await stream.close()
                except Exception:  # reset: too many of its streams were waiting
                    await trio.lowlevel.checkpoint()

        with trio.move_on_after(SECONDS):
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(loop)
        elapsed = trio.current_time() - started
        assert BURST <= answered <= _most(elapsed)
        assert node.services is not None
        assert node.services.waits > 0
        # Another peer has its own budget: identified at once.
        async with open_peer(local_config()) as asker:
            await asker.rpc.connect(node.address)
            with trio.fail_after(30):
                answer = await _identify(asker, node)
            assert IDENTIFY_ID in answer.protocols


async def test_pings_on_one_stream_are_echoed_at_the_paced_rate() -> None:
    async with open_node_and_peers({}, peers=1) as (node, attacker):
        stream = await attacker.host.new_stream(node.host.get_id(), [PING_ID])
        pings = os.urandom(32) * 200
        await stream.write(pings)
        echoed = b""
        started = trio.current_time()
        with trio.move_on_after(SECONDS):
            while len(echoed) < len(pings):
                echoed += await stream.read(65536)
        elapsed = trio.current_time() - started
        with contextlib.suppress(Exception):
            await stream.reset()
        assert echoed == pings[: len(echoed)]  # what was echoed is what was sent
        assert BURST - 1 <= len(echoed) // 32 <= _most(elapsed)


async def test_streams_for_a_protocol_nobody_serves_are_negotiated_at_the_paced_rate() -> None:
    limits = {"streams_per_s": 20, "stream_burst": 50}
    burst, rate = 50, 20
    async with open_node_and_peers(limits, peers=1) as (node, attacker):
        tried = 0
        started = trio.current_time()

        async def loop() -> None:
            nonlocal tried
            while True:
                with contextlib.suppress(Exception):  # "not supported", as it should be
                    await attacker.host.new_stream(node.host.get_id(), ["/nobody/1.0.0"])
                tried += 1

        with trio.move_on_after(SECONDS):
            async with trio.open_nursery() as nursery:
                for _ in range(6):  # fewer than may wait: none is reset unread
                    nursery.start_soon(loop)
        elapsed = trio.current_time() - started
        # Unpaced, a node negotiates well over a thousand a second.
        assert burst // 2 <= tried <= burst + rate * elapsed + 8
        assert node.negotiations is not None
        assert node.negotiations.waits > 0
        # Another peer has its own budget: its streams are negotiated at once.
        async with open_peer(local_config()) as asker:
            with trio.fail_after(10):
                await asker.rpc.call(node.address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))


async def test_a_negotiation_reads_a_few_proposals_not_as_many_as_are_sent() -> None:
    async with open_node_and_peers({}, peers=1) as (node, attacker):
        connection = attacker.host.get_network().connections[node.host.get_id()][0]
        stream = await connection.muxed_conn.open_stream()
        header = encode_delim(b"/multistream/1.0.0")
        proposals = b"".join(encode_delim(f"/nobody/{i}".encode()) for i in range(200))
        await stream.write(header + proposals)
        answers = b""
        with trio.move_on_after(SECONDS), contextlib.suppress(Exception):  # reset: done
            while data := await stream.read(65536):
                answers += data
        refusals = answers.count(b"na\n")
        assert 1 <= refusals <= 8  # py-libp2p alone answers all 200


async def test_a_peer_opening_streams_faster_than_they_are_served_loses_its_connection() -> None:
    limits = {"streams_per_s": 20, "stream_burst": 50}
    async with open_node_and_peers(limits, peers=1) as (node, attacker):
        network = attacker.host.get_network()
        connection = network.connections[node.host.get_id()][0]
        opened = 0
        with trio.move_on_after(SECONDS):
            while not connection.muxed_conn.is_closed:
                try:
                    stream = await connection.muxed_conn.open_stream()
                    await stream.reset()  # yamux's work, and trio's, but no negotiation
                    opened += 1
                except Exception:  # the node closed the connection
                    break
        # Paced alone, the streams would be reset one by one, on an open connection.
        with trio.fail_after(10):
            await connection.muxed_conn.event_closed.wait()
        assert opened >= 50  # the burst, at least, was let through
        assert node.negotiations is not None
        assert node.negotiations.refused >= 1
        # The peer is not banned: once its bucket refills it is served again.
        await trio.sleep(1.0)
        with trio.fail_after(10):
            await attacker.rpc.call(node.address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))


async def test_small_yamux_frames_are_read_at_the_paced_rate() -> None:
    """12-byte window updates for a stream that does not exist cost the sender nothing
    and py-libp2p ~7 µs each: read at the rate, the flood delays what follows it on the
    same connection (a call), not another peer's call."""
    limits = {"small_frames_per_s": 1000, "small_frame_burst": 2000}
    frames = 5000  # 3 s of them beyond the burst
    async with open_node_and_peers(limits) as (node, attacker, asker):
        connection = attacker.host.get_network().connections[node.host.get_id()][0]
        update = struct.pack("!BBHII", 0, 1, 0, 999_999, 0)  # WINDOW_UPDATE, no such stream
        await connection.muxed_conn.secured_conn.write(update * frames)
        started = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def call_behind_the_flood() -> None:
                await attacker.rpc.call(node.address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))
                behind.append(trio.current_time() - started)

            behind: list[float] = []
            nursery.start_soon(call_behind_the_flood)
            with trio.fail_after(2):  # another peer's connection is read as usual
                await asker.rpc.call(node.address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))
            assert not behind
        # Unpaced, the node reads all 5000 in a few tens of milliseconds.
        assert behind[0] >= 0.8 * (frames - 2000) / 1000
        assert node.small_frames is not None
        assert node.small_frames.waits > 0
