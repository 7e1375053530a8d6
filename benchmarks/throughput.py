"""Expert server throughput: volunteerd vs a plain local training step (and hivemind).

What it measures
    One volunteerd daemon (in this process: real libp2p host, Kademlia, runtime) hosts
    ``--experts`` ``ffn`` experts of hidden size ``--hidden`` with Adam. ``--clients``
    client processes find the experts through the DHT and run training steps through
    ``RemoteExpert``: forward a random ``--batch`` x ``--hidden`` batch, then
    ``out.sum().backward()`` — one forward and one backward request per step, round robin
    over the experts, over real libp2p (TCP + Noise + Yamux) on 127.0.0.1.

    After ``--warmup`` untimed steps each, the clients are released together into a
    window of ``--seconds``; every client keeps stepping until it has finished a step
    after the window closed, so all of them are busy for the whole window, and samples/s
    counts the steps done inside it (the one under way at the end by the share of it
    done). Over the same window the daemon reports:

    * the mean server batch: samples per batch its runtime ran (forwards and backwards);
    * its expert compute: the time its device worker spent computing experts, as a share
      of the window and per sample served (on a GPU: how much of the device is left);
    * with experts stacked (``--stack-experts``; on GPUs by default), the share of those
      batches computed in stacked calls, several experts' batches as one;
    * its CPU per served sample: the CPU time of this process (every thread: the event
      loop, the device worker, torch's threads — the clients are other processes)
      divided by the samples served, a forward and its backward counting as one.

    By default the trainer asks the server to keep each forward's graph, so the
    backward sends only the output gradients and the server does not recompute the
    forward. ``--stateless`` turns that off (``runtime.retain_activations_mb = 0``):
    Learning@home's stateless backward, which resends the inputs and runs the forward
    twice, as hivemind does.

The bounds
    After each networked run, in this process, with no network, each for
    ``--local-seconds``, round robin over ``--experts`` freshly built experts:

    * the plain local training step — forward, backward (input and weight gradients)
      and the optimizer step the server runs (``make_optimizer``: fused Adam), gradients
      then set to None — at ``--batch`` and, when the server merged requests into
      larger batches, again at that run's mean server batch (rounded): the bound for
      what the server actually ran;
    * stateless work: what a stateless server computes per step — a forward, then
      forward + backward + the same Adam step — at ``--batch``.

    Every "vs" column is the median over the repeats of (run / the bound measured right
    after it).

    With ``--hivemind-python`` (or HIVEMIND_PYTHON) it also runs
    ``benchmarks/hivemind_throughput.py`` with that interpreter on the same workload and
    window, in the same run, alternating with ours, and reports the ratio and how many of
    its runs crashed. See benchmarks/setup_hivemind.sh.

Why 10 s windows
    Until issue 18 each client ran 10 steps and the clock ran until the last one
    finished: at hidden 512 a 1.1 s window, whose tail (some clients done, the server
    less loaded) and start weigh (the hidden-512 ratio to hivemind read 2.14x there and
    1.90x in longer windows). 10 s holds ~25 steps per client at the defaults and ~90 at
    hidden 512 / 4 experts on this machine; ``--seconds`` sets it.

Run::

    .venv/bin/python benchmarks/throughput.py                       # defaults below
    .venv/bin/python benchmarks/throughput.py --hivemind-python .hivemind-venv/bin/python \\
        --repeat 3
    .venv/bin/python benchmarks/throughput.py --hidden 512 --experts 4
    .venv/bin/python benchmarks/throughput.py --hidden 512 --batch 64 --clients 4
    python benchmarks/throughput.py --device cuda --experts 16 --batch 64 --clients 12

``--device`` puts the daemon's experts (and the local bounds) there; the clients stay
on the CPU. ``--stack-experts`` sets ``runtime.stack_experts``. ``--compression`` is how
the clients' tensors travel, both ways (``RemoteExpert(compression=...)``); hivemind's
run then uses ``Server.create(compression=FLOAT16)``, which narrows the inputs and the
input gradients but not the outputs or their gradients.

Prints one table (and ``--json`` a JSON line) to stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import trio
from hivemind_procs import steps_in_window  # the benchmarks folder: no hivemind import

from volunteerd.experts import build_module, make_optimizer
from volunteerd.identity import Identity
from volunteerd.logs import configure_logging
from volunteerd.malloc import one_arena
from volunteerd.testing import local_config, open_daemon

logger = logging.getLogger("benchmarks.throughput")
HERE = Path(__file__).resolve().parent
HIVEMIND_TIMEOUT_S = 900


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=512, help="samples per client request")
    p.add_argument("--experts", type=int, default=2)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0, help="timing window of each run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per client first")
    p.add_argument(
        "--local-seconds", type=float, default=3.0, help="timing window of each local bound"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--compression",
        default="none",
        choices=["none", "float16", "bfloat16", "q8"],
        help="how the clients' tensors travel (hivemind: none or float16 only)",
    )
    p.add_argument("--max-batch-size", type=int, default=2048)
    p.add_argument("--max-batch-wait-s", type=float, default=0.005)
    p.add_argument("--stateless", action="store_true", help="recompute forwards in backward")
    p.add_argument("--device", default="cpu", help="the daemon's runtime.device (e.g. cuda)")
    p.add_argument(
        "--stack-experts",
        default="auto",
        choices=["auto", "always", "never"],
        help="the daemon's runtime.stack_experts (auto: on a GPU only)",
    )
    p.add_argument(
        "--fair-share",
        default="on",
        choices=["on", "off"],
        help="the daemon's runtime.fair_share (its clients are parties of their own)",
    )
    p.add_argument("--hivemind-python", default=os.environ.get("HIVEMIND_PYTHON"))
    p.add_argument("--skip-local", action="store_true", help="skip the local bounds")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="alternate the runs this many times and report medians "
        "(this machine's speed varies by ±15%% between runs)",
    )
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args(argv)
    if args.hivemind_python and args.compression not in ("none", "float16"):
        p.error(f"hivemind's run knows no --compression {args.compression}: none or float16")
    return args


def server_config(args: argparse.Namespace, bootstrap: list[str] | None = None) -> Any:
    return local_config(
        bootstrap=bootstrap or [],
        uids=f"ffn.0.[0:{args.experts}]",
        experts={"hidden_dim": args.hidden, "dtype": args.dtype},
        runtime={
            "max_batch_size": args.max_batch_size,
            "max_batch_wait_s": args.max_batch_wait_s,
            "retain_activations_mb": 0 if args.stateless else 2048,
            "device": args.device,
            "stack_experts": args.stack_experts,
            "fair_share": args.fair_share == "on",
        },
        dht={"announce_period_s": 5, "record_ttl_s": 12},
        # The per-peer limits (200 requests/s) would meter a client of a GPU daemon.
        peer_limits={
            "requests_per_s": 100_000,
            "request_burst": 100_000,
            "inbound_mib_per_s": 100_000,
            "inbound_burst_mib": 100_000,
        },
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
    window_start: Any,
    results: Any,
) -> None:
    """Warm up, wait for ``go``, then step until a step finishes after the window
    (``window_start.value`` + ``args.seconds``); report when each step finished."""
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
            experts.append(RemoteExpert(uid, peers[0], node, compression=args.compression))
        x = torch.randn(args.batch, args.hidden, dtype=dtype)

        def step(i: int) -> None:
            inputs = x.detach().requires_grad_()
            out = experts[(i + index) % len(experts)](inputs)
            out.sum().backward()

        for i in range(args.warmup):
            step(i)
        ready.put(index)
        go.wait()
        window_end = window_start.value + args.seconds
        finished: list[float] = []
        i = 0
        while not finished or finished[-1] <= window_end:
            step(i)
            i += 1
            finished.append(time.perf_counter())  # CLOCK_MONOTONIC: one clock for all
        results.put((index, finished))


def run_volunteerd(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    window_start = ctx.Value("d", 0.0)
    out: dict[str, Any] = {}

    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            async with open_daemon(server_config(args), Path(tmp)) as server:
                client_args = [server.node.multiaddrs, ready, go, window_start, results]
                procs = [
                    ctx.Process(target=client_main, args=(i, args, *client_args), daemon=True)
                    for i in range(args.clients)
                ]
                for proc in procs:
                    proc.start()
                try:
                    await trio.to_thread.run_sync(_wait_ready, ready, procs, args.clients)
                    before = _served(server)
                    cpu = time.process_time()
                    start = time.perf_counter()
                    window_start.value = start
                    go.set()
                    await trio.sleep(args.seconds)
                    after = _served(server)
                    cpu_s = time.process_time() - cpu
                    server_window_s = time.perf_counter() - start
                    finished = await trio.to_thread.run_sync(_collect, results, procs, args.clients)
                finally:
                    for proc in procs:
                        proc.join(timeout=30)
                        if proc.is_alive():
                            proc.kill()
        steps = sum(steps_in_window(times, start, start + args.seconds) for times in finished)
        delta = {key: after[key] - before[key] for key in after}
        served = (delta["forward_samples"] + delta["backward_samples"]) / 2
        out.update(
            samples_per_s=steps * args.batch / args.seconds,
            steps=steps,
            mean_server_batch=_ratio(
                delta["forward_samples"] + delta["backward_samples"],
                delta["forward_batches"] + delta["backward_batches"],
            ),
            mean_forward_batch=_ratio(delta["forward_samples"], delta["forward_batches"]),
            mean_backward_batch=_ratio(delta["backward_samples"], delta["backward_batches"]),
            stacked_share=_ratio(
                delta["stacked_batches"], delta["forward_batches"] + delta["backward_batches"]
            ),
            samples_served=served,
            optimizer_steps=delta["updates"],
            server_cpu_s=cpu_s,
            server_cpu_cores=cpu_s / server_window_s,
            server_cpu_us_per_sample=cpu_s / served * 1e6 if served else None,
            jobs=delta["jobs"],
            deferred=delta["deferred"],
            worker_busy_s=delta["compute_s"],
            worker_busy_share=delta["compute_s"] / server_window_s,
            compute_us_per_sample=delta["compute_s"] / served * 1e6 if served else None,
        )

    trio.run(main)
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _served(server: Any) -> dict[str, float]:
    """The runtime's counters summed over the experts."""
    stats = server.runtime.statistics()
    stacking = server.runtime.stacking
    return {
        "stacked_batches": stacking.batches if stacking is not None else 0,
        "forward_samples": sum(s.forward.samples for s in stats),
        "forward_batches": sum(s.forward.batches for s in stats),
        "backward_samples": sum(s.backward.samples for s in stats),
        "backward_batches": sum(s.backward.batches for s in stats),
        "updates": sum(s.updates for s in stats),
        "compute_s": sum(s.compute_s for s in stats),
        "jobs": server.runtime.batcher.jobs,
        "deferred": server.runtime.batcher.statistics().deferred,
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


def _collect(results: Any, procs: list[Any], n: int) -> list[list[float]]:
    finished: list[list[float]] = []
    while len(finished) < n:
        try:
            finished.append(results.get(timeout=1)[1])
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit("a client failed during the run") from None
    return finished


# -- the local bounds --------------------------------------------------------------------


def local_bound(args: argparse.Namespace, batch: int, *, stateless: bool = False) -> float:
    """Samples/s of the server's training work for ``batch`` samples at a time, with no
    network: a forward, backward and optimizer step (after an inference forward of its
    own if ``stateless``), built as the server builds its experts (float32 weights,
    ``make_optimizer``), round robin over ``args.experts`` experts."""
    config = server_config(args).experts
    device = torch.device(args.device)
    modules = [build_module(config, f"ffn.0.{e}").to(device) for e in range(args.experts)]
    optimizers = [make_optimizer(list(m.parameters()), config.optimizer) for m in modules]
    x = torch.randn(batch, args.hidden, device=device)
    grad = torch.ones(batch, args.hidden, device=device)  # d out.sum() / d out, as sent

    def step(i: int) -> None:
        module, optimizer = modules[i % len(modules)], optimizers[i % len(modules)]
        if stateless:
            with torch.inference_mode():
                module(x)
        module(x.detach().requires_grad_()).backward(grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(2 * len(modules)):  # optimizer state, allocator
        step(i)
    sync()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.local_seconds:
        step(steps)
        steps += 1
    sync()
    return steps * batch / (time.perf_counter() - start)


def run_local(args: argparse.Namespace, server_batch: float) -> dict[str, Any]:
    bounds: dict[str, Any] = {"plain_step": local_bound(args, args.batch)}
    merged = round(server_batch)
    if merged > 0 and merged != args.batch:
        bounds["server_batch"] = merged
        bounds["plain_step_at_server_batch"] = local_bound(args, merged)
    bounds["stateless_work"] = local_bound(args, args.batch, stateless=True)
    return bounds


# -- hivemind ----------------------------------------------------------------------------


def run_hivemind(args: argparse.Namespace) -> dict[str, Any] | None:
    """hivemind's result, or None if its run crashed."""
    cmd = [
        args.hivemind_python, str(HERE / "hivemind_throughput.py"),
        "--hidden", str(args.hidden), "--batch", str(args.batch),
        "--experts", str(args.experts), "--clients", str(args.clients),
        "--seconds", str(args.seconds), "--warmup-batches", str(args.warmup),
        "--compression", args.compression, "--log-level", "WARNING",
    ]  # fmt: skip
    logger.info("running hivemind: %s", " ".join(cmd))
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=HIVEMIND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        logger.error("hivemind run did not finish in %d s", HIVEMIND_TIMEOUT_S)
        return None
    if proc.returncode != 0:
        logger.error("hivemind run failed (%d):\n%s", proc.returncode, proc.stderr[-3000:])
        return None
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# -- report ------------------------------------------------------------------------------

Round = tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _vs(pairs: Sequence[tuple[dict[str, Any] | None, dict[str, Any] | None]], bound: str) -> str:
    """Median over the repeats of a run's samples/s over the ``bound`` measured after it."""
    ratios = [
        run["samples_per_s"] / local[bound]
        for run, local in pairs
        if run and local and bound in local
    ]
    return f"{_median(ratios):.0%}" if ratios else "-"


def main(argv: list[str] | None = None) -> int:
    one_arena()  # the daemon serves in this process: its allocator as `volunteerd serve`'s
    args = parse_args(argv)
    configure_logging("INFO")
    logging.getLogger("volunteerd").setLevel(logging.WARNING)
    logger.setLevel(logging.INFO)
    logger.info(
        "workload: ffn hidden %d, batch %d, %d experts, %d clients, %g s windows, %s, "
        "%d cores",
        args.hidden, args.batch, args.experts, args.clients, args.seconds, args.dtype,
        os.cpu_count() or 0,
    )  # fmt: skip
    rounds: list[Round] = []  # per repeat: ours, hivemind's (None: crashed), the bounds
    for i in range(args.repeat):
        ours = run_volunteerd(args)
        logger.info(
            "run %d: volunteerd %.0f samples/s, mean server batch %.0f",
            i + 1, ours["samples_per_s"], ours["mean_server_batch"],
        )  # fmt: skip
        hive = run_hivemind(args) if args.hivemind_python else None
        if hive:
            logger.info("run %d: hivemind %.0f samples/s", i + 1, hive["samples_per_s"])
        local = None if args.skip_local else run_local(args, ours["mean_server_batch"])
        rounds.append((ours, hive, local))
    print_report(args, rounds)
    if args.json:
        keys = ("volunteerd", "hivemind", "local")
        runs = {key: [r[i] for r in rounds] for i, key in enumerate(keys)}
        print(json.dumps({**runs, "args": vars(args)}))
    return 0


def print_report(args: argparse.Namespace, rounds: list[Round]) -> None:
    ours_runs = [r[0] for r in rounds]
    hive_runs = [r[1] for r in rounds if r[1] is not None]
    bounds = [r[2] for r in rounds if r[2] is not None]
    ours_pairs = [(r[0], r[2]) for r in rounds]
    hive_pairs = [(r[1], r[2]) for r in rounds]
    merged = sorted({b["server_batch"] for b in bounds if "server_batch" in b})

    def cpu(runs: list[dict[str, Any]]) -> str:
        values = [r["server_cpu_us_per_sample"] for r in runs if r.get("server_cpu_us_per_sample")]
        return f"{_median(values):.0f} µs" if values else "-"

    name = "volunteerd (stateless backward)" if args.stateless else "volunteerd"
    # label, samples/s, server batch, server CPU per sample, vs step@batch, vs step@merged
    rows = [
        (
            name,
            _median([r["samples_per_s"] for r in ours_runs]),
            f"{_median([r['mean_server_batch'] for r in ours_runs]):.0f}",
            cpu(ours_runs),
            _vs(ours_pairs, "plain_step"),
            _vs(ours_pairs, "plain_step_at_server_batch"),
        )
    ]
    if hive_runs:
        rate = _median([r["samples_per_s"] for r in hive_runs])
        rows.append(
            ("hivemind 1.1.12", rate, "-", cpu(hive_runs), _vs(hive_pairs, "plain_step"), "-")
        )
    if bounds:
        plain = _median([b["plain_step"] for b in bounds])
        rows.append(
            (f"plain local step (fwd+bwd+Adam), batch {args.batch}", plain, str(args.batch),
             "-", "100%", "-")
        )  # fmt: skip
        if merged:
            sizes = ", ".join(map(str, merged))
            rate = _median([b["plain_step_at_server_batch"] for b in bounds if "server_batch" in b])
            rows.append(
                (f"plain local step, batch {sizes} (server batch)", rate, sizes, "-", "-", "100%")
            )
        stateless = _median([b["stateless_work"] for b in bounds])
        rows.append(
            (f"local stateless work (fwd; fwd+bwd+Adam), batch {args.batch}", stateless,
             str(args.batch), "-", "-", "-")
        )  # fmt: skip

    print(
        f"\nffn hidden {args.hidden}, batch {args.batch} per request, {args.experts} experts, "
        f"{args.clients} clients, {args.dtype}"
        + (f" ({args.compression} on the wire)" if args.compression != "none" else "")
        + f", {os.cpu_count()} cores"
        + (
            f", experts on {args.device} (stack_experts {args.stack_experts})"
            if args.device != "cpu"
            else ""
        )
        + f"; {args.seconds:g} s "
        f"windows (local bounds {args.local_seconds:g} s)"
        + (f"; medians of {args.repeat} alternating runs" if args.repeat > 1 else "")
    )
    header = f"{'system':54} {'samples/s':>10} {'server batch':>13} {'CPU/sample':>11}"
    header += f" {'vs step@' + str(args.batch):>12}"
    if merged:
        header += f" {'vs step@server batch':>21}"
    print(header)
    for label, rate, batch, cpu_text, vs_batch, vs_merged in rows:
        line = f"{label:54} {rate:10.0f} {batch:>13} {cpu_text:>11} {vs_batch:>12}"
        print(line + (f" {vs_merged:>21}" if merged else ""))
    print(
        "server batch: samples per batch the daemon ran; CPU/sample: the server's CPU time "
        "per sample served (forward + backward)"
    )
    if bounds:
        print(
            f"vs local stateless work: volunteerd {_vs(ours_pairs, 'stateless_work')}"
            + (f", hivemind {_vs(hive_pairs, 'stateless_work')}" if hive_runs else "")
        )
    busy = [r["worker_busy_share"] for r in ours_runs]
    per_sample = [r["compute_us_per_sample"] for r in ours_runs if r["compute_us_per_sample"]]
    print(
        f"expert compute (the daemon's device worker): busy {_median(busy):.0%} of the window, "
        f"{_median(per_sample):.0f} µs per sample served"
    )
    stacked = [r["stacked_share"] for r in ours_runs]
    if any(stacked):
        print(f"batches computed stacked (several experts as one): {_median(stacked):.0%}")
    if args.repeat > 1:
        runs = "volunteerd runs: " + ", ".join(f"{r['samples_per_s']:.0f}" for r in ours_runs)
        if hive_runs:
            runs += "; hivemind runs: " + ", ".join(f"{r['samples_per_s']:.0f}" for r in hive_runs)
        print(runs)
    if args.hivemind_python:
        print(f"hivemind runs crashed: {len(rounds) - len(hive_runs)} of {len(rounds)}")
    if hive_runs:
        ours_rate = _median([r["samples_per_s"] for r in ours_runs])
        hive_rate = _median([r["samples_per_s"] for r in hive_runs])
        print(f"volunteerd / hivemind: {ours_rate / hive_rate:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
