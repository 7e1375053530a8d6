"""What the check after every optimizer step costs, and how far one request moves weights.

What it measures
    For one built-in ``ffn`` expert of ``--hidden`` (default 1024: 8.4 M weights) on
    ``--device``:

    * the optimizer step alone (fused Adam, SGD, SGD with momentum 0.9) and the same
      step through ``StepCheck`` on its two paths: "predicted" (the gradients' norm and
      the bound before the step, the weights' norm after it, and the momentum buffers'
      for SGD with momentum: no copy) and "full" (copy of weights and optimizer state
      into the preallocated shadow, the step, ‖Δw‖, ‖w‖ and the largest |state value|),
      over ``--steps`` rounds after warm-up: each a plain step, a full check and a run
      of predicted steps, timed as their mean (at the default learning rate an Adam
      step measures the weights' norm every second or third step of a run and carries
      a bound of it in between, as in a server's run of steps). The steady state is the
      predicted path with one full check every ``guard.full_check_every`` (100) steps:
      "steady" is that average. Undoing a refused step costs one more copy back;
    * how far one step moves the weights (‖Δw‖ / ‖w‖), after ``--warmup`` honest steps
      (gradients of RMS 1e-2 on 64 samples), for: an honest step; one sample from a
      stranger with every gradient value at 9e5 (just under ``guard.max_gradient_abs``;
      the worst a request gets through the guard of an expert that has not warmed up);
      and whether the check kept or undid that step.

Run::

    .venv/bin/python benchmarks/step_check.py
    .venv/bin/python benchmarks/step_check.py --hidden 4096 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from volunteerd.config import ExpertsConfig
from volunteerd.experts import ExpertBackend
from volunteerd.experts.stepcheck import StepCheck

OPTIMIZERS = {
    "adam": {"name": "adam", "lr": 1e-3},
    "sgd": {"name": "sgd", "lr": 1e-3},
    "sgd+mom": {"name": "sgd", "lr": 1e-3, "momentum": 0.9},
}
FULL_CHECK_EVERY = 100  # the default of guard.full_check_every


def backend(hidden: int, optimizer: str, device: torch.device) -> ExpertBackend:
    config = ExpertsConfig(hidden_dim=hidden, optimizer=OPTIMIZERS[optimizer])
    return ExpertBackend("ffn.0.0", config, device, 2048)


def fill_gradients(b: ExpertBackend, scale: float = 1e-2) -> None:
    """Fresh gradients in the buffers the expert reuses (as the server does: fresh
    allocations would make every step pay for page faults)."""
    with torch.no_grad():
        for p in b.module.parameters():
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.normal_(0.0, scale)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MODES = ("plain", "predicted", "full")
# Predicted steps run in a row, as a server takes them: after the first of a run (which
# measures the weights the plain or full step before it changed) an Adam step carries a
# bound of the weights' norm instead of measuring it, for at most CARRIED_STEPS steps.
PREDICTED_RUN = 6


def time_steps(b: ExpertBackend, check: StepCheck, steps: int) -> dict[str, float]:
    """Seconds of one step unchecked, on the check's cheap path and with its full check,
    in rounds (a plain step, a full check, then ``PREDICTED_RUN`` predicted steps after
    one untimed) so that other load on the machine weighs on all alike (gradients
    refilled outside). Plain and full: medians; predicted: the median of each run's mean
    (steps that measure the weights and steps that carry a bound, as they come). Raises
    if a step did not take the path it times."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(steps):
        runs: list[float] = []
        for mode in ("plain", "full", *["predicted"] * (PREDICTED_RUN + 1)):
            fill_gradients(b)
            sync(b.device)
            start = time.perf_counter()
            outcome = b.step(None if mode == "plain" else check, audit=mode == "full")
            sync(b.device)
            took = time.perf_counter() - start
            wanted = "unchecked" if mode == "plain" else mode
            if outcome.judged != wanted or outcome.undone is not None:
                raise RuntimeError(f"a {mode} step was judged {outcome}")
            if mode != "predicted":
                times[mode].append(took)
            else:
                runs.append(took)
        times["predicted"].append(statistics.mean(runs[1:]))
    return {mode: statistics.median(t) for mode, t in times.items()}


def moved(hidden: int, optimizer: str, device: torch.device, warmup: int) -> list[str]:
    b = backend(hidden, optimizer, device)
    check = StepCheck(max_ratio=1.0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(warmup):
        x = torch.randn(64, hidden, generator=generator)
        b.backward([x], [torch.randn(64, hidden, generator=generator) * 1e-2])
        b.step(check)
    x = torch.randn(64, hidden, generator=generator)
    b.backward([x], [torch.randn(64, hidden, generator=generator) * 1e-2])
    honest = b.step(check, audit=True)  # measured, not bounded
    b.backward([torch.randn(1, hidden, generator=generator)], [torch.full((1, hidden), 9e5)])
    attack = b.step(check)
    verdict = attack.undone or "kept"
    return [optimizer, f"{honest.moved:.2e}", f"{attack.moved:.2e}", f"{verdict} ({attack.judged})"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)

    print(f"ffn expert, hidden {args.hidden}, on {device} ({torch.get_num_threads()} threads)")
    print("ms per optimizer step; +ms: what the check adds to a plain step")
    print(
        f"{'optimizer':<10}{'weights':>9}{'plain':>8}{'predicted':>11}{'+ms':>7}"
        f"{'full':>8}{'+ms':>7}{'steady':>8}{'+ms':>7}"
    )
    for optimizer in OPTIMIZERS:
        b = backend(args.hidden, optimizer, device)
        check = StepCheck(max_ratio=1.0)
        n = sum(p.numel() for p in b.module.parameters())
        time_steps(b, check, 2)  # creates the optimizer state and the shadow
        t = {mode: s * 1e3 for mode, s in time_steps(b, check, args.steps).items()}
        steady = t["predicted"] + (t["full"] - t["predicted"]) / FULL_CHECK_EVERY
        print(
            f"{optimizer:<10}{n / 1e6:>8.1f}M{t['plain']:>8.1f}{t['predicted']:>11.1f}"
            f"{t['predicted'] - t['plain']:>+7.1f}{t['full']:>8.1f}{t['full'] - t['plain']:>+7.1f}"
            f"{steady:>8.1f}{steady - t['plain']:>+7.1f}"
        )

    print()
    print(f"one step's ‖Δw‖/‖w‖ after {args.warmup} honest steps (lr 1e-3)")
    print("(9e5 attack: measured if fully checked, else the predicted bound)")
    print(f"{'optimizer':<10}{'honest':>10}{'9e5 attack':>12}  check")
    for optimizer in OPTIMIZERS:
        row = moved(args.hidden, optimizer, device, args.warmup)
        print(f"{row[0]:<10}{row[1]:>10}{row[2]:>12}  {row[3]}")


if __name__ == "__main__":
    main()
