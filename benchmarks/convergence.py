"""Convergence of the demo on the swarm against the same model trained locally, and the
cost in quality of keeping several batches in flight.

What it measures
    Runs ``volunteerd demo`` (a local swarm of ``--nodes`` daemons, experts remote) and
    ``volunteerd demo --local`` (the same model, the same experts and initial weights as
    local modules, the same optimizers and data order) for ``--steps`` steps each — the
    same number of training samples — and prints both validation curves' end points and
    their ratio (1.0 = distribution costs nothing in quality per sample).

    With ``--in-flight``, instead: the demo's model trained ``--steps`` steps (each one
    batch of 16 x 64 bytes, one update) with ``training.in_flight`` 1, 4 and 8 (staleness
    bound as many) and synchronous micro-batching (``in_flight`` 4, ``max_staleness`` 0),
    each on a fresh local swarm (fresh experts) and, with ``--local``, with local experts
    too (only the trainer's side is then stale). It prints the final validation loss,
    its ratio to ``in_flight`` 1, the staleness seen and the gradients dropped.

Run::

    .venv/bin/python benchmarks/convergence.py            # 200 steps, 3 nodes
    .venv/bin/python benchmarks/convergence.py --steps 400
    .venv/bin/python benchmarks/convergence.py --in-flight --local   # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import io
import json

import torch

from volunteerd.demo import LocalSwarm, run_demo, run_training, trainer_config
from volunteerd.logs import configure_logging
from volunteerd.moe import SwarmClient
from volunteerd.train import Experiment, TrainSummary

# (label, in_flight, max_staleness)
VARIANTS = [("1 in flight", 1, 0), ("4 in flight", 4, 4), ("8 in flight", 8, 8), ("sync 4", 4, 0)]


def main() -> int:
    p = argparse.ArgumentParser(description="demo on the swarm vs --local")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-flight", action="store_true", help="compare batches in flight")
    p.add_argument("--local", action="store_true", help="with --in-flight: local runs too")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    configure_logging("WARNING")
    if args.in_flight:
        return in_flight(args)
    runs = {}
    for mode, local in (("swarm", False), ("local", True)):
        log = io.StringIO()
        runs[mode] = run_demo(
            steps=args.steps, nodes=args.nodes, local=local, seed=args.seed, out=log
        )
    swarm, local = runs["swarm"], runs["local"]
    print(f"\ndemo model, {args.steps} steps x {swarm.tokens // max(swarm.steps, 1):,} tokens")
    print(f"{'mode':8} {'val@0':>7} {'val@end':>8} {'unigram':>8} {'tokens/s':>9} {'seconds':>8}")
    for mode, s in runs.items():
        print(
            f"{mode:8} {s.initial_val_loss:7.3f} {s.final_val_loss:8.3f} {s.unigram_loss:8.3f} "
            f"{s.tokens / s.seconds:9,.0f} {s.seconds:8.0f}"
        )
    print(
        f"final validation loss, swarm / local: {swarm.final_val_loss / local.final_val_loss:.3f}"
    )
    curve = " ".join(
        f"{step}:{a:.2f}/{b:.2f}"
        for (step, a), (_, b) in zip(swarm.val_curve, local.val_curve, strict=False)
    )
    print(f"curves (step: swarm/local): {curve}")
    if args.json:
        print(json.dumps({k: v.as_dict() for k, v in runs.items()}))
    return 0


def variant(base: Experiment, steps: int, seed: int, in_flight: int, staleness: int) -> Experiment:
    training = base.training.model_copy(
        update={"steps": steps, "seed": seed, "in_flight": in_flight, "max_staleness": staleness}
    )
    return base.model_copy(update={"training": training})


HEADER = (
    f"{'run':18} {'in flight':>9} {'bound':>5} {'val@end':>8} {'ratio':>6} "
    f"{'dropped':>7} {'mean st.':>8} {'max st.':>7} {'tokens/s':>9} {'seconds':>7}"
)


def row(name: str, s: TrainSummary, results: dict[str, TrainSummary]) -> str:
    """A table row; the ratio is to the same mode's run with one batch in flight."""
    reference = results[f"{name.split()[0]} {VARIANTS[0][0]}"].final_val_loss
    return (
        f"{name:18} {s.in_flight:9} {s.max_staleness:5} {s.final_val_loss:8.3f} "
        f"{s.final_val_loss / reference:6.3f} {s.stale_dropped:7} {s.mean_staleness:8.2f} "
        f"{s.max_staleness_seen:7} {s.tokens / s.seconds:9,.0f} {s.seconds:7.0f}"
    )


def in_flight(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    base = Experiment()
    results: dict[str, TrainSummary] = {}
    modes = ("swarm", "local") if args.local else ("swarm",)
    for mode in modes:
        for label, flying, staleness in VARIANTS:
            experiment = variant(base, args.steps, args.seed, flying, staleness)
            log = io.StringIO()
            if mode == "local":
                summary = run_training(experiment, client=None, steps=args.steps, out=log)
            else:
                with (
                    LocalSwarm.for_experiment(experiment, args.nodes) as swarm,
                    SwarmClient(
                        trainer_config(swarm.bootstrap_addrs, listen_host="127.0.0.1")
                    ) as client,
                ):
                    summary = run_training(experiment, client=client, steps=args.steps, out=log)
            results[f"{mode} {label}"] = summary
            print(row(f"{mode} {label}", summary, results), flush=True)
    print(f"\ndemo model, {args.steps} steps of one batch (16 x 64 bytes) each, seed {args.seed}")
    print(HEADER)
    for name, summary in results.items():
        print(row(name, summary, results))
    if args.json:
        print(json.dumps({k: v.as_dict() for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
