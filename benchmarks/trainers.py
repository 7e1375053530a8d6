"""Several trainers of one model: throughput, CPU, validation loss at equal total tokens
and the bytes each trainer spends on averaging.

What it measures
    The demo's experiment (2 DMoE layers of 4x4 experts, hidden 128, batches of 16 x 64
    bytes) trained by 1, 2 and 4 trainers at once — each its own ``volunteerd train``
    process on 127.0.0.1 — on a fresh local swarm of ``--nodes`` daemons per
    configuration (fresh experts), the same seed, and the same TOTAL number of tokens:
    N trainers train ``--steps`` / N steps each. The trainers average their trainer-side
    weights every ``--every-s`` seconds (``[averaging]``; each draws its own data shard).

    For each configuration it prints: total tokens/s (all trainers' tokens over the
    longest trainer's training time), each process's CPU seconds (trainers: their
    summary's ``cpu_seconds``; the bootstrap node and the daemons: user + system time
    from /proc, read before they are stopped), the validation loss at equal total tokens
    and its ratio to 1 trainer's, averaging rounds and averaging bytes per step.

    Validation loss at equal total tokens, for N trainers: the mean of the N trainers'
    final validation losses (each measured on the same held-out batches after its last
    step; its last averaging round at most ~``--every-s`` seconds before). Their spread
    (min-max) is printed too. Target: ratio <= 1.03 with 4 trainers.

    On a 2-core machine the trainers and daemons share 2 cores: total tokens/s cannot
    grow with the number of trainers here; the CPU columns say where the time went.

Run::

    .venv/bin/python benchmarks/trainers.py                  # 1, 2, 4 trainers, 200 steps
    .venv/bin/python benchmarks/trainers.py --steps 400 --trainers 1,4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from volunteerd.control.client import ControlClient
from volunteerd.control.models import Staleness
from volunteerd.demo.local_swarm import (
    LocalSwarm,
    start_trainer,
    stop_trainers,
    wait_trainers,
    write_experiment,
)
from volunteerd.logs import configure_logging
from volunteerd.train import Experiment

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (its threads included), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def experiment(steps: int, seed: int, every_s: float) -> Experiment:
    base = Experiment()
    return base.model_copy(
        update={
            "training": base.training.model_copy(update={"steps": steps, "seed": seed}),
            "averaging": base.averaging.model_copy(update={"every_s": every_s}),
        }
    )


def run(trainers: int, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration on a fresh swarm: ``trainers`` processes, steps / trainers each."""
    steps = args.steps // trainers
    exp = experiment(steps, args.seed, args.every_s)
    with (
        tempfile.TemporaryDirectory(prefix="volunteerd-bench-trainers-") as tmp,
        LocalSwarm.for_experiment(exp, args.nodes) as swarm,
    ):
        workdir = Path(tmp)
        config = write_experiment(exp, workdir / "experiment.toml")
        procs = [
            start_trainer(f"trainer{i + 1}", config, swarm.bootstrap_addrs[0], steps=steps,
                          workdir=workdir)
            for i in range(trainers)
        ]  # fmt: skip
        try:
            wait_trainers(procs, timeout_s=args.timeout_s)
            nodes = [n for n in [swarm.bootstrap, *swarm.daemons] if n is not None]
            daemon_cpu = {n.name: cpu_seconds(n.process.pid) for n in nodes}
            staleness = Staleness.combined(
                [ControlClient.for_data_dir(d.data_dir).staleness() for d in swarm.daemons]
            )
        finally:
            stop_trainers(procs)
        summaries = [p.summary() for p in procs]
    finals = [s["final_val_loss"] for s in summaries]
    tokens = sum(s["tokens"] for s in summaries)
    return {
        "trainers": trainers,
        "steps_each": steps,
        "tokens": tokens,
        "tokens_per_s": tokens / max(max(s["seconds"] for s in summaries), 1e-9),
        "val_loss": statistics.fmean(finals),
        "val_loss_min": min(finals),
        "val_loss_max": max(finals),
        "initial_val_loss": summaries[0]["initial_val_loss"],
        "trainer_cpu_s": [s["cpu_seconds"] for s in summaries],
        "daemon_cpu_s": daemon_cpu,
        "rounds": [s["averaging_rounds"] for s in summaries],
        "bytes_per_step": statistics.fmean(s["averaging_bytes_per_step"] for s in summaries),
        "sent_per_step": statistics.fmean(
            s["averaging_bytes_sent"] / max(s["steps"], 1) for s in summaries
        ),
        "rejected": [s["averaging_rejected"] for s in summaries],
        # at the experts: updates between a kept forward and its backward (decisions/0012)
        "staleness": staleness.model_dump(),
        "summaries": summaries,
    }


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    reference = next((r["val_loss"] for r in results if r["trainers"] == 1), None)
    print(
        f"\ndemo model, {args.steps} steps' worth of tokens in all ({args.steps * 1024:,} "
        f"tokens), {args.nodes} daemons, averaging every {args.every_s:g} s, seed {args.seed}"
    )
    print(
        "| trainers | steps each | total tokens/s | val. loss at equal tokens (min-max) "
        "| / 1 trainer | rounds per trainer | avg. bytes/step/trainer (sent) "
        "| trainer CPU s | bootstrap + daemons CPU s | expert staleness mean (max) |"
    )
    print("|---:|---:|---:|---|---:|---|---:|---|---|---|")
    for r in results:
        ratio = f"{r['val_loss'] / reference:.3f}" if reference else "-"
        daemons = " / ".join(f"{v:.0f}" for v in r["daemon_cpu_s"].values())
        print(
            f"| {r['trainers']} | {r['steps_each']} | {r['tokens_per_s']:,.0f} "
            f"| {r['val_loss']:.3f} ({r['val_loss_min']:.3f}-{r['val_loss_max']:.3f}) "
            f"| {ratio} | {', '.join(map(str, r['rounds']))} "
            f"| {r['bytes_per_step']:,.0f} ({r['sent_per_step']:,.0f}) "
            f"| {', '.join(f'{c:.0f}' for c in r['trainer_cpu_s'])} | {daemons} "
            f"| {_staleness(r['staleness'])} |"
        )
    print(
        f"\nnote: this machine has {os.cpu_count()} cores shared by every trainer, daemon and "
        "the bootstrap node: total tokens/s cannot scale with trainers here; the CPU "
        "columns say where the time went."
    )


def _staleness(stats: dict[str, Any]) -> str:
    if not stats["backwards"]:
        return "-"
    return f"{stats['mean']:.2f} ({stats['max']})"


def main() -> int:
    p = argparse.ArgumentParser(description="1, 2 and 4 trainers at equal total tokens")
    p.add_argument("--steps", type=int, default=200, help="steps of 1 trainer (N: steps/N each)")
    p.add_argument("--trainers", default="1,2,4", help="comma-separated trainer counts")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every-s", type=float, default=10.0, help="averaging period (seconds)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per configuration")
    p.add_argument("--json", metavar="FILE", help="also write every result here")
    args = p.parse_args()
    configure_logging("WARNING")
    results = []
    for n in (int(x) for x in args.trainers.split(",")):
        started = time.monotonic()
        result = run(n, args)
        results.append(result)
        print(
            f"{n} trainer(s): validation loss {result['val_loss']:.3f}, "
            f"{result['tokens_per_s']:,.0f} tokens/s, {time.monotonic() - started:.0f}s",
            flush=True,
        )
    table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
