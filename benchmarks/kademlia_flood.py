"""A Kademlia flood: what one peer asking FIND_NODE as fast as it can costs a daemon.

What it measures
    A ``volunteerd serve`` process (2 tiny experts, 127.0.0.1) is flooded for
    ``--seconds`` by one attacker peer (in this process, real libp2p) pipelining
    FIND_NODE requests for random keys on ``--streams`` Kademlia streams, reopening a
    stream whenever the daemon resets it; meanwhile another peer asks one FIND_NODE
    every 0.2 s. Reported per mode: the answers the attacker got a second, the daemon's
    CPU (% of one core, from /proc) and the honest peer's FIND_NODE latency.

    ``paced`` is the default configuration (``peer_limits.dht_messages_per_s`` 50,
    burst 250); ``unpaced`` raises both to a billion, which is what py-libp2p's handler
    does on its own. Loopback counts per peer only, so the address's share does not
    enter here.

Run::

    .venv/bin/python benchmarks/kademlia_flood.py
    .venv/bin/python benchmarks/kademlia_flood.py --seconds 20 --streams 4 --mode paced
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Any

import trio
from daemon_proc import cpu_seconds, volunteerd_process
from libp2p.kad_dht.common import MAX_DHT_MESSAGE_SIZE, PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

from volunteerd.logs import configure_logging
from volunteerd.net import PeerAddress
from volunteerd.testing import local_config, open_peer

UNPACED = ("--set", "peer_limits.dht_messages_per_s=1000000000",
           "--set", "peer_limits.dht_message_burst=1000000000")  # fmt: skip


def find_nodes(count: int) -> bytes:
    frames = []
    for _ in range(count):
        data = Message(type=Message.MessageType.FIND_NODE, key=os.urandom(34)).SerializeToString()
        frames.append(encode_varint_prefixed(data))
    return b"".join(frames)


async def keep_asking(stream: Any) -> None:
    while True:
        await stream.write(find_nodes(50))


async def flood_stream(attacker: Any, target: ID, answers: list[int]) -> None:
    """Pipeline requests on one stream after another until cancelled."""
    while True:
        try:
            stream = await attacker.host.new_stream(target, [PROTOCOL_ID])
        except Exception:
            await trio.sleep(0.05)
            continue
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_asking, stream)
                while True:
                    await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
                    answers[0] += 1
        except Exception:  # the daemon reset the stream (its lifetime is over): reopen
            pass
        finally:
            with contextlib.suppress(Exception):
                await stream.reset()


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


async def measure(info: dict[str, Any], seconds: float, streams: int) -> dict[str, float]:
    address = PeerAddress(info["peer_id"], tuple(a.split("/p2p/")[0] for a in info["multiaddrs"]))
    target = ID.from_base58(info["peer_id"])
    async with open_peer(local_config()) as attacker, open_peer(local_config()) as asker:
        await attacker.rpc.connect(address)
        await asker.rpc.connect(address)
        answers = [0]
        latencies: list[float] = []
        failed = 0
        pid = int(info["pid"])
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(flood_stream, attacker, target, answers)
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
    parser.add_argument("--seconds", type=float, default=10.0, help="flood length per mode")
    parser.add_argument("--streams", type=int, default=4, help="attacker's streams at once")
    parser.add_argument("--mode", default="unpaced,paced", help="modes, comma-separated")
    args = parser.parse_args()
    modes = args.mode.split(",")
    if not set(modes) <= {"paced", "unpaced"}:
        parser.error(f"--mode: paced and/or unpaced, not {args.mode!r}")
    configure_logging("ERROR")
    print(
        f"one attacker, {args.streams} pipelined Kademlia streams, {args.seconds:.0f} s; "
        "another peer asks every 0.2 s"
    )
    print(f"{'mode':10} {'answers/s':>10} {'daemon CPU %':>13} {'honest p50 ms':>14} "
          f"{'p95 ms':>8} {'answered':>9} {'failed':>7}")  # fmt: skip
    for mode in modes:
        extra = UNPACED if mode == "unpaced" else ()
        with volunteerd_process(
            "serve", "--experts", "ffn.0.[0:2]", "--set", "experts.hidden_dim=64",
            "--set", 'runtime.device="cpu"', *extra,
        ) as daemon:  # fmt: skip
            row = trio.run(measure, daemon.info, args.seconds, args.streams)
        print(
            f"{mode:10} {row['answers_per_s']:10.0f} {row['cpu_pct']:13.0f} "
            f"{row['p50_ms']:14.1f} {row['p95_ms']:8.1f} {row['asked']:9.0f} {row['failed']:7.0f}"
        )


if __name__ == "__main__":
    main()
