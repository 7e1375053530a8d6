"""A peer that floods a daemon's device with work: what is left for another.

What it measures
    A ``volunteerd serve`` process (``--experts`` ``ffn`` experts of ``--hidden``,
    127.0.0.1) gets, for ``--seconds``, ``--streams`` requests at once from one
    attacker peer, spread over the experts; each is sent again as soon as it is
    answered. ``--attack forward``: forwards of the largest batch a request may carry
    (``--rows``, 2048 by default: the daemon's cap). ``--attack steps``: stateless
    backwards of ``--rows`` samples (1 by default) with random gradients, so that each
    makes an optimizer step of its expert due (the step costs far more than the
    request). Meanwhile a client peer sends forwards of ``--batch`` samples, one at a
    time, alternating between the first two experts. Both are real libp2p peers, each
    in a process of its own (in one process, the attacker's work on its replies slowed
    the client's own loop).

    Reported per ``runtime.fair_share`` mode, the two modes alternating ``--repeat``
    times: the client's calls answered, its median, 95th-percentile and longest latency
    (the call still waiting when the window closes counts for the longest) and its
    failures, the attacker's calls answered and samples a second, and the daemon's CPU.
    With no attack (``--streams 0``) the client's latency is the baseline.

Run::

    .venv/bin/python benchmarks/compute_flood.py
    .venv/bin/python benchmarks/compute_flood.py --hidden 1024 --streams 64 --repeat 2
    .venv/bin/python benchmarks/compute_flood.py --attack steps --experts 16 --hidden 1024 \
        --streams 32
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
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
from volunteerd.wire import BackwardRequest, ForwardRequest


def _address(info: dict[str, Any]) -> PeerAddress:
    return PeerAddress(info["peer_id"], tuple(a.split("/p2p/")[0] for a in info["multiaddrs"]))


def attacker_main(
    info: dict[str, Any], args: argparse.Namespace, go: Any, stop: Any, out: Any
) -> None:
    """The attacker, in a process of its own (sharing the client's would slow the
    client's own loop down): floods until ``stop``, then puts the times its calls were
    answered and its failures on ``out``."""
    configure_logging("ERROR")
    attack: list[tuple[Verb, Any, list[bytes]]] = []
    for i in range(args.experts):
        x = to_wire(torch.randn(args.rows, args.hidden))
        if args.attack == "forward":
            attack.append((Verb.FORWARD, ForwardRequest(uid=f"ffn.0.{i}", tensors=[x[0]]), [x[1]]))
        else:
            g = to_wire(torch.randn(args.rows, args.hidden) * 1e-3)
            header = BackwardRequest(uid=f"ffn.0.{i}", tensors=[x[0], g[0]])
            attack.append((Verb.BACKWARD, header, [x[1], g[1]]))
    answered: list[float] = []
    failed = [0]

    async def run() -> None:
        address = _address(info)
        # It asks as fast as it is answered; the per-peer limits would meter it only at
        # 256 MiB/s of requests, far above what the device does with them.
        async with open_peer(local_config()) as attacker:
            await attacker.rpc.connect(address)
            go.set()

            async def flood(i: int) -> None:
                verb, header, buffers = attack[i % len(attack)]
                while True:
                    try:
                        await attacker.rpc.call(address, verb, header, buffers)
                        answered.append(time.monotonic())
                    except VolunteerdError:
                        failed[0] += 1
                        await trio.sleep(0.01)

            async with trio.open_nursery() as nursery:
                for i in range(args.streams):
                    nursery.start_soon(flood, i)
                await trio.to_thread.run_sync(stop.wait)  # a multiprocessing event
                nursery.cancel_scope.cancel()

    trio.run(run)
    out.put((answered, failed[0]))


async def measure(info: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    address = _address(info)
    client_frames = [
        (ForwardRequest(uid=f"ffn.0.{i}", tensors=[meta]), data)
        for i in range(2)
        for meta, data in [to_wire(torch.randn(args.batch, args.hidden))]
    ]
    ctx = mp.get_context("spawn")
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    attacker = ctx.Process(target=attacker_main, args=(info, args, go, stop, out), daemon=True)
    latencies: list[float] = []
    failed = 0
    async with open_peer(local_config()) as client:
        await client.rpc.connect(address)
        for header, data in client_frames:  # warm
            await client.rpc.call(address, Verb.FORWARD, header, [data])
        if args.streams:
            attacker.start()
            await trio.to_thread.run_sync(go.wait, 120)
            await trio.sleep(1.0)  # the flood reaches its pace
        pid = int(info["pid"])
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        started = t0
        with trio.move_on_after(args.seconds):
            for n in itertools.count():
                header, data = client_frames[n % 2]
                started = time.monotonic()
                try:
                    await client.rpc.call(address, Verb.FORWARD, header, [data])
                    latencies.append(time.monotonic() - started)
                except VolunteerdError:
                    failed += 1
        t1 = time.monotonic()
        waiting = t1 - started  # the call unanswered when the window closed
        cpu = cpu_seconds(pid) - cpu0
    answered: list[float] = []
    attacker_failed = 0
    if args.streams:
        stop.set()
        answered, attacker_failed = await trio.to_thread.run_sync(out.get, True, 120)
        attacker.join(30)
    attacker_ok = sum(1 for t in answered if t0 <= t <= t1)
    elapsed = t1 - t0
    ordered = sorted(latencies) or [float("nan")]
    return {
        "client_ok": len(latencies),
        "client_p50_ms": 1000 * statistics.median(ordered),
        "client_p95_ms": 1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "client_max_ms": 1000 * max(ordered[-1], waiting),
        "client_failed": failed,
        "attacker_ok": attacker_ok,
        "attacker_samples_per_s": attacker_ok * args.rows / elapsed,
        "attacker_failed": attacker_failed,
        "cpu_pct": 100 * cpu / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--attack", default="forward", choices=["forward", "steps"])
    parser.add_argument("--experts", type=int, default=2, help="experts the daemon hosts")
    parser.add_argument(
        "--rows", type=int, help="samples per attacker request (forward: 2048, steps: 1)"
    )
    parser.add_argument("--batch", type=int, default=64, help="samples per client request")
    parser.add_argument("--streams", type=int, default=16, help="attacker requests at once")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each run")
    parser.add_argument("--mode", default="on,off", help="runtime.fair_share: on, off or both")
    parser.add_argument("--repeat", type=int, default=1, help="alternate the modes this often")
    args = parser.parse_args()
    if args.rows is None:
        args.rows = 2048 if args.attack == "forward" else 1
    modes = args.mode.split(",")
    if not set(modes) <= {"on", "off"}:
        parser.error(f"--mode: on and/or off, not {args.mode!r}")
    if min(args.hidden, args.rows, args.batch, args.repeat) < 1 or args.streams < 0:
        parser.error("--hidden, --rows, --batch, --repeat: at least 1; --streams: at least 0")
    if args.experts < 2:
        parser.error("--experts: at least 2")
    configure_logging("ERROR")
    what = "forwards" if args.attack == "forward" else "stateless backwards"
    print(
        f"ffn hidden {args.hidden}, {args.experts} experts; attacker: {args.streams} "
        f"{what} of {args.rows} samples at once; client: {args.batch} samples, one at a "
        f"time; {args.seconds:.0f} s per run"
    )
    print(f"{'fair_share':10} {'client ok':>9} {'p50 ms':>7} {'p95 ms':>7} {'max ms':>7} "
          f"{'failed':>6} {'attacker ok':>11} {'samples/s':>9} {'failed':>6} "
          f"{'daemon CPU %':>12}")  # fmt: skip
    for _, mode in itertools.product(range(args.repeat), modes):
        with volunteerd_process(
            "serve", "--experts", f"ffn.0.[0:{args.experts}]",
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
