"""Would merging requests *across* experts pay on this machine? Experts of one type and
size, one batch each, computed one by one (what the daemon does) or as one stacked
batch: their weights stacked along a new first dimension and the expert's own module
mapped over it with ``torch.func.vmap``, so each layer becomes one batched matrix
product for all of them.

Per configuration (``--experts`` x ``--batch`` samples, ``ffn`` of ``--hidden``), the
median time of a forward and backward over all the experts (input and weight
gradients; gradients set to None after each round):

* one by one: each expert's own forward and backward, as the runtime runs a job;
* stacked: the weights stacked for each round (a copy of every expert's weights, and
  their gradients unstacked by autograd), as a daemon would have to with experts that
  live apart;
* stacked, weights already stacked: the weights kept in one tensor per parameter (no
  copy; gradients returned by ``torch.autograd.grad``), the bound of the idea: experts
  stored together from the start.

The three take turns within each configuration, so they see the same load; this
machine's speed drifts (±15 %) between runs, not within one. Run::

    .venv/bin/python benchmarks/stacked.py
    .venv/bin/python benchmarks/stacked.py --threads 1 --experts 2,4,8 --batch 16,64
    python benchmarks/stacked.py --device cuda --experts 2,8,32 --batch 16,64,256
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from arguments import int_list
from torch import nn
from torch.func import functional_call, vmap

from volunteerd.experts.layers import FeedForwardExpert
from volunteerd.malloc import reuse_freed_memory


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int_list, default=[2, 4], help="comma-separated list")
    p.add_argument("--batch", type=int_list, default=[16, 64, 128], help="samples per expert")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seconds", type=float, default=1.0, help="timing per method and turn")
    p.add_argument("--turns", type=int, default=3, help="turns of the three methods")
    p.add_argument("--device", default="cpu", help='where the experts run, e.g. "cuda"')
    return p.parse_args(argv)


def _seconds_per_round(fn: Callable[[], None], seconds: float, device: torch.device) -> float:
    def settle() -> None:  # a GPU's kernels run after the call returns: wait for them
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    settle()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        done += 1
    settle()
    return (time.perf_counter() - start) / done


def measure(
    hidden: int,
    n_experts: int,
    batch: int,
    seconds: float,
    turns: int,
    device: torch.device,
) -> list[float]:
    """Median ms per round of: one by one, stacked per round, already stacked."""
    torch.manual_seed(0)
    experts = [FeedForwardExpert(hidden).to(device) for _ in range(n_experts)]
    inputs = [torch.randn(batch, hidden, device=device) for _ in experts]
    grads = [torch.randn(batch, hidden, device=device) for _ in experts]
    skeleton = copy.deepcopy(experts[0]).to("meta")
    names = [name for name, _ in experts[0].named_parameters()]

    def call(params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(skeleton, dict(params), (x,))
        return out

    mapped = vmap(call)
    stacked_inputs, stacked_grads = torch.stack(inputs), torch.stack(grads)
    kept = {
        name: nn.Parameter(torch.stack([dict(e.named_parameters())[name] for e in experts]))
        for name in names
    }

    def clear() -> None:
        for expert in experts:
            for param in expert.parameters():
                param.grad = None

    def one_by_one() -> None:
        for expert, x, g in zip(experts, inputs, grads, strict=True):
            expert(x.detach().requires_grad_()).backward(g)
        clear()

    def stacked() -> None:
        params = {n: torch.stack([dict(e.named_parameters())[n] for e in experts]) for n in names}
        mapped(params, stacked_inputs.detach().requires_grad_()).backward(stacked_grads)
        clear()

    def already_stacked() -> None:
        # autograd.grad, not backward: accumulating into the stacked leaves' .grad
        # measured ~50 % slower still, and a stacked store would hand out the slices.
        x = stacked_inputs.detach().requires_grad_()
        torch.autograd.grad(mapped(kept, x), [x, *kept.values()], stacked_grads)

    methods = [one_by_one, stacked, already_stacked]
    times: list[list[float]] = [[] for _ in methods]
    for _ in range(turns):
        for method, out in zip(methods, times, strict=True):
            out.append(_seconds_per_round(method, seconds, device) * 1000)
    return [statistics.median(t) for t in times]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    reuse_freed_memory()  # as the daemon does: freed gradients reused, not faulted in anew
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"ffn hidden {args.hidden} on {device}, forward + backward of every expert, "
        f"{torch.get_num_threads()} torch threads; median ms per round of {args.turns} turns"
    )
    header = f"{'experts':>8}{'batch':>7}{'one by one':>12}{'stacked':>10}{'kept stacked':>14}"
    print(header + f"{'stacked / one by one':>22}{'kept / one by one':>19}")
    for n_experts in args.experts:
        for batch in args.batch:
            single, stacked, kept = measure(
                args.hidden, n_experts, batch, args.seconds, args.turns, device
            )
            print(
                f"{n_experts:>8}{batch:>7}{single:>12.2f}{stacked:>10.2f}{kept:>14.2f}"
                f"{stacked / single:>22.2f}{kept / single:>19.2f}"
            )
    print("below 1.00: the stacked form is faster than the daemon's one-by-one batches")


if __name__ == "__main__":
    main()
