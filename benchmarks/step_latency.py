"""DMoE training-step latency on a local swarm, and how fast a dead daemon is avoided.

What it measures
    ``--servers`` daemons (separate processes, 127.0.0.1) host a 4x4 grid of ``ffn``
    experts of hidden size ``--hidden`` (whole rows each). A trainer in this process runs
    ``RemoteMixtureOfExperts(hidden, (4, 4), "ffn.", k_best=4)`` steps: forward a random
    ``--batch`` x hidden batch, then backward of ``--loss``; each step is timed. Then one
    daemon is killed (SIGKILL) and the benchmark counts the steps, after the first one that
    meets its failure, that still choose any of its experts (target: none).

    ``--loss sum`` (the default, as in hivemind's benchmark) is ``out.sum()``: it pushes
    every output down without bound (the largest element grows from ~4 to ~10^4 in ~100
    steps and ~4 x 10^4 in 165, past the trainer's ``max_abs``); the layer reports a
    diverging model (``diverging`` rounds, a warning a minute) and keeps its peers (issue
    12, item 8: it used to ban them all and stop with ``NoExpertsAvailable``).
    ``--loss square`` is ``out.square().mean()``: the experts learn to answer small and
    the model stays bounded however many steps run. A step costs the same either way.

    With ``--hivemind-python`` (or HIVEMIND_PYTHON) it also runs
    ``benchmarks/hivemind_step_latency.py`` on the same workload, in the same run.

Run::

    .venv/bin/python benchmarks/step_latency.py
    .venv/bin/python benchmarks/step_latency.py --hivemind-python .hivemind-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from volunteerd.demo import LocalSwarm, trainer_config
from volunteerd.logs import configure_logging
from volunteerd.moe import RemoteMixtureOfExperts, SwarmClient

HERE = Path(__file__).resolve().parent


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    rows = [list(range(4))[i :: args.servers] for i in range(args.servers)]
    patterns = [",".join(f"ffn.{r}.[0:4]" for r in node_rows) for node_rows in rows]
    settings = [f"experts.hidden_dim={args.hidden}", "runtime.torch_threads=1"]
    torch.manual_seed(0)
    with (
        LocalSwarm(patterns, settings) as swarm,
        SwarmClient(trainer_config(swarm.bootstrap_addrs), ban_s=600) as client,
    ):
        moe = RemoteMixtureOfExperts(
            args.hidden, (4, 4), "ffn.", k_best=4, k_min=1,
            forward_timeout_s=5.0, backward_timeout_s=5.0, grace_after_k_min_s=0.05,
            client=client,
        )  # fmt: skip
        x = torch.randn(args.batch, args.hidden)

        largest = 0.0

        def step() -> tuple[float, set[str]]:
            nonlocal largest
            before = {uid: sum(v[:2]) for uid, v in moe.stats.by_uid.items()}
            start = time.perf_counter()
            inputs = x.detach().requires_grad_()
            out = moe(inputs)
            loss = out.sum() if args.loss == "sum" else out.square().mean()
            loss.backward()
            elapsed = (time.perf_counter() - start) * 1000
            largest = float(out.detach().abs().max())
            chosen = {u for u, v in moe.stats.by_uid.items() if sum(v[:2]) > before.get(u, 0)}
            return elapsed, chosen

        for _ in range(args.warmup):
            step()
        times = [step()[0] for _ in range(args.steps)]

        victim = swarm.daemons[-1]
        dead = set(_expand(victim.experts))
        swarm.kill(len(swarm.daemons) - 1)
        killed = time.monotonic()
        after: list[tuple[float, bool, int]] = []
        failed_before = moe.stats.failed
        for _ in range(args.steps_after_kill):
            elapsed, chosen = step()
            after.append((elapsed, bool(chosen & dead), moe.stats.failed - failed_before))
            failed_before = moe.stats.failed
        first_failure = next((i for i, a in enumerate(after) if a[2]), None)
        still_chosen = (
            sum(1 for a in after[first_failure + 1 :] if a[1])
            if first_failure is not None
            else None
        )
        last_chosen = max((i for i, a in enumerate(after) if a[1]), default=None)
        checks = {
            "steps_run": args.warmup + len(times) + len(after),
            "largest_output": largest,
            "max_abs": moe.checks.max_abs,
            "diverging_rounds": dict(moe.stats.diverging),
            "rejected": dict(moe.stats.rejected),
            "bans": dict(client.directory.ban_reasons),
            "bans_held_back": moe.stats.bans_held_back,
        }
    return {
        "checks": checks,
        "median_ms": statistics.median(times),
        "p95_ms": pct(times, 0.95),
        "mean_ms": statistics.fmean(times),
        "kill": {
            "first_failure_step": first_failure,
            "steps_choosing_dead_after_first_failure": still_chosen,
            "last_step_choosing_dead": last_chosen,
            "failure_step_ms": after[first_failure][0] if first_failure is not None else None,
            "seconds_to_run_after_kill": time.monotonic() - killed,
            "median_ms_after": statistics.median(a[0] for a in after[2:])
            if len(after) > 2
            else None,
        },
    }


def _expand(pattern: str) -> list[str]:
    from volunteerd.uids import expand_pattern

    return expand_pattern(pattern)


def run_hivemind(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.hivemind_python:
        return None
    script = HERE / "hivemind_step_latency.py"
    cmd = [
        args.hivemind_python, str(script), "--hidden", str(args.hidden),
        "--batch", str(args.batch), "--servers", str(args.servers),
        "--steps", str(args.steps), "--kill-one",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        print(f"hivemind run failed ({proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    p = argparse.ArgumentParser(description="DMoE step latency and dead-daemon avoidance")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps-after-kill", type=int, default=10)
    p.add_argument(
        "--loss",
        choices=["sum", "square"],
        default="sum",
        help="sum: out.sum(), grows without bound (as hivemind's); square: out.square().mean()",
    )
    p.add_argument("--hivemind-python", default=os.environ.get("HIVEMIND_PYTHON"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    configure_logging("WARNING")
    torch.set_num_threads(1)
    ours = run_ours(args)
    hive = run_hivemind(args)
    print(
        f"\nDMoE step (forward + backward): grid 4x4 ffn, hidden {args.hidden}, batch "
        f"{args.batch}, k_best 4, {args.servers} daemons, {args.steps} steps, 2 cores"
    )
    print(f"{'system':20} {'median ms':>10} {'p95 ms':>10}  dead daemon's experts chosen")
    k = ours["kill"]
    print(
        f"{'volunteerd':20} {ours['median_ms']:10.1f} {ours['p95_ms']:10.1f}  "
        f"in {k['steps_choosing_dead_after_first_failure']} steps after the first failure "
        f"(that step: {k['failure_step_ms']:.0f} ms)"
    )
    c = ours["checks"]
    print(
        f"checks ({args.loss} loss): {c['steps_run']} steps run, largest |output| "
        f"{c['largest_output']:,.0f} (max_abs {c['max_abs']:g}), diverging rounds "
        f"{c['diverging_rounds'] or 0}, answers dropped {c['rejected'] or 0}, bans "
        f"{c['bans'] or 0}, bans held back {c['bans_held_back']}"
    )
    if hive:
        kill_s = hive.get("kill_until_not_chosen_s")
        print(
            f"{'hivemind 1.1.12':20} {hive['median_ms']:10.1f} {hive['p95_ms']:10.1f}  "
            f"for {kill_s if kill_s is not None else 'more than the limit'} s after the kill"
        )
        print(f"hivemind / volunteerd median: {hive['median_ms'] / ours['median_ms']:.1f}x")
    if args.json:
        print(json.dumps({"volunteerd": ours, "hivemind": hive, "args": vars(args)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
