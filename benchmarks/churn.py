"""Training through churn: volunteers' daemons die and come back while the demo trains.

What it measures
    The demo's model on a local swarm of ``--nodes`` daemons (default 6) where every row
    of every layer's expert grid is hosted by ``--replication`` daemons (default 2), run
    twice for the same number of steps and the same data:

    * without churn;
    * with churn: ``--churn`` of the daemons (default 30 %, rounded: 2 of 6) are killed
      with SIGKILL after a random uptime and restarted after a random downtime, again and
      again, for the whole run. A restarted daemon resumes from its own checkpoint and
      catches up with its replicas by weight averaging.

    It prints the final validation loss of both runs and their ratio, the fraction of
    steps that completed, expert calls and failed calls, failovers to a replica, and how
    many kills and restarts happened. Target: every step completes and the final
    validation loss is within 5 % of the run without churn.

Run::

    .venv/bin/python benchmarks/churn.py                  # 200 steps, 6 nodes, 2 churn
    .venv/bin/python benchmarks/churn.py --steps 300 --nodes 8
"""

from __future__ import annotations

import argparse
import io
import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from volunteerd.demo.local_swarm import LocalSwarm
from volunteerd.demo.run import run_training, trainer_config
from volunteerd.logs import configure_logging
from volunteerd.moe import SwarmClient
from volunteerd.train import Experiment

# Daemons announce, checkpoint and average often so that churn is survivable within a
# few minutes' run (a real volunteer's defaults are slower and cheaper).
SETTINGS = [
    "dht.announce_period_s=2",
    "dht.record_ttl_s=5",
    "checkpoints.every_s=5",
    "replicas.average_every_s=10",
]


@dataclass
class ChurnStats:
    kills: int = 0
    restarts: int = 0
    restart_seconds: float = 0.0


class Churn:
    """Kills and restarts the chosen daemons at random until stopped."""

    def __init__(
        self,
        swarm: LocalSwarm,
        victims: list[int],
        up_s: tuple[float, float],
        down_s: tuple[float, float],
        seed: int,
    ) -> None:
        self.swarm = swarm
        self.victims = victims
        self.up_s, self.down_s = up_s, down_s
        self.random = random.Random(seed)
        self.stats = ChurnStats()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._cycle, args=(i,)) for i in victims]

    def __enter__(self) -> Churn:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _cycle(self, index: int) -> None:
        while not self._stop.wait(self.random.uniform(*self.up_s)):
            self.swarm.kill(index)
            with self._lock:
                self.stats.kills += 1
            self._stop.wait(self.random.uniform(*self.down_s))
            started = time.monotonic()
            # Restart even when stopping, so the swarm is whole for its clean stop.
            self.swarm.restart(index)
            with self._lock:
                self.stats.restarts += 1
                self.stats.restart_seconds += time.monotonic() - started


def experiment_for(steps: int, seed: int) -> Experiment:
    base = Experiment()
    return base.model_copy(
        update={"training": base.training.model_copy(update={"steps": steps, "seed": seed})}
    )


def run(args: argparse.Namespace, churn: bool) -> dict[str, Any]:
    experiment = experiment_for(args.steps, args.seed)
    log = io.StringIO()
    with LocalSwarm.for_experiment(
        experiment, args.nodes, replication=args.replication, settings=SETTINGS
    ) as swarm:
        victims = random.Random(args.seed).sample(
            range(args.nodes), k=max(1, round(args.churn * args.nodes))
        )
        chaos = Churn(swarm, victims if churn else [], args.up_s, args.down_s, args.seed)
        with (
            SwarmClient(trainer_config(swarm.bootstrap_addrs, listen_host="127.0.0.1")) as client,
            chaos,
        ):
            summary = run_training(experiment, client=client, steps=args.steps, out=log)
    result = summary.as_dict()
    result.update(
        churn=churn,
        victims=[swarm.daemons[i].name for i in victims] if churn else [],
        kills=chaos.stats.kills,
        restarts=chaos.stats.restarts,
        mean_restart_s=chaos.stats.restart_seconds / max(chaos.stats.restarts, 1),
        log=log.getvalue()[-4000:],
    )
    return result


def main() -> int:
    p = argparse.ArgumentParser(description="demo training with daemons killed and restarted")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nodes", type=int, default=6)
    p.add_argument("--replication", type=int, default=2)
    p.add_argument("--churn", type=float, default=0.3, help="share of daemons that churn")
    p.add_argument("--up-s", type=float, nargs=2, default=(8.0, 20.0), dest="up_s")
    p.add_argument("--down-s", type=float, nargs=2, default=(3.0, 10.0), dest="down_s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    configure_logging("WARNING")
    runs = {"steady": run(args, churn=False), "churn": run(args, churn=True)}
    steady, churned = runs["steady"], runs["churn"]
    print(
        f"\n{args.nodes} daemons, every row hosted {args.replication}x, {args.steps} steps; "
        f"churn: {', '.join(churned['victims'])} killed and restarted "
        f"(up {args.up_s[0]:.0f}-{args.up_s[1]:.0f} s, down {args.down_s[0]:.0f}-"
        f"{args.down_s[1]:.0f} s)"
    )
    print(
        f"{'run':7} {'val@end':>8} {'steps ok':>9} {'calls':>7} {'failed':>7} {'kills':>6} "
        f"{'restarts':>9} {'failover':>9} {'seconds':>8}  bans / dropped answers"
    )
    for name, r in runs.items():
        completed = (r["steps"] - r["skipped_steps"]) / max(r["steps"], 1)
        print(
            f"{name:7} {r['final_val_loss']:8.3f} {completed:9.1%} {r['expert_calls']:7,} "
            f"{r['failed_calls']:7,} {r['kills']:6} {r['restarts']:9} {r['failovers']:9} "
            f"{r['seconds']:8.0f}  "
            f"{r['bans']} / {r['rejected']}"
        )
    ratio = churned["final_val_loss"] / steady["final_val_loss"]
    print(f"final validation loss, churn / steady: {ratio:.3f} (target: within 5%)")
    if args.json:
        print(json.dumps({k: {x: y for x, y in v.items() if x != "log"} for k, v in runs.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
