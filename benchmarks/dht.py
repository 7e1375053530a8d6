"""DHT lookup latency and success, before and after servers leave.

What it measures
    ``--servers`` daemons (one process, real libp2p on 127.0.0.1, tiny experts) each
    host one row ``ffn.<i>.[0:4]`` of a grid and announce it; a client node then runs
    ``--lookups`` lookups of random uids (``find_expert``) and of grid prefixes
    (``children``), timing each and checking the answer against who is alive. Then
    ``--kill`` servers stop (cleanly: they withdraw their records, then close): the
    benchmark reports how long until their experts vanish from lookups, and the
    latency and correctness of lookups afterwards, while the other nodes still have
    the stopped ones in their routing tables. (Expiry after a crash, with no
    withdrawal, is measured by tests/e2e/test_cli.py with SIGKILL.)

Run::

    .venv/bin/python benchmarks/dht.py
    .venv/bin/python benchmarks/dht.py --servers 12 --kill 4 --replication 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import trio

from volunteerd.logs import configure_logging
from volunteerd.testing import local_config, open_daemon, open_peer


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(client, uids_by_server, alive, lookups):  # type: ignore[no-untyped-def]
    latencies, correct = [], 0
    for _ in range(lookups):
        server = random.randrange(len(uids_by_server))
        uid = random.choice(uids_by_server[server])
        start = time.perf_counter()
        found = {p.peer_id for p in await client.dht.find_expert(uid)}
        latencies.append((time.perf_counter() - start) * 1000)
        ok = found == ({alive[server]} if alive[server] else set())
        correct += ok

    start = time.perf_counter()
    first = await client.dht.children("ffn.")
    prefix_ms = (time.perf_counter() - start) * 1000
    expected = {i for i, peer in enumerate(alive) if peer}
    return latencies, correct, prefix_ms, set(first) == expected


async def main(args: argparse.Namespace) -> None:
    configure_logging("WARNING")
    dht = {"announce_period_s": args.period, "record_ttl_s": 2 * args.period,
           "replication": args.replication}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        async with AsyncExitStack() as stack:
            boot = await stack.enter_async_context(open_peer(local_config(dht=dht)))
            scopes: list[trio.CancelScope] = []
            alive: list[str | None] = []
            uids_by_server = []
            nursery = await stack.enter_async_context(trio.open_nursery())
            for i in range(args.servers):
                config = local_config(bootstrap=boot.multiaddrs, uids=f"ffn.{i}.[0:4]", dht=dht)
                ready = trio.Event()
                scope = trio.CancelScope()
                box: dict[str, str] = {}

                async def run(config=config, i=i, scope=scope, ready=ready, box=box):  # type: ignore[no-untyped-def]
                    with scope:
                        async with open_daemon(config, Path(tmp) / str(i)) as server:
                            box["peer"] = server.node.peer_id
                            ready.set()
                            await trio.sleep_forever()

                nursery.start_soon(run)
                await ready.wait()
                scopes.append(scope)
                alive.append(box["peer"])
                uids_by_server.append([f"ffn.{i}.{j}" for j in range(4)])
            client = await stack.enter_async_context(
                open_peer(local_config(bootstrap=boot.multiaddrs, dht=dht))
            )
            await trio.sleep(args.period)
            before = await measure(client, uids_by_server, alive, args.lookups)

            victims = random.sample(range(args.servers), args.kill)
            for v in victims:
                alive[v] = None
            killed_at = time.monotonic()
            for v in victims:
                scopes[v].cancel()
            gone_s = None
            while time.monotonic() - killed_at < 10 * args.period:
                found = [await client.dht.find_expert(uids_by_server[v][0]) for v in victims]
                if not any(found):
                    gone_s = time.monotonic() - killed_at
                    break
                await trio.sleep(0.1)
            after = await measure(client, uids_by_server, alive, args.lookups)
            nursery.cancel_scope.cancel()

    print(
        f"\n{args.servers} servers x 4 experts, replication {args.replication}, "
        f"announce every {args.period}s, records live {2 * args.period}s, loopback"
    )
    print(
        f"{'phase':26} {'lookups':>8} {'correct':>8} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'prefix ms':>10} {'prefix ok':>10}"
    )
    for name, (lat, ok, prefix_ms, prefix_ok) in (
        ("all alive", before),
        (f"after {args.kill} stopped", after),
    ):
        print(
            f"{name:26} {len(lat):8d} {ok:8d} {statistics.median(lat):8.1f} "
            f"{pct(lat, 0.95):8.1f} {prefix_ms:10.1f} {prefix_ok!s:>10}"
        )
    print(
        f"stopped servers vanished from lookups after {gone_s:.2f} s"
        if gone_s is not None
        else "stopped servers did NOT vanish"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="DHT lookup latency and churn")
    p.add_argument("--servers", type=int, default=8)
    p.add_argument("--kill", type=int, default=3)
    p.add_argument("--lookups", type=int, default=100)
    p.add_argument("--replication", type=int, default=5)
    p.add_argument("--period", type=float, default=3.0)
    trio.run(main, p.parse_args())
