"""Floods of py-libp2p's own protocols: what one peer asking as fast as it can costs a
daemon.

What it measures
    A ``volunteerd serve`` process (2 tiny experts, 127.0.0.1) is flooded for
    ``--seconds`` by one attacker peer (in this process, real libp2p) with one of:

    * ``kademlia``: FIND_NODE requests for random keys pipelined on ``--streams``
      Kademlia streams, each reopened when the daemon resets it;
    * ``identify``: identify streams opened and read by ``--streams`` tasks in a loop;
    * ``ping``: 32-byte pings pipelined on ``min(--streams, 2)`` ping streams (py-libp2p
      serves 2 per peer);
    * ``unknown``: streams for a protocol nobody serves, opened by ``--streams`` tasks in
      a loop (each costs the daemon a multistream-select negotiation that ends in "na");
    * ``resets``: yamux streams opened and reset at once by ``--streams`` tasks, no
      protocol asked (what the daemon pays is yamux's and trio's work per stream); the
      attacker reconnects whenever the daemon closes its connection;
    * ``frames``: 12-byte Yamux window updates for a stream that does not exist, written
      1000 at a time by ``--streams`` tasks on the attacker's connection (1.7 MB/s of
      them is what a core of py-libp2p reads).

    Meanwhile another peer asks the daemon one FIND_NODE every 0.2 s. Reported per
    (flood, mode): what the attacker got answered a second, the daemon's CPU (% of one
    core, from /proc) and the other peer's FIND_NODE latency.

    ``paced`` is the default configuration (``peer_limits.dht_messages_per_s`` 50, burst
    250; ``peer_limits.identify_ping_per_s`` 2, burst 20; ``peer_limits.streams_per_s``
    50, burst 250; ``peer_limits.small_frames_per_s`` 2000, burst 10000); ``unpaced``
    raises them all to a billion: what py-libp2p's handlers
    do on their own. Loopback counts per peer only, so the address's share does not
    enter here.

Run::

    .venv/bin/python benchmarks/flood.py
    .venv/bin/python benchmarks/flood.py --flood kademlia --seconds 20 --mode paced
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from daemon_proc import cpu_seconds, volunteerd_process
from libp2p.host.ping import ID as PING_ID
from libp2p.identity.identify.identify import ID as IDENTIFY_ID
from libp2p.kad_dht.common import MAX_DHT_MESSAGE_SIZE, PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

from volunteerd.logs import configure_logging
from volunteerd.net import PeerAddress
from volunteerd.testing import local_config, open_peer

BILLION = "1000000000"
UNPACED = [
    arg
    for key in (
        "dht_messages_per_s", "dht_message_burst", "identify_ping_per_s", "identify_ping_burst",
        "streams_per_s", "stream_burst", "small_frames_per_s", "small_frame_burst",
    )
    for arg in ("--set", f"peer_limits.{key}={BILLION}")
]  # fmt: skip
FLOODS = ("kademlia", "identify", "ping", "unknown", "resets", "frames")
WINDOW_UPDATES = struct.pack("!BBHII", 0, 1, 0, 999_999, 0) * 1000  # no such stream

Flood = Callable[[Any, ID, list[int]], Awaitable[None]]


def find_nodes(count: int) -> bytes:
    frames = []
    for _ in range(count):
        data = Message(type=Message.MessageType.FIND_NODE, key=os.urandom(34)).SerializeToString()
        frames.append(encode_varint_prefixed(data))
    return b"".join(frames)


async def keep_writing(stream: Any, data: Callable[[], bytes]) -> None:
    while True:
        await stream.write(data())


async def kademlia(attacker: Any, target: ID, answers: list[int]) -> None:
    """FIND_NODE pipelined on one stream after another until cancelled."""
    while True:
        try:
            stream = await attacker.host.new_stream(target, [PROTOCOL_ID])
        except Exception:
            await trio.sleep(0.05)
            continue
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_writing, stream, lambda: find_nodes(50))
                while True:
                    await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
                    answers[0] += 1
        except Exception:  # the daemon reset the stream (its lifetime is over): reopen
            pass
        finally:
            with contextlib.suppress(Exception):
                await stream.reset()


async def identify(attacker: Any, target: ID, answers: list[int]) -> None:
    """Identify streams, one after another, until cancelled."""
    while True:
        try:
            stream = await attacker.host.new_stream(target, [IDENTIFY_ID])
            await read_varint_prefixed_bytes_limited(stream, 1 << 20)
            answers[0] += 1
            await stream.close()
        except Exception:  # refused: wait a little
            await trio.sleep(0.01)


async def ping(attacker: Any, target: ID, answers: list[int]) -> None:
    """Pings pipelined on one stream until cancelled; counts the echoes."""
    stream = await attacker.host.new_stream(target, [PING_ID])
    got = 0
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_writing, stream, lambda: os.urandom(32) * 100)
            while True:
                data = await stream.read(65536)
                if not data:
                    return
                got += len(data)
                answers[0] += got // 32
                got %= 32
    except Exception:
        return


async def unknown(attacker: Any, target: ID, answers: list[int]) -> None:
    """Streams for a protocol nobody serves, one after another; counts the refusals."""
    while True:
        try:
            await attacker.host.new_stream(target, ["/nobody/1.0.0"])
        except Exception:  # "na" (or reset while too many waited): as expected
            answers[0] += 1


async def on_connection(
    attacker: Any, target: ID, answers: list[int], act: Callable[[Any], Awaitable[int]]
) -> None:
    """``act`` on the attacker's muxed connection to the daemon again and again (dialled
    again whenever the daemon closed it), adding what it returns to the count."""
    while True:
        try:
            connections = attacker.host.get_network().connections.get(target)
            if not connections:
                await attacker.host.connect(attacker.host.get_peerstore().peer_info(target))
                continue
            done = await act(connections[0].muxed_conn)
            answers[0] += done  # not `+= await`: that reads the count before awaiting
        except Exception:  # the connection closed under us: dial again
            await trio.sleep(0.001)


async def resets(attacker: Any, target: ID, answers: list[int]) -> None:
    """Streams opened and reset at once; counts the streams."""

    async def open_and_reset(muxed: Any) -> int:
        stream = await muxed.open_stream()
        await stream.reset()
        return 1

    await on_connection(attacker, target, answers, open_and_reset)


async def window_updates(attacker: Any, target: ID, answers: list[int]) -> None:
    """Window updates for a stream that does not exist, written straight to the
    secured connection (TCP keeps them coming as fast as they are read); counts the
    frames written."""

    async def write(muxed: Any) -> int:
        await muxed.secured_conn.write(WINDOW_UPDATES)
        return 1000

    await on_connection(attacker, target, answers, write)


async def ask(asker: Any, target: ID, key: bytes) -> float:
    started = time.perf_counter()
    stream = await asker.host.new_stream(target, [PROTOCOL_ID])
    try:
        data = Message(type=Message.MessageType.FIND_NODE, key=key).SerializeToString()
        await stream.write(encode_varint_prefixed(data))
        await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
    finally:
        with contextlib.suppress(Exception):
            await stream.close()
    return time.perf_counter() - started


async def measure(
    info: dict[str, Any], flood: Flood, tasks: int, seconds: float
) -> dict[str, float]:
    address = PeerAddress(info["peer_id"], tuple(a.split("/p2p/")[0] for a in info["multiaddrs"]))
    target = ID.from_base58(info["peer_id"])
    # The attacker reads the daemon's answers as fast as they come (a node of ours
    # would pace the small frames they arrive in, and flood at that pace).
    reader = local_config(peer_limits={"small_frames_per_s": 1e9, "small_frame_burst": 10**9})
    async with open_peer(reader) as attacker, open_peer(local_config()) as asker:
        await attacker.rpc.connect(address)
        await asker.rpc.connect(address)
        answers = [0]
        latencies: list[float] = []
        failed = 0
        pid = int(info["pid"])
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        async with trio.open_nursery() as nursery:
            for _ in range(tasks):
                nursery.start_soon(flood, attacker, target, answers)
            with trio.move_on_after(seconds):
                while True:
                    try:
                        with trio.fail_after(5):
                            latencies.append(await ask(asker, target, os.urandom(34)))
                    except Exception:
                        failed += 1
                    await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
        elapsed = time.monotonic() - t0
        cpu = cpu_seconds(pid) - cpu0
    ordered = sorted(latencies) or [float("nan")]
    return {
        "answers_per_s": answers[0] / elapsed,
        "cpu_pct": 100 * cpu / elapsed,
        "p50_ms": 1000 * statistics.median(ordered),
        "p95_ms": 1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "asked": len(latencies),
        "failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", default=",".join(FLOODS), help="floods, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each flood")
    parser.add_argument("--streams", type=int, default=4, help="attacker's streams at once")
    parser.add_argument("--mode", default="unpaced,paced", help="modes, comma-separated")
    args = parser.parse_args()
    floods, modes = args.flood.split(","), args.mode.split(",")
    if not set(floods) <= set(FLOODS):
        parser.error(f"--flood: some of {', '.join(FLOODS)}, not {args.flood!r}")
    if not set(modes) <= {"paced", "unpaced"}:
        parser.error(f"--mode: paced and/or unpaced, not {args.mode!r}")
    if args.streams < 1:
        parser.error("--streams: at least 1")
    configure_logging("ERROR")
    print(
        f"one attacker, {args.streams} streams or tasks, {args.seconds:.0f} s per flood; "
        "another peer asks one FIND_NODE every 0.2 s"
    )
    print(f"{'flood':9} {'mode':8} {'answered/s':>10} {'daemon CPU %':>13} "
          f"{'other p50 ms':>13} {'p95 ms':>7} {'answered':>9} {'failed':>7}")  # fmt: skip
    runs: dict[str, tuple[Flood, int]] = {
        "kademlia": (kademlia, args.streams),
        "identify": (identify, args.streams),
        "ping": (ping, min(args.streams, 2)),
        "unknown": (unknown, args.streams),
        "resets": (resets, args.streams),
        "frames": (window_updates, args.streams),
    }
    for name in floods:
        flood, tasks = runs[name]
        for mode in modes:
            extra = UNPACED if mode == "unpaced" else []
            with volunteerd_process(
                "serve", "--experts", "ffn.0.[0:2]", "--set", "experts.hidden_dim=64",
                "--set", 'runtime.device="cpu"', *extra,
            ) as daemon:  # fmt: skip
                row = trio.run(measure, daemon.info, flood, tasks, args.seconds)
            print(
                f"{name:9} {mode:8} {row['answers_per_s']:10.0f} {row['cpu_pct']:13.0f} "
                f"{row['p50_ms']:13.1f} {row['p95_ms']:7.1f} {row['asked']:9.0f} "
                f"{row['failed']:7.0f}"
            )


if __name__ == "__main__":
    main()
