"""Convergence of the demo on the swarm against the same model trained locally.

What it measures
    Runs ``volunteerd demo`` (a local swarm of ``--nodes`` daemons, experts remote) and
    ``volunteerd demo --local`` (the same model, the same experts and initial weights as
    local modules, the same optimizers and data order) for ``--steps`` steps each — the
    same number of training samples — and prints both validation curves' end points and
    their ratio (1.0 = distribution costs nothing in quality per sample).

Run::

    .venv/bin/python benchmarks/convergence.py            # 200 steps, 3 nodes
    .venv/bin/python benchmarks/convergence.py --steps 400
"""

from __future__ import annotations

import argparse
import io
import json

from volunteerd.demo import run_demo
from volunteerd.logs import configure_logging


def main() -> int:
    p = argparse.ArgumentParser(description="demo on the swarm vs --local")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    configure_logging("WARNING")
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


if __name__ == "__main__":
    raise SystemExit(main())
