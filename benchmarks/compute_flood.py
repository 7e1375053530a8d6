"""A peer that floods a daemon's device with work: what is left for another.

What it measures
    A ``volunteerd serve`` process (2 ``ffn`` experts of ``--hidden``, 127.0.0.1) gets,
    for ``--seconds``, ``--streams`` forward requests at once from one attacker peer,
    each of the largest batch a request may carry (``--rows``, 2048 by default: the
    daemon's cap), over both experts; each is sent again as soon as it is answered.
    Meanwhile a client peer sends forwards of ``--batch`` samples, one at a time,
    alternating between the experts. Both are real libp2p peers in this process.

    Reported per ``runtime.fair_share`` mode, the two modes alternating ``--repeat``
    times: the client's calls answered, its median, 95th-percentile and longest latency
    and its failures, the attacker's calls answered and samples a second, and the daemon's CPU.
    With no attack (``--streams 0``) the client's latency is the baseline.

Run::

    .venv/bin/python benchmarks/compute_flood.py
    .venv/bin/python benchmarks/compute_flood.py --hidden 1024 --streams 64 --repeat 2
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import torch
import trio
from daemon_proc import cpu_seconds, volunteerd_process

from volunteerd.errors import VolunteerdError
from volunteerd.experts import to_wire
from volunteerd.logs import configure_logging
from volunteerd.net import PeerAddress, Verb
from volunteerd.testing import local_config, open_peer
from volunteerd.wire import ForwardRequest


async def measure(info: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    address = PeerAddress(info["peer_id"], tuple(a.split("/p2p/")[0] for a in info["multiaddrs"]))
    frames = {
        rows: [
            (ForwardRequest(uid=f"ffn.0.{i}", tensors=[meta]), data)
            for i in range(2)
            for meta, data in [to_wire(torch.randn(rows, args.hidden))]
        ]
        for rows in (args.rows, args.batch)
    }
    # The attacker asks as fast as it is answered; the per-peer limits would meter it
    # only at 256 MiB/s of requests, far above what the device does with them.
    async with open_peer(local_config()) as attacker, open_peer(local_config()) as client:
        await attacker.rpc.connect(address)
        await client.rpc.connect(address)
        for header, data in frames[args.batch]:  # warm
            await client.rpc.call(address, Verb.FORWARD, header, [data])
        attacked = {"ok": 0, "failed": 0}
        latencies: list[float] = []
        failed = 0
        stop = trio.Event()

        async def flood(i: int) -> None:
            header, data = frames[args.rows][i % 2]
            while not stop.is_set():
                try:
                    await attacker.rpc.call(address, Verb.FORWARD, header, [data])
                    attacked["ok"] += 1
                except VolunteerdError:
                    attacked["failed"] += 1
                    await trio.sleep(0.01)

        pid = int(info["pid"])
        async with trio.open_nursery() as nursery:
            for i in range(args.streams):
                nursery.start_soon(flood, i)
            await trio.sleep(args.streams and 1.0)  # the flood reaches its pace
            attacked.update(ok=0, failed=0)
            cpu0, t0 = cpu_seconds(pid), time.monotonic()
            with trio.move_on_after(args.seconds):
                for n in itertools.count():
                    header, data = frames[args.batch][n % 2]
                    started = time.monotonic()
                    try:
                        await client.rpc.call(address, Verb.FORWARD, header, [data])
                        latencies.append(time.monotonic() - started)
                    except VolunteerdError:
                        failed += 1
            elapsed = time.monotonic() - t0
            cpu = cpu_seconds(pid) - cpu0
            stop.set()
            nursery.cancel_scope.deadline = trio.current_time() + 60
    ordered = sorted(latencies) or [float("nan")]
    return {
        "client_ok": len(latencies),
        "client_p50_ms": 1000 * statistics.median(ordered),
        "client_p95_ms": 1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "client_max_ms": 1000 * ordered[-1],
        "client_failed": failed,
        "attacker_ok": attacked["ok"],
        "attacker_samples_per_s": attacked["ok"] * args.rows / elapsed,
        "attacker_failed": attacked["failed"],
        "cpu_pct": 100 * cpu / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", type=int, default=2048, help="samples per attacker request")
    parser.add_argument("--batch", type=int, default=64, help="samples per client request")
    parser.add_argument("--streams", type=int, default=16, help="attacker requests at once")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each run")
    parser.add_argument("--mode", default="on,off", help="runtime.fair_share: on, off or both")
    parser.add_argument("--repeat", type=int, default=1, help="alternate the modes this often")
    args = parser.parse_args()
    modes = args.mode.split(",")
    if not set(modes) <= {"on", "off"}:
        parser.error(f"--mode: on and/or off, not {args.mode!r}")
    if min(args.hidden, args.rows, args.batch, args.repeat) < 1 or args.streams < 0:
        parser.error("--hidden, --rows, --batch, --repeat: at least 1; --streams: at least 0")
    configure_logging("ERROR")
    print(
        f"ffn hidden {args.hidden}, 2 experts; attacker: {args.streams} requests of "
        f"{args.rows} samples at once; client: {args.batch} samples, one at a time; "
        f"{args.seconds:.0f} s per run"
    )
    print(f"{'fair_share':10} {'client ok':>9} {'p50 ms':>7} {'p95 ms':>7} {'max ms':>7} "
          f"{'failed':>6} {'attacker ok':>11} {'samples/s':>9} {'failed':>6} "
          f"{'daemon CPU %':>12}")  # fmt: skip
    for _, mode in itertools.product(range(args.repeat), modes):
        with volunteerd_process(
            "serve", "--experts", "ffn.0.[0:2]",
            "--set", f"experts.hidden_dim={args.hidden}", "--set", 'runtime.device="cpu"',
            "--set", f"runtime.fair_share={'true' if mode == 'on' else 'false'}",
        ) as daemon:  # fmt: skip
            row = trio.run(measure, daemon.info, args)
        print(
            f"{mode:10} {row['client_ok']:9.0f} {row['client_p50_ms']:7.1f} "
            f"{row['client_p95_ms']:7.1f} {row['client_max_ms']:7.0f} {row['client_failed']:6.0f} "
            f"{row['attacker_ok']:11.0f} "
            f"{row['attacker_samples_per_s']:9.0f} {row['attacker_failed']:6.0f} "
            f"{row['cpu_pct']:12.0f}"
        )


if __name__ == "__main__":
    main()
