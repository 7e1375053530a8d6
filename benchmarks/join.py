"""First contact: how long a node takes to join a swarm, and to connect to a new peer.

What it measures
    A bootstrap node and ``--peers`` plain nodes (no experts) run in this process on
    127.0.0.1 over real libp2p. Then, ``--joins`` times each, a new node joins through
    the bootstrap node (``open_peer``: connecting to it, the Kademlia lookup of its own
    neighbourhood, which dials the peers closest to it, and the reachability check),
    and connects to one more node it has never met; then it leaves (closes every
    connection it holds: to the bootstrap node, the peers its lookup met, the stranger).

    Each round is run twice, alternating: with volunteerd's dialling (py-libp2p's wait
    after starting each dial removed, see ``volunteerd/net/host.py``) and with
    py-libp2p's default wait of 0.25 s put back, so both are measured side by side.

Run::

    .venv/bin/python benchmarks/join.py
    .venv/bin/python benchmarks/join.py --peers 16 --joins 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import AsyncExitStack

import trio
from libp2p.network import swarm

from volunteerd.logs import configure_logging
from volunteerd.testing import local_config, open_peer

VOLUNTEERD_DELAY = swarm._HAPPY_EYEBALLS_DELAY  # what volunteerd.net.host set on import
LIBP2P_DELAY = 0.25


async def one_round(boot_addrs: list[str], stranger) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    async with open_peer(local_config(bootstrap=boot_addrs)) as node:
        joined = time.perf_counter() - start
        start = time.perf_counter()
        await node.streams.connect(stranger.address)
        connected = time.perf_counter() - start
        start = time.perf_counter()
    left = time.perf_counter() - start
    return joined, connected, left


async def main(args: argparse.Namespace) -> None:
    configure_logging("WARNING")
    results: dict[float, tuple[list[float], list[float], list[float]]] = {
        VOLUNTEERD_DELAY: ([], [], []),
        LIBP2P_DELAY: ([], [], []),
    }
    async with open_peer(local_config()) as boot, AsyncExitStack() as stack:
        for _ in range(args.peers):
            await stack.enter_async_context(open_peer(local_config(bootstrap=boot.multiaddrs)))
        for _ in range(args.joins):
            for delay, (joins, connects, leaves) in results.items():
                swarm._HAPPY_EYEBALLS_DELAY = delay
                # a node no one has met yet, outside the swarm
                async with open_peer(local_config()) as stranger:
                    joined, connected, left = await one_round(boot.multiaddrs, stranger)
                joins.append(joined)
                connects.append(connected)
                leaves.append(left)
    swarm._HAPPY_EYEBALLS_DELAY = VOLUNTEERD_DELAY

    print(f"\na node joins a swarm of {args.peers} nodes + 1 bootstrap node ({args.joins} times)")
    print(
        f"{'dialling':38} {'join p50 ms':>12} {'join max ms':>12} {'connect p50 ms':>15} "
        f"{'leave p50 ms':>13}"
    )
    for delay, (joins, connects, leaves) in results.items():
        name = (
            "volunteerd (no wait after a dial)"
            if delay == VOLUNTEERD_DELAY
            else f"py-libp2p default ({delay:.2f} s wait)"
        )
        print(
            f"{name:38} {statistics.median(joins) * 1e3:12.0f} {max(joins) * 1e3:12.0f} "
            f"{statistics.median(connects) * 1e3:15.1f} {statistics.median(leaves) * 1e3:13.0f}"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="joining a swarm and first connections")
    p.add_argument("--peers", type=int, default=8, help="nodes already in the swarm")
    p.add_argument("--joins", type=int, default=6, help="joins per way of dialling")
    trio.run(main, p.parse_args())
