"""The swarm at 100 to 100,000 volunteers, simulated with volunteerd's own decision code.

What it measures
    ``volunteerd.sim`` (docs/scale.md) runs the trainer's production routing (gating,
    beam search over what the directory knows, k_best/k_min/grace, failover, bans,
    checks), the volunteers' production expert assignment and the DHT store's expiry
    and caps, over modelled home links, compute times calibrated on this machine and
    a model of py-libp2p's Kademlia lookups; the experts' and the trainer's math is
    real torch. For each swarm size and share of volunteers failing intermittently
    (crash-style: down ~1 min at a time, that share of the time), one trainer trains
    the scale experiment until it reaches the target loss, and the table says:

    * DHT lookup hops and the trainer's lookup time;
    * messages and KB per volunteer per minute, up and down (serving, joining,
      announcing, answering others' DHT requests, replica averaging), and the
      busiest 1 % of volunteers' upload for serving;
    * availability: the share of the trainer's expert calls answered in time, and of
      tokens with at least one expert answer;
    * median step time (virtual seconds; 4 batches in flight), steps and time to the
      target loss, and both relative to **centralized training** of the same model
      (every expert local on one machine, steps timed from the same calibration:
      the trainer's compute plus every expert call's, nothing lost, nothing stale).

    The target loss is the validation loss centralized training reaches at
    ``--target-step`` (the mean of its last 3 evaluations); a run reaches it when the
    mean of its last 3 evaluations does. Then whether the mean volunteer's upload fits a 10 Mbit/s
    line (and the busiest 1 %'s), and plots in docs/images/scale-*.png.

    ``--validate`` instead runs the same small swarm for real (``--nodes`` daemons
    on 127.0.0.1 and one ``volunteerd train``, benchmarks/scale_real.py) and in the
    simulator (the same placement, one machine's cores shared by all, loopback
    links) and prints step time and final loss side by side: the simulator is
    trusted above that size only if both agree within 15 %.

Run::

    .venv/bin/python benchmarks/scale.py                       # ~10 min on 2 cores
    .venv/bin/python benchmarks/scale.py --sizes 100,1000 --failing 0,0.3
    .venv/bin/python benchmarks/scale.py --validate            # real vs simulated
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from volunteerd.logs import configure_logging
from volunteerd.sim.calibration import Calibration, load_or_measure
from volunteerd.sim.scenario import (
    Scenario,
    SimResult,
    centralized,
    centralized_step_s,
    simulate,
)
from volunteerd.sim.trainer import TrainRun
from volunteerd.sim.world import Churn
from volunteerd.train import Experiment, load_corpus
from volunteerd.train.data import Corpus
from volunteerd.uids import expand_pattern

HERE = Path(__file__).resolve().parent
IMAGES = HERE.parent / "docs" / "images"
UPLOAD_LIMIT_MBPS = 10.0
# Evaluations averaged for the target and for reaching it: one evaluation of a small
# model on 16 batches moves by several percent from one to the next.
WINDOW = 3


def scale_experiment() -> Experiment:
    """The demo's model, smaller so that a run fits in well under a minute of this
    machine: hidden 64, 32-byte windows, batches of 8; the demo's 2 layers of 4x4
    experts; 4 batches in flight (a gradient up to 8 updates stale is applied)."""
    return Experiment.model_validate(
        {
            "name": "scale",
            "data": {"max_bytes": 1_000_000},
            "model": {"hidden_dim": 64, "seq_len": 32, "grid": [4, 4]},
            "training": {
                "batch_size": 8,
                "in_flight": 4,
                "eval_batches": 16,
                "data_shard": 0,
            },
        }
    )


def row_of(result: SimResult, central: TrainRun, target: float) -> dict[str, Any]:
    run, swarm, sc = result.run, result.swarm, result.scenario
    reached = run.reached(target, WINDOW)
    central_at = central.reached(target, WINDOW)
    assert central_at is not None
    up_kb = {k: v / 1e3 for k, v in swarm.up_bytes_per_min.items()}
    down_kb = {k: v / 1e3 for k, v in swarm.down_bytes_per_min.items()}
    return {
        "volunteers": sc.volunteers,
        "failing": sc.churn.failing,
        "lookup_hops": swarm.lookup_hops,
        "lookup_ms": 1e3 * swarm.lookup_s,
        "messages_per_min": sum(swarm.messages_per_min.values()),
        "up_kb_per_min": sum(up_kb.values()),
        "down_kb_per_min": sum(down_kb.values()),
        "up_kb_by_purpose": up_kb,
        "down_kb_by_purpose": down_kb,
        "up_mbps": swarm.up_mbps,
        "serve_up_mbps_p99": swarm.serve_up_mbps_p99,
        "calls_answered": swarm.expert_calls_answered,
        "tokens_answered": swarm.tokens_answered,
        "step_s": run.step_s_median,
        "steps_to_target": reached[0] if reached else None,
        "time_to_target_s": reached[1] if reached else None,
        "time_ratio": reached[1] / central_at[1] if reached else None,
        "steps_ratio": reached[0] / central_at[0] if reached else None,
        "staleness_mean": swarm.staleness_mean,
        "stale_dropped": run.stale_dropped,
        "skipped": run.skipped,
        "bans": dict(run.bans),
        "rejected": dict(run.rejected),
        "wrong": sc.churn.wrong,
        "uids_served": swarm.uids_served,
        "refused_records": swarm.refused_records,
        "final_loss": run.final_loss,
        "curve": run.curve,
        "wall_s": result.wall_s,
    }


def fmt(value: Any, spec: str) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, spec)
    )


def print_table(rows: list[dict[str, Any]], central: dict[str, Any]) -> None:
    print(
        f"\ncentralized: {central['steps']} steps to the target, "
        f"{central['step_s'] * 1e3:.0f} ms a step, {central['time_s']:.1f} s "
        f"(target loss {central['target']:.3f})\n"
    )
    head = (
        f"{'volunteers':>10} {'fail':>5} {'hops':>5} {'lookup':>7} {'msg/min':>8} "
        f"{'KB up/min':>10} {'KB dn/min':>10} {'Mbit/s up':>9} {'p99 serve':>9} "
        f"{'answered':>8} {'tokens':>7} {'step s':>7} {'steps':>6} {'time s':>7} "
        f"{'x time':>7} {'x steps':>7} {'stale':>6} {'wall s':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['volunteers']:>10,} {r['failing']:>5.0%} {r['lookup_hops']:>5.2f} "
            f"{fmt(r['lookup_ms'], '>5.0f')}ms {r['messages_per_min']:>8.0f} "
            f"{r['up_kb_per_min']:>10,.0f} {r['down_kb_per_min']:>10,.0f} "
            f"{r['up_mbps']:>9.2f} {r['serve_up_mbps_p99']:>9.2f} "
            f"{r['calls_answered']:>8.1%} {r['tokens_answered']:>7.1%} {r['step_s']:>7.3f} "
            f"{fmt(r['steps_to_target'], '>6')} {fmt(r['time_to_target_s'], '>7.1f')} "
            f"{fmt(r['time_ratio'], '>7.2f')} {fmt(r['steps_ratio'], '>7.2f')} "
            f"{r['staleness_mean']:>6.2f} {r['wall_s']:>7.0f}"
        )
    print(
        "\nper volunteer and minute of its presence; 'answered': the trainer's expert calls "
        "answered in time; 'tokens': tokens with at least one expert answer; x time / "
        "x steps: to the target loss, relative to centralized training"
    )
    largest = max(r["volunteers"] for r in rows)
    print(f"\nupload per volunteer at {largest:,} volunteers (limit {UPLOAD_LIMIT_MBPS:g} Mbit/s):")
    for r in rows:
        if r["volunteers"] != largest:
            continue
        parts = ", ".join(
            f"{k} {v * 8 / 60 / 1e3:.3f}" for k, v in sorted(r["up_kb_by_purpose"].items())
        )
        worst = (
            r["up_mbps"] - r["up_kb_by_purpose"]["serve"] * 8 / 60 / 1e3 + r["serve_up_mbps_p99"]
        )
        verdict = "fits" if worst <= UPLOAD_LIMIT_MBPS else "DOES NOT FIT"
        print(
            f"  failing {r['failing']:.0%}: mean {r['up_mbps']:.3f} Mbit/s ({parts}); "
            f"busiest 1 %: {worst:.3f} Mbit/s -> {verdict}"
        )


# -- plots (Pillow: already a dependency, for the tray icon) ------------------------------

_COLOURS = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
]


def line_chart(
    series: list[tuple[str, list[tuple[float, float]]]],
    path: Path,
    *,
    title: str,
    x_label: str,
    y_label: str,
    log_x: bool = False,
) -> None:
    """A line chart of ``series`` (name, points) as a PNG."""
    width, height = 820, 500
    left, right, top, bottom = 80, 30, 70, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    points = [p for _, pts in series for p in pts if math.isfinite(p[1])]
    tx = (lambda x: math.log10(x)) if log_x else (lambda x: x)
    x_lo = min(tx(x) for x, _ in points)
    x_hi = max(tx(x) for x, _ in points)
    y_lo = min(0.0, min(y for _, y in points))
    y_hi = max(y for _, y in points) * 1.08 or 1.0
    x_hi = x_hi if x_hi > x_lo else x_lo + 1

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            left + (width - left - right) * (tx(x) - x_lo) / (x_hi - x_lo),
            height - bottom - (height - top - bottom) * (y - y_lo) / (y_hi - y_lo),
        )

    for i in range(6):
        y = y_lo + (y_hi - y_lo) * i / 5
        _, py = at(10**x_lo if log_x else x_lo, y)
        draw.line([(left, py), (width - right, py)], fill=(228, 228, 228))
        draw.text((8, py - 6), f"{y:.3g}", fill="black", font=font)
    for i in range(6):
        xv = x_lo + (x_hi - x_lo) * i / 5
        x = 10**xv if log_x else xv
        px, py = at(x, y_lo)
        draw.line([(px, py), (px, py + 5)], fill="black")
        draw.text((px - 14, py + 10), f"{x:,.3g}", fill="black", font=font)
    draw.line([(left, height - bottom), (width - right, height - bottom)], fill="black", width=2)
    draw.line([(left, top), (left, height - bottom)], fill="black", width=2)
    draw.text((width / 2 - 60, height - 28), x_label, fill="black", font=font)
    draw.text((left, top - 18), y_label, fill="black", font=font)
    draw.text((left, 10), title, fill="black", font=font)
    for i, (name, pts) in enumerate(series):
        colour = _COLOURS[i % len(_COLOURS)]
        xy = [at(x, y) for x, y in pts if math.isfinite(y)]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for px, py in xy:
            draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colour)
        lx, ly = left + 10 + 180 * (i % 4), 30 + 14 * (i // 4)
        draw.line([(lx, ly + 6), (lx + 20, ly + 6)], fill=colour, width=3)
        draw.text((lx + 26, ly), name, fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def plots(rows: list[dict[str, Any]], central: dict[str, Any], prefix: str) -> list[Path]:
    paths = []
    for failing in sorted({r["failing"] for r in rows}):
        series = [("centralized", [(t, loss) for _, t, loss in central["curve"]])]
        series += [
            (f"{r['volunteers']:,} volunteers", [(t, loss) for _, t, loss in r["curve"]])
            for r in rows
            if r["failing"] == failing
        ]
        path = IMAGES / f"{prefix}-loss-{round(failing * 100)}.png"
        line_chart(
            series,
            path,
            title=f"validation loss against (virtual) training time, {failing:.0%} of "
            "volunteers failing intermittently",
            x_label="training time (s)",
            y_label="validation loss",
        )
        paths.append(path)
    sizes = sorted({r["volunteers"] for r in rows})
    for key, name, label in [
        ("up_mbps", "upload", "mean upload per volunteer (Mbit/s)"),
        ("time_ratio", "time", "time to the target loss / centralized"),
        ("calls_answered", "answered", "expert calls answered in time"),
    ]:
        series = [
            (
                f"{failing:.0%} failing",
                [
                    (r["volunteers"], float(r[key]) if r[key] is not None else math.nan)
                    for r in rows
                    if r["failing"] == failing
                ],
            )
            for failing in sorted({r["failing"] for r in rows})
        ]
        path = IMAGES / f"{prefix}-{name}.png"
        line_chart(
            series,
            path,
            title=f"{label} against swarm size ({', '.join(f'{s:,}' for s in sizes)})",
            x_label="volunteers (log scale)",
            y_label=label,
            log_x=True,
        )
        paths.append(path)
    return paths


# -- validation ---------------------------------------------------------------------------


# What an idle daemon of the demo's swarm spends on its own upkeep (DHT refreshes at
# the swarm's periods, connections, statistics): measured with 8 idle daemons for 60 s
# on this machine, 20.6 CPU-seconds, so 0.043 of a core each.
DAEMON_UPKEEP_CORES = 0.043


def _real(path: str | None, experiment: Experiment, nodes: int, steps: int, seed: int) -> Any:
    """A real run's result: read from ``path`` if it exists, else run (and save it)."""
    from scale_real import run_real

    if path and Path(path).exists():
        return json.loads(Path(path).read_text())
    print(f"  running {nodes} real daemons and a trainer, {steps} steps...", file=sys.stderr)
    result = run_real(experiment, nodes=nodes, steps=steps, seed=seed)
    if path:
        Path(path).write_text(json.dumps(result, indent=1))
    return result


def _scenario(real: dict[str, Any], steps: int, experiment: Experiment, seed: int) -> Scenario:
    """The real run's swarm as a scenario: its daemons' placement, one machine's cores
    shared by every host, loopback links, the daemons' upkeep."""
    placement = tuple(tuple(expand_pattern(p)) for p in real["placement"])
    return Scenario(
        volunteers=len(placement),
        capacity=max(len(p) for p in placement),
        links="lan",
        shared_cores=int(real["cores"]),
        steps=steps,
        eval_every=experiment.training.eval_every,
        seed=seed,
        placement=placement,
        churn=Churn(warmup_s=1.0),
        background_cpu=DAEMON_UPKEEP_CORES,
    )


def fit_overheads(
    base: Calibration, real: dict[str, Any], experiment: Experiment, corpus: Corpus
) -> Calibration:
    """The per-request costs the microbenchmarks miss (libp2p, Noise, Yamux, queues,
    thread handoffs under contention), fitted to one real run's CPU per step: the
    simulator counts the requests a step sends and the expert math they cost in the same
    swarm; what the real processes spent beyond that, per request, is the overhead."""
    steps = 30
    probe = simulate(
        experiment,
        replace(base, server_request_s=0.0, client_request_s=0.0),
        corpus,
        _scenario(real, steps, experiment, 0),
    )
    requests = probe.swarm.requests / steps
    math_s = probe.swarm.served_s / steps
    real_steps = real["steps"]
    trainer_cpu = real["trainer_cpu_s"] / real_steps
    daemons = {k: v for k, v in real["daemon_cpu_s"].items() if k != "bootstrap"}
    daemon_cpu = sum(daemons.values()) / real_steps
    upkeep = DAEMON_UPKEEP_CORES * len(daemons) * real["training_wall_s"] / real_steps
    client = max(0.0, trainer_cpu - base.trainer_step_s) / requests
    server = max(0.0, daemon_cpu - upkeep - math_s) / requests
    print(
        f"  fit on {len(daemons)} daemons: {requests:.1f} requests a step; trainer "
        f"{trainer_cpu:.3f} CPU-s a step ({base.trainer_step_s:.3f} its own math) -> "
        f"{client * 1e3:.1f} ms a request; daemons {daemon_cpu:.3f} CPU-s a step "
        f"({upkeep:.3f} upkeep, {math_s:.3f} expert math) -> {server * 1e3:.1f} ms a request",
        file=sys.stderr,
    )
    return replace(base, client_request_s=client, server_request_s=server)


def validate(args: argparse.Namespace) -> None:
    from scale_real import demo_experiment

    experiment = demo_experiment(args.steps, args.seed)
    corpus = load_corpus(experiment.data)
    base = load_or_measure(Path(args.calibration) if args.calibration else None, experiment)
    fit_run = _real(args.real_fit, experiment, args.fit_nodes, args.steps, args.seed)
    real = _real(args.real, experiment, args.nodes, args.steps, args.seed)
    calibration = fit_overheads(base, fit_run, experiment, corpus)
    sim = simulate(
        experiment, calibration, corpus, _scenario(real, args.steps, experiment, args.seed)
    )
    rows = [
        ("step time (s, mean)", real["train_step_s"], statistics.fmean(sim.run.step_s)),
        ("final validation loss", real["final_val_loss"], sim.run.final_loss),
    ]
    print(
        f"\nvalidation: {real['nodes']} daemons of the demo's model on 127.0.0.1 + 1 trainer, "
        f"{args.steps} steps (overheads fitted on {fit_run['nodes']} daemons)\n"
    )
    print(f"{'':<26}{'real':>10}{'simulated':>11}{'sim/real':>10}")
    for name, r, s in rows:
        print(f"{name:<26}{r:>10.3f}{s:>11.3f}{s / r:>10.3f}")
    curve = "  ".join(
        f"{step}: {r:.3f}/{s[2]:.3f}"
        for (step, r), s in zip(real["val_curve"], sim.run.curve, strict=False)
    )
    print(f"\nvalidation loss, real/simulated, by step: {curve}")
    ok = all(abs(s / r - 1) <= 0.15 for _, r, s in rows)
    print(
        f"real: {real['wall_s']:.0f} s wall; simulated: {sim.wall_s:.0f} s wall "
        f"({sim.run.seconds:.0f} s virtual). Within 15 %: {'yes' if ok else 'NO'}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "real": {k: real[k] for k in ("train_step_s", "final_val_loss", "val_curve")},
                    "sim": {"step_s": sim.run.step_s, "curve": sim.run.curve},
                    "calibration": calibration.to_json(),
                },
                indent=1,
            )
        )


# -- main -----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000", help="volunteers, comma-separated")
    parser.add_argument("--failing", default="0,0.1,0.3", help="shares failing intermittently")
    parser.add_argument("--capacity", type=int, default=2, help="experts per volunteer")
    parser.add_argument(
        "--wrong", type=float, default=0.0, help="share of volunteers answering wrongly (x1000)"
    )
    parser.add_argument(
        "--target-step", type=int, default=100, help="target: centralized loss here"
    )
    parser.add_argument("--max-steps", type=int, default=200, help="a run stops here at the latest")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibration", help="JSON file: measured once, reused (default: measure)")
    parser.add_argument("--plots", default="scale", help="PNG prefix in docs/images ('' = none)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--validate", action="store_true", help="real vs simulated (see above)")
    parser.add_argument("--nodes", type=int, default=8, help="--validate: daemons")
    parser.add_argument("--fit-nodes", type=int, default=4, help="--validate: daemons to fit on")
    parser.add_argument("--steps", type=int, default=300, help="--validate: steps")
    parser.add_argument("--real", help="--validate: a real run's JSON (read, or run and saved)")
    parser.add_argument("--real-fit", help="--validate: the fitting run's JSON (likewise)")
    args = parser.parse_args()
    configure_logging("WARNING")
    sys.path.insert(0, str(HERE))
    if args.validate:
        validate(args)
        return
    began = time.perf_counter()
    experiment = scale_experiment()
    # Per-request costs over real libp2p on 127.0.0.1 (a volunteer has its machine to
    # itself; --validate fits them where 9 processes share 2 cores)
    calibration = load_or_measure(
        Path(args.calibration) if args.calibration else None, experiment, transport="libp2p"
    )
    corpus = load_corpus(experiment.data)
    print(
        f"scale.py: calibration {calibration.machine}: expert forward "
        f"{calibration.forward_s[0] * 1e3:.2f} ms + {calibration.forward_s[1] * 1e6:.2f} us/row, "
        f"backward {calibration.backward_s[0] * 1e3:.2f} ms + "
        f"{calibration.backward_s[1] * 1e6:.2f} us/row, trainer "
        f"{calibration.trainer_step_s * 1e3:.1f} ms/step",
        file=sys.stderr,
    )
    central_run = centralized(
        experiment, calibration, corpus, steps=args.target_step, eval_every=args.eval_every
    )
    target = central_run.smoothed_final(WINDOW)
    central = {
        "steps": args.target_step,
        "step_s": centralized_step_s(experiment, calibration),
        "time_s": central_run.seconds,
        "target": target,
        "curve": central_run.curve,
    }
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for failing in [float(f) for f in args.failing.split(",")]:
            result = simulate(
                experiment,
                calibration,
                corpus,
                Scenario(
                    volunteers=size,
                    churn=Churn(failing=failing, wrong=args.wrong),
                    capacity=args.capacity,
                    steps=args.max_steps,
                    eval_every=args.eval_every,
                    target_loss=target,
                    target_window=WINDOW,
                    seed=args.seed,
                ),
            )
            rows.append(row_of(result, central_run, target))
            print(
                f"  {size:,} volunteers, {failing:.0%} failing: {result.run.steps} steps, "
                f"{result.wall_s:.0f} s",
                file=sys.stderr,
            )
    print_table(rows, central)
    if args.plots:
        for path in plots(rows, central, args.plots):
            print(f"plot: {path.relative_to(HERE.parent)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"central": central, "rows": rows}, indent=1))
    print(f"\ntotal: {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
