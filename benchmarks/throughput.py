"""Expert server throughput: volunteerd vs the local compute bound (and hivemind).

What it measures
    One volunteerd daemon (in this process: real libp2p host, Kademlia, runtime) hosts
    ``--experts`` ``ffn`` experts of hidden size ``--hidden`` with Adam. ``--clients``
    client processes find the experts through the DHT and each run
    ``--batches-per-client`` training steps through ``RemoteExpert``: forward a random
    ``--batch`` x ``--hidden`` float32 batch, then ``out.sum().backward()`` — one forward
    and one backward request per step, round robin over the experts, over real libp2p
    (TCP + Noise + Yamux) on 127.0.0.1. The clock runs from the moment every client has
    warmed up until the last one finishes.

    By default the trainer asks the server to keep each forward's graph, so the
    backward sends only the output gradients and the server does not recompute the
    forward. ``--stateless`` turns that off (``runtime.retain_activations_mb = 0``):
    Learning@home's stateless backward, which resends the inputs and runs the forward
    twice, as hivemind does.

    The compute bound is a plain local training step on the same cores with no network:
    forward, backward and Adam step for the same batches. ``stateless work`` is what a
    stateless server computes per step (a forward, then forward + backward + step).

    With ``--hivemind-python`` (or HIVEMIND_PYTHON) it also runs
    ``benchmarks/hivemind_throughput.py`` with that interpreter on the same workload, in
    the same run, and reports the ratio. See benchmarks/setup_hivemind.sh.

Run::

    .venv/bin/python benchmarks/throughput.py                       # defaults below
    .venv/bin/python benchmarks/throughput.py --hivemind-python .hivemind-venv/bin/python
    .venv/bin/python benchmarks/throughput.py --hidden 512 --experts 4 --compression float16

Prints one table (and ``--json`` a JSON line) to stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio

from volunteerd.experts import ExpertBackend
from volunteerd.identity import Identity
from volunteerd.logs import configure_logging
from volunteerd.testing import local_config, open_daemon

logger = logging.getLogger("benchmarks.throughput")
HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--experts", type=int, default=2)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--batches-per-client", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per client")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int, default=2048)
    p.add_argument("--max-batch-wait-s", type=float, default=0.005)
    p.add_argument("--stateless", action="store_true", help="recompute forwards in backward")
    p.add_argument("--hivemind-python", default=os.environ.get("HIVEMIND_PYTHON"))
    p.add_argument("--skip-local", action="store_true", help="skip the compute bound")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="alternate the networked runs this many times and report medians "
        "(this machine's speed varies by ±15%% between runs)",
    )
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    return p.parse_args(argv)


def server_config(args: argparse.Namespace, bootstrap: list[str] | None = None) -> Any:
    return local_config(
        bootstrap=bootstrap or [],
        uids=f"ffn.0.[0:{args.experts}]",
        experts={"hidden_dim": args.hidden, "dtype": args.dtype},
        runtime={
            "max_batch_size": args.max_batch_size,
            "max_batch_wait_s": args.max_batch_wait_s,
            "retain_activations_mb": 0 if args.stateless else 2048,
        },
        dht={"announce_period_s": 5, "record_ttl_s": 12},
        timeouts={"request_s": 120},
        logging={"level": "WARNING"},
    )


# -- client processes --------------------------------------------------------------------


def client_main(
    index: int,
    args: argparse.Namespace,
    bootstrap: list[str],
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    from volunteerd.moe import RemoteExpert
    from volunteerd.net.background import BackgroundNode

    configure_logging("WARNING")
    torch.set_num_threads(1)
    config = local_config(bootstrap=bootstrap, timeouts={"request_s": 120})
    dtype = getattr(torch, args.dtype)
    with BackgroundNode(Identity.generate(), config) as node:
        experts = []
        for e in range(args.experts):
            uid = f"ffn.0.{e}"
            peers = node.run(node.node.dht.find_expert, uid)
            if not peers:
                raise SystemExit(f"client {index}: {uid} not found in the DHT")
            experts.append(RemoteExpert(uid, peers[0], node))
        x = torch.randn(args.batch, args.hidden, dtype=dtype)

        def step(i: int) -> None:
            inputs = x.detach().requires_grad_()
            out = experts[(i + index) % len(experts)](inputs)
            out.sum().backward()

        for i in range(args.warmup):
            step(i)
        ready.put(index)
        go.wait()
        cpu = time.process_time()
        start = time.perf_counter()
        for i in range(args.batches_per_client):
            step(i)
        results.put((index, start, time.perf_counter(), time.process_time() - cpu))


def run_volunteerd(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    out: dict[str, Any] = {}

    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            async with open_daemon(server_config(args), Path(tmp)) as server:
                procs = [
                    ctx.Process(
                        target=client_main,
                        args=(i, args, server.node.multiaddrs, ready, go, results),
                        daemon=True,
                    )
                    for i in range(args.clients)
                ]
                for proc in procs:
                    proc.start()
                try:
                    await trio.to_thread.run_sync(_wait_ready, ready, procs, args.clients)
                    before = _queue_totals(server)
                    cpu = time.process_time()
                    go.set()
                    spans = await trio.to_thread.run_sync(_collect, results, procs, args.clients)
                    after = _queue_totals(server)
                    out["server_cpu_s"] = time.process_time() - cpu
                finally:
                    for proc in procs:
                        proc.join(timeout=30)
                        if proc.is_alive():
                            proc.kill()
                start = min(s[1] for s in spans)
                end = max(s[2] for s in spans)
                out["clients_cpu_s"] = sum(s[3] for s in spans)
                samples = args.clients * args.batches_per_client * args.batch
                out["samples_per_s"] = samples / (end - start)
                out["seconds"] = end - start
                batches = after["batches"] - before["batches"]
                out["mean_server_batch"] = (after["samples"] - before["samples"]) / max(batches, 1)
                out["busy_s"] = after["busy_s"] - before["busy_s"]

    trio.run(main)
    return out


def _queue_totals(server: Any) -> dict[str, float]:
    stats = server.runtime.statistics()
    return {
        "batches": sum(s.forward.batches + s.backward.batches for s in stats),
        "samples": sum(s.forward.samples + s.backward.samples for s in stats),
        "busy_s": server.runtime.executor.statistics().busy_s,
    }


def _wait_ready(ready: Any, procs: list[Any], n: int) -> None:
    for _ in range(n):
        while True:
            try:
                ready.get(timeout=1)
                break
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise SystemExit("a client failed before starting") from None


def _collect(results: Any, procs: list[Any], n: int) -> list[tuple[int, float, float, float]]:
    spans = []
    while len(spans) < n:
        try:
            spans.append(results.get(timeout=1))
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit("a client failed during the run") from None
    return spans


# -- the compute bound -------------------------------------------------------------------


def run_local(args: argparse.Namespace) -> dict[str, float]:
    """The server's torch work for the same steps, with no network, in this process."""
    config = server_config(args)
    backends = [
        ExpertBackend(f"ffn.0.{e}", config.experts, torch.device("cpu"), args.max_batch_size)
        for e in range(args.experts)
    ]
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.batch, args.hidden, dtype=dtype)
    ones = torch.ones(args.batch, args.hidden, dtype=dtype)
    steps = args.clients * args.batches_per_client

    def stateless_work(i: int) -> None:
        b = backends[i % len(backends)]
        b.forward([x])
        b.backward([x], [ones])

    def plain_step(i: int) -> None:
        b = backends[i % len(backends)]
        inputs = x.float().requires_grad_()
        b.module(inputs).sum().backward()
        b.optimizer.step()
        b.optimizer.zero_grad(set_to_none=True)

    out = {}
    for name, fn in (("plain_step", plain_step), ("stateless_work", stateless_work)):
        for i in range(2):
            fn(i)
        start = time.perf_counter()
        for i in range(steps):
            fn(i)
        out[name] = steps * args.batch / (time.perf_counter() - start)
    return out


def run_hivemind(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.hivemind_python:
        return None
    cmd = [
        args.hivemind_python, str(HERE / "hivemind_throughput.py"),
        "--hidden", str(args.hidden), "--batch", str(args.batch),
        "--experts", str(args.experts), "--clients", str(args.clients),
        "--batches-per-client", str(args.batches_per_client),
        "--warmup-batches", str(args.warmup), "--log-level", "WARNING",
    ]  # fmt: skip
    logger.info("running hivemind: %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        logger.error("hivemind run failed (%d):\n%s", proc.returncode, proc.stderr[-3000:])
        return None
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: float(r["samples_per_s"]))
    return ordered[len(ordered) // 2]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("INFO")
    logging.getLogger("volunteerd").setLevel(logging.WARNING)
    logger.setLevel(logging.INFO)
    logger.info(
        "workload: ffn hidden %d, batch %d, %d experts, %d clients x %d steps, %s, %d cores",
        args.hidden, args.batch, args.experts, args.clients, args.batches_per_client,
        args.dtype, os.cpu_count() or 0,
    )  # fmt: skip
    runs: list[dict[str, Any]] = []
    hive_runs: list[dict[str, Any]] = []
    hive_failures = 0
    for i in range(args.repeat):
        runs.append(run_volunteerd(args))
        logger.info("run %d: volunteerd %.0f samples/s", i + 1, runs[-1]["samples_per_s"])
        hive_run = run_hivemind(args)
        hive_failures += bool(args.hivemind_python) and hive_run is None
        if hive_run:
            hive_runs.append(hive_run)
            logger.info("run %d: hivemind %.0f samples/s", i + 1, hive_run["samples_per_s"])
    ours = _median_run(runs)
    hive = _median_run(hive_runs) if hive_runs else None
    local = None if args.skip_local else run_local(args)

    name = "volunteerd (stateless backward)" if args.stateless else "volunteerd"
    rows = [(name, ours["samples_per_s"], f"{ours['mean_server_batch']:.0f}")]
    if hive:
        rows.append(("hivemind 1.1.12", hive["samples_per_s"], "-"))
    if local:
        rows.append(("compute bound: local fwd+bwd+step", local["plain_step"], "-"))
        rows.append(("local stateless work (fwd, fwd+bwd+step)", local["stateless_work"], "-"))
    print(
        f"\nffn h={args.hidden} batch={args.batch} experts={args.experts} "
        f"clients={args.clients} steps/client={args.batches_per_client} dtype={args.dtype}"
    )
    print(f"{'system':42} {'samples/s':>10} {'mean server batch':>18} {'vs bound':>9}")
    bound = local["plain_step"] if local else None
    for label, rate, batch in rows:
        ratio = f"{rate / bound:.0%}" if bound else "-"
        print(f"{label:42} {rate:10.0f} {batch:>18} {ratio:>9}")
    if args.repeat > 1:
        print(
            f"medians of {args.repeat} alternating runs; volunteerd runs: "
            + ", ".join(f"{r['samples_per_s']:.0f}" for r in runs)
            + (
                "; hivemind runs: " + ", ".join(f"{r['samples_per_s']:.0f}" for r in hive_runs)
                if hive_runs
                else ""
            )
        )
    if hive:
        print(f"volunteerd / hivemind: {ours['samples_per_s'] / hive['samples_per_s']:.2f}x")
    if args.json:
        print(
            json.dumps({"volunteerd": ours, "local": local, "hivemind": hive, "args": vars(args)})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
