"""Connections that never handshake: can newcomers still get in?

What it measures
    A ``volunteerd serve`` process (2 tiny experts, 127.0.0.1, ``limit_loopback`` on so
    that loopback addresses count like any other) is held by an attacker that keeps
    ``--per-address`` TCP connections open from each of ``--addresses`` addresses
    (127.0.0.2, 127.0.0.3, ...) without ever sending a byte (``--first-bytes``: after
    sending multistream's header, as a dialer does first), opening a new one whenever
    the daemon closes one (py-libp2p's upgrade timeout does after 10 s). Meanwhile a
    newcomer (a fresh identity each time, from 127.0.0.1) connects and asks one
    FIND_NODE every 0.5 s with a 5 s connect timeout, as a daemon would. Reported: how
    many newcomers got their answer, and how long connecting and asking took.

    The daemon runs its default configuration: a connection queues for one of the 32
    handshake slots once its first bytes are in, in turns by address, and gives its
    slot back once its peer has kept it waiting 1 s. To see a version from before
    that, run this script in a checkout of it (``PYTHONPATH`` set to that checkout).

Run::

    .venv/bin/python benchmarks/stalls.py
    .venv/bin/python benchmarks/stalls.py --addresses 1,16 --seconds 30
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import trio
from daemon_proc import cpu_seconds, volunteerd_process

from volunteerd.logs import configure_logging
from volunteerd.net import PeerAddress, Verb
from volunteerd.net.records import FindRequest
from volunteerd.testing import local_config
from volunteerd.testing.clients import open_bare_client

HEADER = b"\x13/multistream/1.0.0\n"  # what a dialer sends first


async def hold_stalled(port: int, source: str, count: int, opened: list[int], first: bytes) -> None:
    """Keep ``count`` connections from ``source`` open that send ``first`` and then
    nothing, replacing closed ones."""

    async def one() -> None:
        while True:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
            except OSError:
                await trio.sleep(0.1)
                continue
            opened[0] += 1
            async with stream:
                with contextlib.suppress(Exception):
                    await stream.send_all(first)
                    while await stream.receive_some(4096):  # until the daemon closes it
                        pass

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)


async def measure(
    info: dict[str, Any], addresses: int, per_address: int, seconds: float, first: bytes
) -> dict:
    address = PeerAddress(info["peer_id"], tuple(a.split("/p2p/")[0] for a in info["multiaddrs"]))
    port = int(info["multiaddrs"][0].split("/tcp/")[1].split("/")[0])
    config = local_config()
    latencies: list[float] = []
    failed = 0
    opened = [0]
    pid = int(info["pid"])
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    async with trio.open_nursery() as nursery:
        for i in range(addresses):
            nursery.start_soon(hold_stalled, port, f"127.0.0.{2 + i}", per_address, opened, first)
        await trio.sleep(1.0)  # the stalled connections are in place
        with trio.move_on_after(seconds):
            while True:
                started = time.perf_counter()
                try:
                    async with open_bare_client(config) as client:
                        with trio.fail_after(15):
                            await client.call(address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))
                    latencies.append(time.perf_counter() - started)
                except Exception:
                    failed += 1
                await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    elapsed = time.monotonic() - t0
    cpu = cpu_seconds(pid) - cpu0
    ordered = sorted(latencies) or [float("nan")]
    return {
        "answered": len(latencies),
        "failed": failed,
        "p50_ms": 1000 * statistics.median(ordered),
        "max_ms": 1000 * ordered[-1],
        "opened_per_s": opened[0] / elapsed,
        "cpu_pct": 100 * cpu / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--addresses", default="1,16", help="attacker addresses, comma-separated")
    parser.add_argument("--per-address", type=int, default=40, help="silent connections each")
    parser.add_argument(
        "--first-bytes",
        action="store_true",
        help="the attacker's connections open the negotiation (multistream's header) first",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each run")
    args = parser.parse_args()
    try:
        counts = [int(a) for a in args.addresses.split(",")]
    except ValueError:
        parser.error(f"--addresses: numbers, not {args.addresses!r}")
    if any(not 1 <= c <= 200 for c in counts) or args.per_address < 1:
        parser.error("--addresses: 1 to 200 each; --per-address: at least 1")
    configure_logging("ERROR")
    print(
        f"{args.per_address} silent connections per attacker address"
        f"{' (after the first bytes)' if args.first_bytes else ''}; a newcomer asks one "
        f"FIND_NODE every 0.5 s (5 s connect timeout), {args.seconds:.0f} s per row"
    )
    print(f"{'addresses':>9} {'answered':>8} {'failed':>6} {'p50 ms':>7} "
          f"{'max ms':>7} {'silent opened/s':>15} {'daemon CPU %':>12}")  # fmt: skip
    for count in counts:
        with volunteerd_process(
            "serve", "--experts", "ffn.0.[0:2]", "--set", "experts.hidden_dim=64",
            "--set", 'runtime.device="cpu"', "--set", "peer_limits.limit_loopback=true",
        ) as daemon:  # fmt: skip
            first = HEADER if args.first_bytes else b""
            row = trio.run(measure, daemon.info, count, args.per_address, args.seconds, first)
        print(
            f"{count:9d} {row['answered']:8d} {row['failed']:6d} "
            f"{row['p50_ms']:7.0f} {row['max_ms']:7.0f} {row['opened_per_s']:15.1f} "
            f"{row['cpu_pct']:12.0f}"
        )


if __name__ == "__main__":
    main()
