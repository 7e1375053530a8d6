"""What stepping many small experts together saves over stepping them one by one.

What it measures
    ``--experts`` built-in ``ffn`` experts (default 8) of ``--hidden`` (default 512:
    2.1 M weights each) on ``--device``, each given the gradients of one ``--rows``-row
    backward (default 16, as a daemon of many small experts sees), then stepped:

    * "one by one": ``[b.step(check) for b in experts]``, what the runtime does today;
    * "together": ``experts.multistep.step_many(experts, check, ...)``: one norm pass
      over all gradients and one over all weights, one optimizer call per group of
      experts with the same settings.

    Both with the step check as the runtime builds it (``StepCheck(max_step_ratio,
    full_every=full_check_every)`` from ``GuardConfig``'s defaults: every step of the
    run takes its cheap path, the full check coming only every 100th step of an
    expert) and without. Each line is the median of ``--repeats`` steps of all experts,
    the two ways taken in turns on two identical sets of experts (the backwards are not
    timed). Milliseconds per step of all experts. Other load on the machine shows in
    the numbers: the load average is printed before and after.

Run::

    .venv/bin/python benchmarks/multistep.py
    .venv/bin/python benchmarks/multistep.py --threads 1
    .venv/bin/python benchmarks/multistep.py --experts 32 --hidden 256 --device cuda
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from volunteerd.config import ExpertsConfig, GuardConfig
from volunteerd.experts import ExpertBackend
from volunteerd.experts.multistep import step_many
from volunteerd.experts.stepcheck import StepCheck, StepOutcome

OPTIMIZERS = {
    "adam": {"name": "adam", "lr": 1e-3},
    "sgd+mom": {"name": "sgd", "lr": 1e-3, "momentum": 0.9},
}

Stepper = Callable[[Sequence[ExpertBackend], StepCheck | None], list[StepOutcome]]


def one_by_one(experts: Sequence[ExpertBackend], check: StepCheck | None) -> list[StepOutcome]:
    return [b.step(check) for b in experts]


def together(experts: Sequence[ExpertBackend], check: StepCheck | None) -> list[StepOutcome]:
    return step_many(experts, check, [False] * len(experts))


def make_experts(
    count: int, hidden: int, optimizer: str, device: torch.device
) -> list[ExpertBackend]:
    config = ExpertsConfig(hidden_dim=hidden, optimizer=OPTIMIZERS[optimizer])
    return [ExpertBackend(f"ffn.0.{i}", config, device, 1024) for i in range(count)]


def backward(experts: Sequence[ExpertBackend], rows: int, generator: torch.Generator) -> None:
    for b in experts:
        hidden = b.info.hidden_dim
        x = torch.randn(rows, hidden, generator=generator)
        b.backward([x], [torch.randn(rows, hidden, generator=generator) * 1e-2])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    sets: dict[str, list[ExpertBackend]],
    checks: dict[str, StepCheck | None],
    steppers: dict[str, Stepper],
    rows: int,
    repeats: int,
) -> dict[str, float]:
    """Median seconds of one step of all experts of each set (its stepper, its check),
    the sets taken in turns. Raises if a step was undone: the runs would differ."""
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in sets}
    for _ in range(repeats):
        for name, experts in sets.items():
            backward(experts, rows, generator)
            device = experts[0].device
            sync(device)
            start = time.perf_counter()
            outcomes = steppers[name](experts, checks[name])
            sync(device)
            times[name].append(time.perf_counter() - start)
            if any(outcome.undone is not None for outcome in outcomes):
                raise RuntimeError(f"a step was undone: {outcomes}")
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", type=int, default=16, help="rows of each expert's backward")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    guard = GuardConfig()

    weights = sum(
        p.numel() for p in make_experts(1, args.hidden, "adam", device)[0].module.parameters()
    )
    print(
        f"{args.experts} ffn experts of hidden {args.hidden} ({weights / 1e6:.1f} M weights "
        f"each), {args.rows}-row backward each, on {device} ({torch.get_num_threads()} threads)"
    )
    print(f"ms per step of all experts, median of {args.repeats}; load average {load()}")
    print(f"{'optimizer':<10}{'check':<8}{'one by one':>12}{'together':>10}{'saved':>8}{'':>6}")
    for optimizer in OPTIMIZERS:
        for checked in (True, False):
            sets = {
                name: make_experts(args.experts, args.hidden, optimizer, device)
                for name in ("one by one", "together")
            }
            checks = {
                name: StepCheck(guard.max_step_ratio, full_every=guard.full_check_every)
                if checked
                else None
                for name in sets
            }
            steppers: dict[str, Stepper] = {"one by one": one_by_one, "together": together}
            time_steps(sets, checks, steppers, args.rows, 2)  # creates the optimizer state
            t = time_steps(sets, checks, steppers, args.rows, args.repeats)
            alone, joint = t["one by one"] * 1e3, t["together"] * 1e3
            print(
                f"{optimizer:<10}{'on' if checked else 'off':<8}{alone:>12.2f}{joint:>10.2f}"
                f"{alone - joint:>+8.2f}{(alone - joint) / alone:>+6.0%}"
            )
    print(f"load average {load()}")


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
