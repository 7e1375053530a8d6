"""The simulator's reference: a small swarm trained for real, the numbers it must match.

What it measures
    A real local swarm of ``--nodes`` daemons on 127.0.0.1 (each its own ``volunteerd
    serve`` process, plus a bootstrap node) hosting the demo experiment's experts, and ONE
    ``volunteerd train`` process training it ``--steps`` steps (validation every
    ``steps / 6`` steps). ``docs/scale.md`` compares these numbers with the simulator's
    at the same size (issue 17, item 4: step time and final loss within 15 %).

    Where the experts live: with more nodes than rows in the grid's first dimension, each
    (layer, row) of the grids goes to one daemon, round robin (8 daemons, the demo's 2
    layers of 4 x 4: one row of 4 experts each, no replicas); with fewer, each daemon
    hosts whole rows of every layer, as ``volunteerd demo``; ``--replication r`` hosts
    every row on r daemons instead.

    Step time, three ways: ``step_s`` is the summary's training seconds over its steps
    (the validations every ``steps / 6`` steps included, as the trainer counts them);
    ``train_step_s`` and ``step_s_median`` come from the trainer's progress lines (one
    every ``steps / 20`` steps), timestamped here as they appear in its log: the mean and
    the median seconds per step over the stretches with no validation in them.
    ``eval_s`` is what one validation adds (a stretch with one, less the median).

    CPU seconds during training (from the first validation's end to the trainer's end,
    read from /proc): the trainer's and each daemon's; per step, that is where a step's
    time goes on a machine whose cores all these processes share.

Run::

    .venv/bin/python benchmarks/scale_real.py                       # 8 nodes, 300 steps
    .venv/bin/python benchmarks/scale_real.py --nodes 4 --steps 120 --json real.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from volunteerd.control.client import ControlClient
from volunteerd.demo.local_swarm import (
    LocalSwarm,
    TrainerProcess,
    start_trainer,
    stop_trainers,
    wait_trainers,
    write_experiment,
)
from volunteerd.logs import configure_logging
from volunteerd.train import Experiment

__all__ = ["demo_experiment", "run_real", "swarm_for"]

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
# the trainer's log: progress lines ("step  15/300 [====  ] loss ...") and validations
_PROGRESS = re.compile(rb"^step +(\d+)/\d+ \[")
_VALIDATION = re.compile(rb"^step (\d+): validation loss ([0-9.]+)")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (all its threads), from /proc; NaN once
    it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def demo_experiment(steps: int = 300, seed: int = 0, **model: Any) -> Experiment:
    """The experiment ``volunteerd demo`` trains (``Experiment()`` with its seed and
    steps), validating every ``steps / 6`` steps, drawing data shard 0 (the batches the
    simulator's trainer draws); ``model`` overrides model settings."""
    base = Experiment()
    return base.model_copy(
        update={
            "model": base.model.model_copy(update=model),
            "training": base.training.model_copy(
                update={
                    "steps": steps,
                    "seed": seed,
                    "eval_every": max(1, steps // 6),
                    "data_shard": 0,
                }
            ),
        }
    )


def swarm_for(experiment: Experiment, nodes: int, replication: int = 1) -> LocalSwarm:
    """A (not yet started) local swarm of ``nodes`` daemons for ``experiment``: whole
    rows of every layer per daemon when ``nodes`` fits the grid's first dimension,
    else one (layer, row) unit after another, round robin; ``replication`` > 1 as
    ``LocalSwarm.for_experiment`` places replicas."""
    m = experiment.model
    if replication > 1 or nodes <= m.grid[0]:
        return LocalSwarm.for_experiment(experiment, nodes, replication=replication)
    units = [(b, r) for b in range(m.num_blocks) for r in range(m.grid[0])]
    if nodes > len(units):
        raise ValueError(f"{nodes} nodes, but only {len(units)} rows of experts to host")
    hosted: list[list[str]] = [[] for _ in range(nodes)]
    for i, (b, r) in enumerate(units):
        hosted[i % nodes].append(m.expert_pattern(b, range(r, r + 1)))
    # the daemons' settings (width, optimizer, threads) exactly as for_experiment's; the
    # constructor only stores them, nothing starts
    settings = LocalSwarm.for_experiment(experiment, 1).settings
    return LocalSwarm([",".join(h) for h in hosted], settings)


@dataclass
class _LogWatch:
    """Timestamps the trainer's progress and validation lines as they appear in its log,
    and the trainer's and daemons' CPU seconds when training starts (the first
    validation's line) and ends (the validation after step ``final_step``)."""

    trainer: TrainerProcess
    daemon_pids: dict[str, int]
    final_step: int
    period_s: float = 0.05
    progress: list[tuple[float, int]] = field(default_factory=list)  # (when, step)
    validations: list[tuple[float, int, float]] = field(default_factory=list)
    cpu_at_start: dict[str, float] = field(default_factory=dict)
    cpu_at_end: dict[str, float] = field(default_factory=dict)
    started_at: float | None = None
    ended_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        offset, partial = 0, b""
        pid = self.trainer.process.pid
        while True:
            stopping = self._stop.is_set()
            try:
                with self.trainer.log_file.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                chunk = b""
            offset += len(chunk)
            now = time.monotonic()
            *lines, partial = (partial + chunk).split(b"\n")
            for line in lines:
                line = line.strip()
                if m := _PROGRESS.match(line):
                    self.progress.append((now, int(m.group(1))))
                elif m := _VALIDATION.match(line):
                    step = int(m.group(1))
                    self.validations.append((now, step, float(m.group(2))))
                    if step == 0 and self.started_at is None:
                        self.started_at, self.cpu_at_start = now, self._cpu(pid)
                    elif step == self.final_step and self.ended_at is None:
                        self.ended_at, self.cpu_at_end = now, self._cpu(pid)
            if stopping:
                return
            self._stop.wait(self.period_s)

    def _cpu(self, trainer_pid: int) -> dict[str, float]:
        pids = {"trainer": trainer_pid, **self.daemon_pids}
        return {name: cpu_seconds(pid) for name, pid in pids.items()}

    def stop(self) -> None:
        self._stop.set()


def _step_times(
    progress: list[tuple[float, int]], eval_steps: set[int], started_at: float | None
) -> tuple[list[float], list[tuple[float, int]]]:
    """Seconds per step over each stretch between two progress lines (the first from
    the start of training), split into stretches without a validation and those with
    (seconds, validations in it)."""
    clean: list[float] = []
    with_eval: list[tuple[float, int]] = []
    marks = ([(started_at, 0)] if started_at is not None else []) + progress
    for (t0, s0), (t1, s1) in itertools.pairwise(marks):
        if s1 <= s0:
            continue
        # a validation runs right after its step's progress line: the one after s0
        # falls in this stretch, the one after s1 in the next
        evals = sum(1 for s in eval_steps if s0 <= s < s1 and s > 0)
        if evals:
            with_eval.append((t1 - t0, evals))
        else:
            clean.append((t1 - t0) / (s1 - s0))
    return clean, with_eval


def _daemon_stats(swarm: LocalSwarm) -> dict[str, dict[str, Any]]:
    """Each daemon's expert calls served and compute seconds (its control API)."""
    out: dict[str, dict[str, Any]] = {}
    for node in swarm.daemons:
        try:
            experts = ControlClient.for_data_dir(node.data_dir).experts()
        except Exception as exc:  # a report, not a check: say what is missing
            out[node.name] = {"error": str(exc)}
            continue
        out[node.name] = {
            "experts": len(experts),
            "forward": sum(e.forward for e in experts),
            "backward": sum(e.backward for e in experts),
            "samples": sum(e.samples for e in experts),
            "compute_s": sum(e.compute_s for e in experts),
        }
    return out


def run_real(
    experiment: Experiment,
    *,
    nodes: int = 8,
    steps: int = 300,
    seed: int = 0,
    replication: int = 1,
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Train ``experiment`` ``steps`` steps (training seed ``seed``) with one trainer on a
    fresh local swarm of ``nodes`` daemons; returns what ``docs/scale.md`` compares."""
    experiment = experiment.model_copy(
        update={"training": experiment.training.model_copy(update={"steps": steps, "seed": seed})}
    )
    t, m = experiment.training, experiment.model
    began = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="volunteerd-bench-scale-real-") as tmp,
        swarm_for(experiment, nodes, replication) as swarm,
    ):
        swarm_ready_s = time.monotonic() - began
        workdir = Path(tmp)
        config = write_experiment(experiment, workdir / "experiment.toml")
        trainer = start_trainer(
            "trainer", config, swarm.bootstrap_addrs[0], steps=steps, workdir=workdir
        )
        pids = {n.name: n.process.pid for n in [swarm.bootstrap, *swarm.daemons] if n}
        watch = _LogWatch(trainer, pids, steps)
        watcher = threading.Thread(target=watch.run, name="log-watch", daemon=True)
        watcher.start()
        try:
            wait_trainers([trainer], timeout_s=timeout_s)
            daemon_cpu_end = {name: cpu_seconds(pid) for name, pid in pids.items()}
            daemons = _daemon_stats(swarm)
        finally:
            stop_trainers([trainer])
            watch.stop()
            watcher.join(10)
        summary = trainer.summary()
    eval_steps = {s for s in range(t.eval_every, steps + 1, t.eval_every)} | {steps}
    clean, with_eval = _step_times(watch.progress, eval_steps, watch.started_at)
    median = statistics.median(clean) if clean else None
    # one validation's seconds: a stretch with validations in it, less its steps' share
    progress_every = max(1, steps // 20)
    eval_s = (
        statistics.median((s - progress_every * median) / n for s, n in with_eval)
        if with_eval and median is not None
        else None
    )
    nan = float("nan")
    training_s = (
        watch.ended_at - watch.started_at
        if watch.started_at is not None and watch.ended_at is not None
        else None
    )
    cpu_during = {
        name: watch.cpu_at_end.get(name, nan) - watch.cpu_at_start.get(name, nan)
        for name in ["trainer", *pids]
    }
    trainer_cpu = cpu_during.pop("trainer")
    done = max(int(summary["steps"]), 1)
    failures = dict(summary.get("failures", {}))
    return {
        "nodes": nodes,
        "replication": replication,
        "placement": [d.experts for d in swarm.daemons],
        "steps": summary["steps"],
        "tokens_per_step": t.batch_size * m.seq_len,
        "seconds": summary["seconds"],
        "step_s": summary["seconds"] / done,
        "train_step_s": statistics.fmean(clean) if clean else None,
        "step_s_median": median,
        "step_s_stretches": clean,
        "eval_s": eval_s,
        "evaluations": len(eval_steps),
        "tokens_per_s": summary["tokens"] / max(summary["seconds"], 1e-9),
        "initial_val_loss": summary["initial_val_loss"],
        "final_val_loss": summary["final_val_loss"],
        "unigram_loss": summary["unigram_loss"],
        "val_curve": summary["val_curve"],
        # trainer side (the summary): calls = forward + backward, answered or not
        "expert_calls": summary["expert_calls"],
        "failed_calls": summary["failed_calls"],
        "failures": failures,
        "failovers": summary.get("failovers", 0),
        "skipped_steps": summary.get("skipped_steps", 0),
        "rejected": summary.get("rejected", {}),
        "bans": summary.get("bans", {}),
        # not in TrainSummary (the layers' stats have them): None = not measured
        "late": summary.get("late"),
        "unanswered_tokens": summary.get("unanswered_tokens"),
        # server side (each daemon's control API): calls served, compute seconds
        "forward_served": sum(d.get("forward", 0) for d in daemons.values()),
        "backward_served": sum(d.get("backward", 0) for d in daemons.values()),
        "daemons": daemons,
        # wall and CPU seconds from the end of the first validation to the end of the
        # last (the summary's seconds, as seen from here)
        "training_wall_s": training_s,
        "trainer_cpu_s": trainer_cpu,
        "trainer_cpu_total_s": summary.get("cpu_seconds"),
        "daemon_cpu_s": cpu_during,
        "daemon_cpu_total_s": daemon_cpu_end,
        "cores": os.cpu_count(),
        "swarm_ready_s": swarm_ready_s,
        "wall_s": time.monotonic() - began,
    }


def table(r: dict[str, Any]) -> None:
    def num(v: Any, fmt: str = ".3f") -> str:
        return "-" if v is None else format(v, fmt)

    steps = max(int(r["steps"]), 1)
    daemon_cpu = sum(v for k, v in r["daemon_cpu_s"].items() if k != "bootstrap")
    print(
        f"\nreal swarm: {r['nodes']} daemons (replication {r['replication']}), one trainer, "
        f"{r['steps']} steps of {r['tokens_per_step']} tokens, {r['cores']} cores"
    )
    print("| measure | value |")
    print("|---|---:|")
    rows = [
        ("training seconds (summary, validations included)", num(r["seconds"], ".1f")),
        ("step s (summary seconds / steps)", num(r["step_s"])),
        ("step s, mean without validations", num(r["train_step_s"])),
        ("step s, median without validations", num(r["step_s_median"])),
        ("one validation, s", num(r["eval_s"], ".2f")),
        ("tokens/s", num(r["tokens_per_s"], ",.0f")),
        ("validation loss: initial -> final", f"{r['initial_val_loss']:.3f} -> "
         f"{r['final_val_loss']:.3f}"),
        ("expert calls (trainer) / failed", f"{r['expert_calls']:,} / {r['failed_calls']}"),
        ("forward / backward served (daemons)",
         f"{r['forward_served']:,} / {r['backward_served']:,}"),
        ("failovers / skipped steps", f"{r['failovers']} / {r['skipped_steps']}"),
        ("trainer CPU s during training (per step)",
         f"{r['trainer_cpu_s']:.1f} ({r['trainer_cpu_s'] / steps:.3f})"),
        ("daemons' CPU s during training (per step)",
         f"{daemon_cpu:.1f} ({daemon_cpu / steps:.3f})"),
        ("bootstrap CPU s during training", num(r["daemon_cpu_s"].get("bootstrap"), ".1f")),
        ("daemons' expert compute s (their stats)",
         num(sum(d.get("compute_s", 0.0) for d in r["daemons"].values()), ".1f")),
        ("wall seconds (swarm start to stop)", num(r["wall_s"], ".0f")),
    ]  # fmt: skip
    for name, value in rows:
        print(f"| {name} | {value} |")
    curve = ", ".join(f"{s}: {v:.3f}" for s, v in r["val_curve"])
    print(f"\nvalidation curve: {curve}")


def main() -> int:
    p = argparse.ArgumentParser(description="the simulator's reference: a real small swarm")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replication", type=int, default=1, help="daemons hosting each row")
    p.add_argument("--hidden-dim", type=int, default=None, help="model width (demo: 128)")
    p.add_argument("--grid", default=None, help='expert grid, e.g. "4x4" (the demo\'s)')
    p.add_argument("--k-best", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--json", metavar="FILE", help="also write the result here")
    args = p.parse_args()
    configure_logging("WARNING")
    model: dict[str, Any] = {}
    if args.hidden_dim is not None:
        model["hidden_dim"] = args.hidden_dim
    if args.grid is not None:
        model["grid"] = tuple(int(g) for g in args.grid.split("x"))
    if args.k_best is not None:
        model["k_best"] = args.k_best
    experiment = demo_experiment(args.steps, args.seed, **model)
    result = run_real(
        experiment,
        nodes=args.nodes,
        steps=args.steps,
        seed=args.seed,
        replication=args.replication,
        timeout_s=args.timeout_s,
    )
    table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
