"""Training throughput against network latency: the DMoE and a model-parallel baseline.

The Learning@home paper's central experiment, on emulated links (needs root):

What it measures
    For each one-way host-to-host latency in ``--latencies``, the WAN emulator
    (``volunteerd.testing.wan``) builds ``--hosts`` volunteer hosts plus a bootstrap host
    and a trainer host, every link ``--mbit`` Mbit/s both ways, no loss. One daemon per
    volunteer host serves two models' experts, and the trainer host trains each model in
    turn (the order alternates between latencies), on the demo's data:

    * **dmoe** — the demo model as built: each block's feed-forward a mixture of a 4x4
      grid of experts (k_best 2), whole rows of every grid on each host, with
      ``--in-flight`` batches in flight (``training.in_flight``; staleness bounded by
      ``training.max_staleness``, default: as many as are in flight).
    * **baseline** — model parallel, the same model: each block's feed-forward is ONE
      expert (grid of 1, k_best 1) on a host of its own (block b on volunteer host b), so
      a batch crosses the hosts in sequence, forward then backward. Its best pipelining
      is synchronous micro-batching (``max_staleness = 0``: ``--in-flight`` micro-batches
      in flight within a step, one update per step, as GPipe).

    Each run trains for ``--warmup-s`` seconds, then counts the steps finished in the next
    ``--window-s`` seconds: tokens/s = steps x batch x sequence length / time. The table
    gives each model's tokens/s and its share of its own throughput at 0 ms; the plot
    (``--plot``, a PNG) draws those shares against latency.

Run (as root)::

    .venv/bin/python benchmarks/latency.py            # 0 10 50 100 200 ms: ~25 min, 2 cores
    .venv/bin/python benchmarks/latency.py --quick    # 0 and 200 ms, short windows
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from volunteerd.demo import LocalSwarm
from volunteerd.demo.local_swarm import Placement, child_env
from volunteerd.logs import configure_logging
from volunteerd.train import Experiment, Progress

HERE = Path(__file__).resolve().parent
MODES = ("dmoe", "baseline")


def experiment_for(mode: str, in_flight: int) -> Experiment:
    """The demo's experiment for ``mode``, with ``in_flight`` batches (dmoe) or
    micro-batches (baseline) in flight, and no evaluation during the run."""
    base = Experiment()
    model = base.model
    training: dict[str, Any] = {"eval_every": 10**9, "eval_batches": 1}
    fields = type(base.training).model_fields
    if "in_flight" in fields:
        training["in_flight"] = in_flight
    if mode == "baseline":
        model = model.model_copy(
            update={"grid": (1,), "k_best": 1, "k_min": 1, "uid_prefix": "base"}
        )
        if "max_staleness" in fields:
            training["max_staleness"] = 0
    return base.model_copy(
        update={"model": model, "training": base.training.model_copy(update=training)}
    )


def hosted(hosts: int, index: int) -> str:
    """Volunteer host ``index``'s experts: its rows of every dmoe grid, and the baseline
    block whose number it is (block b on host b, so each block has a host of its own)."""
    dmoe = experiment_for("dmoe", 1).model
    rows = dmoe.grid[0]
    per, extra = divmod(rows, hosts)
    start = index * per + min(index, extra)
    mine = range(start, start + per + (1 if index < extra else 0))
    patterns = [dmoe.expert_pattern(b, mine) for b in range(dmoe.num_blocks) if len(mine)]
    baseline = experiment_for("baseline", 1).model
    patterns += [baseline.expert_pattern(b) for b in range(baseline.num_blocks) if b == index]
    return ",".join(patterns)


# ---------------------------------------------------------------- the trainer's side


class StepClock(Progress):
    """Records when each step ends, and asks the trainer to stop after ``run_s``."""

    def __init__(self, run_s: float, stop: threading.Event) -> None:
        super().__init__(1, stream=sys.stderr)
        self.run_s = run_s
        self.stop = stop
        self.times: list[float] = []

    def update(self, step: int, fields: dict[str, str]) -> None:
        now = time.monotonic()
        self.times.append(now)
        if now - self.times[0] >= self.run_s:
            self.stop.set()

    def message(self, text: str) -> None:
        print(text, file=sys.stderr)

    def close(self) -> None:
        pass


def worker(args: argparse.Namespace) -> None:
    """Train ``args.worker`` in this process (run inside the trainer's host)."""
    import torch

    from volunteerd.demo import trainer_config
    from volunteerd.moe import SwarmClient
    from volunteerd.train import Trainer, build_model, load_corpus

    configure_logging("WARNING")  # tames py-libp2p's chatter
    torch.set_num_threads(1)
    experiment = experiment_for(args.worker, args.in_flight)
    corpus = load_corpus(experiment.data)
    torch.manual_seed(0)
    stop = threading.Event()
    clock = StepClock(args.warmup_s + args.window_s, stop)
    config = trainer_config([args.bootstrap], listen_host=args.listen_host)
    with SwarmClient(config) as client:
        model = build_model(experiment, client)
        summary = Trainer(experiment, model, corpus, clock, stop=stop).run(10**9)
    t, m = experiment.training, experiment.model
    # Steps that ended inside the window; the steps still in flight when it closes
    # drain afterwards and are not counted (fewer in flight: not the steady state).
    first = clock.times[0] if clock.times else 0.0
    ends = [x for x in clock.times if args.warmup_s <= x - first <= args.warmup_s + args.window_s]
    steps = len(ends) - 1
    seconds = ends[-1] - ends[0] if steps > 0 else 0.0
    result = {
        "mode": args.worker,
        "steps": steps,
        "seconds": seconds,
        "tokens_per_s": steps * t.batch_size * m.seq_len / seconds if seconds else 0.0,
        "stale_dropped": getattr(summary, "stale_dropped", 0),
        "failed_steps": summary.skipped_steps,
        "failed_calls": summary.failed_calls,
        "in_flight": getattr(t, "in_flight", 1),
    }
    Path(args.out).write_text(json.dumps(result))


# ---------------------------------------------------------------- the experiment


def measure(
    trainer: Placement, bootstrap: str, mode: str, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    out = workdir / f"{mode}.json"
    command = [
        *trainer.prefix, sys.executable, str(Path(__file__).resolve()), "--worker", mode,
        "--bootstrap", bootstrap, "--listen-host", trainer.listen_host,
        "--warmup-s", str(args.warmup_s), "--window-s", str(args.window_s),
        "--in-flight", str(args.in_flight), "--out", str(out),
    ]  # fmt: skip
    home = workdir / f"trainer-{mode}"
    home.mkdir()
    log = home / "log.txt"
    with log.open("wb") as f:
        result = subprocess.run(
            command,
            env=child_env(home),
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=args.warmup_s + args.window_s + 300,
            check=False,
        )
    if result.returncode != 0 or not out.exists():
        sys.exit(f"{mode} trainer failed ({result.returncode}):\n{log.read_text()[-3000:]}")
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def one_latency(latency_ms: float, index: int, args: argparse.Namespace) -> dict[str, Any]:
    from volunteerd.testing.wan import LinkSpec, Profile, open_wan

    link = LinkSpec(delay_ms=latency_ms / 2, up_mbit=args.mbit, down_mbit=args.mbit)
    profile = Profile.of(link, name=f"{latency_ms:g}ms")
    dmoe = experiment_for("dmoe", 1)
    settings = [
        f"experts.hidden_dim={dmoe.model.hidden_dim}",
        f'experts.optimizer.name="{dmoe.experts.name}"',
        f"experts.optimizer.lr={dmoe.experts.lr}",
        "runtime.torch_threads=1",
    ]
    patterns = [hosted(args.hosts, i) for i in range(args.hosts)]
    with open_wan(profile, hosts=args.hosts + 2, seed=0) as wan:
        places = [Placement(tuple(h.argv([])), str(h.address)) for h in wan.hosts]
        bootstrap_at, trainer_at, volunteers = places[0], places[1], places[2:]
        with (
            LocalSwarm(patterns, settings, placements=[bootstrap_at, *volunteers]) as swarm,
            tempfile.TemporaryDirectory(prefix="latency-") as tmp,
        ):
            order = MODES if index % 2 == 0 else MODES[::-1]
            row: dict[str, Any] = {"latency_ms": latency_ms}
            for mode in order:
                row[mode] = measure(trainer_at, swarm.bootstrap_addrs[0], mode, args, Path(tmp))
                r = row[mode]
                print(
                    f"  {latency_ms:g} ms {mode}: {r['tokens_per_s']:,.0f} tokens/s "
                    f"({r['steps']} steps in {r['seconds']:.0f}s, {r['failed_steps']} failed)",
                    file=sys.stderr,
                )
    return row


def table(rows: list[dict[str, Any]]) -> str:
    base = {mode: rows[0][mode]["tokens_per_s"] or 1.0 for mode in MODES}
    lines = [
        "| one-way latency | DMoE tokens/s | % of its 0 ms | baseline tokens/s | % of its 0 ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        d, b = row["dmoe"]["tokens_per_s"], row["baseline"]["tokens_per_s"]
        lines.append(
            f"| {row['latency_ms']:g} ms | {d:,.0f} | {100 * d / base['dmoe']:.0f}% "
            f"| {b:,.0f} | {100 * b / base['baseline']:.0f}% |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- the plot


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """A line chart of each model's share of its 0 ms throughput against latency."""
    width, height = 760, 460
    left, right, top, bottom = 80, 30, 90, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    x_max = max(row["latency_ms"] for row in rows) or 1.0
    shares = {
        mode: [
            100 * row[mode]["tokens_per_s"] / (rows[0][mode]["tokens_per_s"] or 1.0) for row in rows
        ]
        for mode in MODES
    }
    y_max = max(110.0, *(max(s) for s in shares.values()))
    y_max = 20 * ((y_max + 19) // 20)

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            left + (width - left - right) * x / x_max,
            height - bottom - (height - top - bottom) * y / y_max,
        )

    for y in range(0, int(y_max) + 1, 20):
        px, py = at(0, y)
        draw.line([(left, py), (width - right, py)], fill=(225, 225, 225))
        draw.text((left - 40, py - 6), f"{y}%", fill="black", font=font)
    for row in rows:
        px, py = at(row["latency_ms"], 0)
        draw.line([(px, py), (px, py + 5)], fill="black")
        draw.text((px - 10, py + 10), f"{row['latency_ms']:g}", fill="black", font=font)
    draw.line([at(0, 0), at(x_max, 0)], fill="black", width=2)
    draw.line([at(0, 0), at(0, y_max)], fill="black", width=2)
    draw.text(
        (width / 2 - 90, height - 30), "one-way latency between hosts (ms)", fill="black", font=font
    )
    draw.text((left - 70, top - 24), "throughput, % of its own at 0 ms", fill="black", font=font)
    draw.text((left, 10), f"training throughput against latency ({title})", fill="black", font=font)
    colours = {"dmoe": (31, 119, 180), "baseline": (214, 39, 40)}
    names = {"dmoe": "DMoE (several batches in flight)", "baseline": "model parallel (GPipe-style)"}
    for i, mode in enumerate(MODES):
        points = [at(row["latency_ms"], s) for row, s in zip(rows, shares[mode], strict=True)]
        if len(points) > 1:
            draw.line(points, fill=colours[mode], width=3)
        for px, py in points:
            draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=colours[mode])
        lx, ly = left + 300 * i, 36
        draw.line([(lx, ly + 6), (lx + 24, ly + 6)], fill=colours[mode], width=3)
        draw.text((lx + 32, ly), names[mode], fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--latencies", default="0,10,50,100,200", help="one-way ms, comma-separated, in order"
    )
    parser.add_argument("--window-s", type=float, default=60.0, help="measured seconds per run")
    parser.add_argument("--warmup-s", type=float, default=20.0, help="unmeasured seconds first")
    parser.add_argument("--hosts", type=int, default=4, help="volunteer hosts (2-4)")
    parser.add_argument(
        "--in-flight", type=int, default=8, help="batches (micro-batches) in flight"
    )
    parser.add_argument("--mbit", type=float, default=100.0, help="every link's rate, both ways")
    parser.add_argument("--plot", default=str(HERE.parent / "docs" / "images" / "latency.png"))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="0 and 200 ms, 10 s + 20 s runs")
    # the trainer's side, run by the experiment inside the trainer's host
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--listen-host", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.latencies, args.warmup_s, args.window_s = "0,200", 10.0, 20.0
    if os.geteuid() != 0:
        sys.exit("benchmarks/latency.py needs root: it builds network namespaces")
    if not 2 <= args.hosts <= 4:
        sys.exit("--hosts must be 2-4 (the dmoe grid has 4 rows; the baseline needs 2 hosts)")
    latencies = [float(x) for x in args.latencies.split(",")]
    if 0 not in latencies:
        latencies.append(0.0)  # every share is of the 0 ms throughput
    print(
        f"latency.py: {args.hosts} volunteer hosts, {args.mbit:g} Mbit/s links, "
        f"{args.in_flight} in flight, {args.warmup_s:g} s warm-up + {args.window_s:g} s window",
        file=sys.stderr,
    )
    # measured in the order given (the machine's load drifts: try both orders)
    rows = [one_latency(latency, i, args) for i, latency in enumerate(latencies)]
    rows.sort(key=lambda row: row["latency_ms"])
    print(table(rows))
    title = f"{args.hosts} hosts, {args.mbit:g} Mbit/s, {args.in_flight} in flight"
    plot(rows, Path(args.plot), title)
    print(f"plot: {args.plot}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
