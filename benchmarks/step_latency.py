"""DMoE training-step latency on a local swarm, and how fast a dead daemon is avoided.

What it measures
    ``--servers`` daemons (separate processes, 127.0.0.1) host a ``--grid`` of ``ffn``
    experts of hidden size ``--hidden``: whole rows each, dealt out in turn (4x4 over 3
    daemons: rows 0 and 3, 1, 2; 8x8: rows 0, 3, 6 — 1, 4, 7 — 2, 5, so 24, 24 and 16
    experts), or with ``--placement even`` single experts dealt out in turn (4x4: 6, 5
    and 5). A trainer in this process (its node on 127.0.0.1) runs
    ``RemoteMixtureOfExperts(hidden, grid, "ffn.", k_best=k, k_min=1)`` steps: forward a
    fresh random ``--batch`` x hidden batch, then backward of ``--loss``; each step is
    timed (the batch is drawn before the clock starts). Per configuration it reports the
    median and p95 step time, how many distinct experts a step called, and how many
    answers per step the layer dropped as late (``MoEStats.late``: a call still running
    ``grace_after_k_min_s`` = 50 ms after every row had its k_min = 1 answers, or 3x as
    long as the round's median request took (at least 50 ms after it); the step goes on
    without it). A faster step bought by dropping answers does not count, which is why
    the late answers stand beside the times.

    ``--k`` and ``--grid`` take lists (``--k 1,2,4,8 --grid 4x4,8x8``); ``--table`` is
    that list. Each grid gets its own swarm; the values of k then run one after the other
    on it, each with a fresh layer (``--steps`` then defaults to 30 per configuration).

    With a single configuration, one daemon is then killed (SIGKILL) and the benchmark
    counts the steps, after the first one that meets its failure, that still choose any
    of its experts (target: none). ``--steps-after-kill 0`` leaves that out.

    ``--loss square`` (the default) is ``out.square().mean()``: the experts learn to
    answer small and the outputs stay bounded however many steps run. ``--loss sum`` is
    ``out.sum()``, as in hivemind's benchmark: it pushes every output down without bound
    (the residual ``ffn`` grows from ~4 to ~10^4 in ~100 steps, past the trainer's
    ``max_abs``, and the layer reports the rounds as a diverging model). A step costs the
    same either way.

    With ``--hivemind-python`` (or HIVEMIND_PYTHON) it also runs
    ``benchmarks/hivemind_step_latency.py`` on the same workload, in the same run (that
    script knows only the 4x4 grid with k = 4).

Run::

    .venv/bin/python benchmarks/step_latency.py
    .venv/bin/python benchmarks/step_latency.py --hivemind-python .hivemind-venv/bin/python
    .venv/bin/python benchmarks/step_latency.py --k 8 --grid 8x8 --steps 30
    .venv/bin/python benchmarks/step_latency.py --table      # 8 configurations, 3-4 min
    python benchmarks/step_latency.py --device cuda --stack-experts never --grid 8x8

``--device`` puts the daemons' experts there (the trainer stays on the CPU);
``--stack-experts`` sets whether they compute experts of one size as one
(``runtime.stack_experts``).
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

from volunteerd.control.client import ControlClient
from volunteerd.demo import LocalSwarm, trainer_config
from volunteerd.logs import configure_logging
from volunteerd.moe import RemoteMixtureOfExperts, SwarmClient

HERE = Path(__file__).resolve().parent
TABLE_K = "1,2,4,8"
TABLE_GRID = "4x4,8x8"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_grid(text: str) -> tuple[int, int]:
    rows, _, cols = text.lower().partition("x")
    try:
        grid = (int(rows), int(cols))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a grid is ROWSxCOLUMNS, e.g. 4x4: {text!r}") from None
    if min(grid) < 1:
        raise argparse.ArgumentTypeError(f"a grid needs at least one row and column: {text!r}")
    return grid


def grid_patterns(grid: tuple[int, int], servers: int, placement: str = "rows") -> list[str]:
    """Each daemon's experts: whole rows, dealt out in turn ("rows"), or single experts
    dealt out in turn, row by row ("even": 4x4 over 3 daemons is 6, 5 and 5)."""
    if placement == "even":
        uids = [f"ffn.{r}.{c}" for r in range(grid[0]) for c in range(grid[1])]
        return [",".join(uids[i::servers]) for i in range(servers)]
    rows = [list(range(grid[0]))[i::servers] for i in range(servers)]
    return [",".join(f"ffn.{r}.[0:{grid[1]}]" for r in node_rows) for node_rows in rows]


def run_grid(
    args: argparse.Namespace, grid: tuple[int, int], ks: list[int], kill: bool
) -> list[dict[str, Any]]:
    """One swarm hosting ``grid``; every k of ``ks`` in turn; the kill phase after the
    last if ``kill``."""
    settings = [
        f"experts.hidden_dim={args.hidden}",
        f"runtime.torch_threads={args.torch_threads}",
        f"runtime.device={args.device}",
        f"runtime.stack_experts={args.stack_experts}",
    ]
    results = []
    with (
        LocalSwarm(grid_patterns(grid, args.servers, args.placement), settings) as swarm,
        SwarmClient(
            trainer_config(swarm.bootstrap_addrs, listen_host="127.0.0.1"), ban_s=600
        ) as client,
    ):
        for k in ks:
            torch.manual_seed(0)
            moe = RemoteMixtureOfExperts(
                args.hidden, grid, "ffn.", k_best=k, k_min=1,
                forward_timeout_s=5.0, backward_timeout_s=5.0, grace_after_k_min_s=0.05,
                client=client,
            )  # fmt: skip
            result = measure(args, moe, client, swarm)
            result.update(grid=f"{grid[0]}x{grid[1]}", k=k)
            if kill:
                result["kill"] = kill_phase(args, swarm, moe)
            results.append(result)
    return results


def step(moe: RemoteMixtureOfExperts, args: argparse.Namespace) -> dict[str, Any]:
    """One timed step: its time, the experts it called, late answers, largest output."""
    before = {uid: sum(v[:2]) for uid, v in moe.stats.by_uid.items()}
    late, failed = moe.stats.late, moe.stats.failed
    x = torch.randn(args.batch, args.hidden)
    start = time.perf_counter()
    inputs = x.requires_grad_()
    out = moe(inputs)
    loss = out.sum() if args.loss == "sum" else out.square().mean()
    loss.backward()
    elapsed_ms = (time.perf_counter() - start) * 1000
    return {
        "ms": elapsed_ms,
        "chosen": {u for u, v in moe.stats.by_uid.items() if sum(v[:2]) > before.get(u, 0)},
        "late": moe.stats.late - late,
        "failed": moe.stats.failed - failed,
        "largest": float(out.detach().abs().max()),
    }


def compute_seconds(swarm: LocalSwarm) -> float:
    """The daemons' experts' compute time so far (their worker threads), all together."""
    return sum(
        e.compute_s
        for node in swarm.daemons
        for e in ControlClient.for_data_dir(node.data_dir).experts()
    )


def measure(
    args: argparse.Namespace, moe: RemoteMixtureOfExperts, client: SwarmClient, swarm: LocalSwarm
) -> dict[str, Any]:
    for _ in range(args.warmup):
        step(moe, args)
    before = compute_seconds(swarm)
    steps = [step(moe, args) for _ in range(args.steps)]
    worker_ms = (compute_seconds(swarm) - before) * 1000 / len(steps)
    times = [s["ms"] for s in steps]
    return {
        "worker_ms": worker_ms,
        "median_ms": statistics.median(times),
        "p95_ms": pct(times, 0.95),
        "mean_ms": statistics.fmean(times),
        "experts_per_step": statistics.fmean(len(s["chosen"]) for s in steps),
        "late_per_step": statistics.fmean(s["late"] for s in steps),
        "failed_per_step": statistics.fmean(s["failed"] for s in steps),
        "checks": {
            "steps_run": args.warmup + args.steps,
            "largest_output": max(s["largest"] for s in steps),
            "max_abs": moe.checks.max_abs,
            "diverging_rounds": dict(moe.stats.diverging),
            "rejected": dict(moe.stats.rejected),
            "bans": dict(client.directory.ban_reasons),
            "bans_held_back": moe.stats.bans_held_back,
        },
    }


def kill_phase(
    args: argparse.Namespace, swarm: LocalSwarm, moe: RemoteMixtureOfExperts
) -> dict[str, Any]:
    """SIGKILL the last daemon; step on and count the steps that still choose its
    experts after the first that met its failure."""
    from volunteerd.uids import expand_pattern

    victim = swarm.daemons[-1]
    dead = set(expand_pattern(victim.experts))
    swarm.kill(len(swarm.daemons) - 1)
    killed = time.monotonic()
    after = [step(moe, args) for _ in range(args.steps_after_kill)]
    first_failure = next((i for i, a in enumerate(after) if a["failed"]), None)
    still_chosen = (
        sum(1 for a in after[first_failure + 1 :] if a["chosen"] & dead)
        if first_failure is not None
        else None
    )
    return {
        "first_failure_step": first_failure,
        "steps_choosing_dead_after_first_failure": still_chosen,
        "last_step_choosing_dead": max(
            (i for i, a in enumerate(after) if a["chosen"] & dead), default=None
        ),
        "failure_step_ms": after[first_failure]["ms"] if first_failure is not None else None,
        "seconds_to_run_after_kill": time.monotonic() - killed,
        "median_ms_after": statistics.median(a["ms"] for a in after[2:])
        if len(after) > 2
        else None,
    }


def run_hivemind(args: argparse.Namespace) -> dict[str, Any] | None:
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DMoE step latency and dead-daemon avoidance")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument(
        "--placement",
        choices=["rows", "even"],
        default="rows",
        help="rows: whole rows per daemon, dealt in turn (hivemind's script does the same); "
        "even: single experts dealt in turn",
    )
    p.add_argument("--k", default="4", help="k_best, or a list: 1,2,4,8")
    p.add_argument("--grid", default="4x4", help="ROWSxCOLUMNS, or a list: 4x4,8x8")
    p.add_argument(
        "--table", action="store_true", help=f"--k {TABLE_K} --grid {TABLE_GRID}, one table"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per configuration (default: 50, or 30 each for several)",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per configuration")
    p.add_argument(
        "--steps-after-kill",
        type=int,
        default=10,
        help="steps after killing a daemon (single configuration only; 0: no kill)",
    )
    p.add_argument(
        "--loss",
        choices=["square", "sum"],
        default="square",
        help="square: out.square().mean(), bounded; sum: out.sum() (hivemind's), grows "
        "without bound",
    )
    p.add_argument("--device", default="cpu", help="the daemons' runtime.device (e.g. cuda)")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="each daemon's runtime.torch_threads (0: torch's default, one per core)",
    )
    p.add_argument(
        "--stack-experts",
        choices=["auto", "always", "never"],
        default="auto",
        help="the daemons' runtime.stack_experts (auto: on a GPU only)",
    )
    p.add_argument("--hivemind-python", default=os.environ.get("HIVEMIND_PYTHON"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.table:
        args.k, args.grid = TABLE_K, TABLE_GRID
    try:
        args.ks = [int(k) for k in args.k.split(",")]
        args.grids = [parse_grid(g) for g in args.grid.split(",")]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        p.error(str(exc))
    for grid in args.grids:
        if grid[0] < args.servers:
            p.error(f"grid {grid[0]}x{grid[1]} has fewer rows than --servers {args.servers}")
        if max(args.ks) > grid[0] * grid[1]:
            p.error(f"k_best {max(args.ks)} is more than grid {grid[0]}x{grid[1]} holds")
    args.single = len(args.ks) == 1 and len(args.grids) == 1
    if args.steps is None:
        args.steps = 50 if args.single else 30
    if args.hivemind_python and not (args.single and args.ks == [4] and args.grids == [(4, 4)]):
        print(
            "hivemind's step benchmark knows only the 4x4 grid with k = 4: not run", file=sys.stderr
        )
        args.hivemind_python = None
    return args


def print_checks(results: list[dict[str, Any]]) -> None:
    """What the output checks saw: one line if nothing fired, else one per configuration."""
    checks = [r["checks"] for r in results]
    fired = [
        (r, c)
        for r, c in zip(results, checks, strict=True)
        if c["diverging_rounds"] or c["rejected"] or c["bans"] or c["bans_held_back"]
    ]
    largest = max(c["largest_output"] for c in checks)
    if not fired:
        print(
            f"checks: largest |output| {largest:,.1f} (max_abs {checks[0]['max_abs']:g}); no "
            "diverging rounds, no answers dropped by a check, no bans"
        )
    for r, c in fired:
        print(
            f"checks, {r['grid']} k={r['k']}: largest |output| {c['largest_output']:,.1f} "
            f"(max_abs {c['max_abs']:g}), diverging rounds {c['diverging_rounds'] or 0}, "
            f"answers dropped {c['rejected'] or 0}, bans {c['bans'] or 0}, bans held back "
            f"{c['bans_held_back']}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("WARNING")
    torch.set_num_threads(1)
    kill = args.single and args.steps_after_kill > 0
    results = [r for grid in args.grids for r in run_grid(args, grid, args.ks, kill)]
    hive = run_hivemind(args) if args.hivemind_python else None
    print(
        f"\nDMoE step (forward + backward of {args.loss} loss): ffn hidden {args.hidden}, "
        f"batch {args.batch}, {args.servers} daemons ({args.placement}), {args.steps} steps each, "
        f"{os.cpu_count()} cores"
    )
    print(
        f"{'system':16} {'grid':>5} {'k':>3} {'median ms':>10} {'p95 ms':>8} "
        f"{'experts/step':>13} {'late/step':>10} {'failed/step':>12} {'compute ms':>11}"
    )
    for r in results:
        print(
            f"{'volunteerd':16} {r['grid']:>5} {r['k']:>3} {r['median_ms']:10.1f} "
            f"{r['p95_ms']:8.1f} {r['experts_per_step']:13.1f} {r['late_per_step']:10.2f} "
            f"{r['failed_per_step']:12.2f} {r['worker_ms']:11.1f}"
        )
    if hive:
        print(
            f"{'hivemind 1.1.12':16} {'4x4':>5} {4:>3} {hive['median_ms']:10.1f} "
            f"{hive['p95_ms']:8.1f} {'-':>13} {'-':>10} {'-':>12} {'-':>11}"
        )
        print(f"hivemind / volunteerd median: {hive['median_ms'] / results[0]['median_ms']:.1f}x")
    print(
        "late: calls dropped by the k_min rule (k_min 1: still running 50 ms after every "
        "row had an answer, or 3x the round's median answer time); failed: calls that got "
        "no answer; compute ms: the daemons' expert compute per step (their worker "
        "threads, all daemons together)"
    )
    print_checks(results)
    if kill:
        k = results[0]["kill"]
        failure_ms = k["failure_step_ms"]
        print(
            f"a killed daemon's experts were chosen in "
            f"{k['steps_choosing_dead_after_first_failure']} steps after the first failure "
            f"(that step: {'-' if failure_ms is None else f'{failure_ms:.0f}'} ms)"
        )
        if hive:
            kill_s = hive.get("kill_until_not_chosen_s")
            print(
                f"hivemind chose them for "
                f"{kill_s if kill_s is not None else 'more than the limit'} s after the kill"
            )
    if args.json:
        options = {k: v for k, v in vars(args).items() if k not in ("ks", "grids")}
        print(json.dumps({"volunteerd": results, "hivemind": hive, "args": options}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
