"""Many experts of one architecture and size computed as one: their weights stacked
along a new first dimension and the module mapped over it with ``torch.func.vmap``, so
each layer is one batched matrix product for all of them instead of one small product
(and one kernel launch) per expert.

On a GPU a small batch costs its launches, not its arithmetic: on an H200 the forward
and backward of 8 ``ffn`` experts at 16-64 rows each took 5-6 ms one by one and 2.6-3.1
ms stacked, 32 experts 20-24 ms against 6-7 ms (``benchmarks/stacked.py``,
docs/benchmarks.md). On a CPU stacking costs more than it saves (the weights are copied
for every call), so the runtime stacks only on GPUs unless told otherwise
(``runtime.stack_experts``).

Each *entry* is one expert's batch: the weights to compute with (the live parameters,
or the snapshot a kept forward saw), its inputs, and for a backward the gradients of its
outputs. Entries of different sizes are padded with zero rows to the largest of their
stack; in a backward the padding's output gradients are zero, so it adds nothing to any
weight's gradient (back-propagation is linear in them). Entries are sorted by rows and
cut into stacks that copy at most ``max_stack_bytes`` of weights and pad only small
batches (``SMALL_ROWS``) freely, larger ones by at most a third of their rows, so one
large batch is not padded with many small ones; a stack of fewer than ``min_stack``
entries is computed one by one.

Nothing here changes an expert: a backward returns the gradients, and the caller adds
them where they belong.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, vmap

__all__ = ["StackEntry", "Stacker"]

Params = Mapping[str, torch.Tensor]

# Batches up to this many rows are padded freely (a GPU computes them in the time it
# takes to launch the work); larger ones only while padding adds at most a third.
SMALL_ROWS = 64


@dataclass(frozen=True, slots=True)
class StackEntry:
    """One expert's batch: ``params`` by name, ``inputs`` [B, ...] (one tensor), and for
    a backward ``grad_output`` of the same shape as the output."""

    params: Params
    inputs: torch.Tensor
    grad_output: torch.Tensor | None = None


class Stacker:
    """Computes entries of experts built like ``module`` (any one of them: only its
    structure is used, on the meta device)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        min_stack: int = 2,
        max_stack: int = 64,
        max_stack_bytes: int = 512 << 20,
    ):
        # Fewer entries than ``min_stack`` are computed one by one: stacking a few costs
        # more than it saves (on the H200, 2 experts stacked took 1.4x as long).
        self.min_stack = max(2, min_stack)
        self._skeleton = copy.deepcopy(module).to("meta")
        self._names = [name for name, _ in module.named_parameters()]
        self._weight_bytes = sum(p.numel() * 4 for p in module.parameters())
        self._max_stack = max(1, min(max_stack, max_stack_bytes // max(1, self._weight_bytes)))
        self._mapped: Callable[..., torch.Tensor] = vmap(self._call)

    def _call(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(self._skeleton, dict(params), (x,))
        return out

    def stacks(self, entries: Sequence[StackEntry]) -> list[list[int]]:
        """The entries' indices cut into stacks, largest batches first."""
        order = sorted(range(len(entries)), key=lambda i: -int(entries[i].inputs.shape[0]))
        stacks: list[list[int]] = []
        rows = 0
        for i in order:
            n = int(entries[i].inputs.shape[0])
            if stacks:
                stack = stacks[-1]
                widest = int(entries[stack[0]].inputs.shape[0])
                padding_is_cheap = widest <= SMALL_ROWS or 3 * widest * (len(stack) + 1) <= 4 * (
                    rows + n
                )
                if len(stack) < self._max_stack and padding_is_cheap:
                    stack.append(i)
                    rows += n
                    continue
            stacks.append([i])
            rows = n
        return stacks

    def alone(self, entries: Sequence[StackEntry]) -> list[int]:
        """The entries that would be computed one by one (in stacks under ``min_stack``)."""
        return [i for stack in self.stacks(entries) if len(stack) < self.min_stack for i in stack]

    def _groups(self, entries: Sequence[StackEntry]) -> list[list[int]]:
        """What each computation takes: a stack, or one entry of a stack too small."""
        groups: list[list[int]] = []
        for stack in self.stacks(entries):
            groups.extend([stack] if len(stack) >= self.min_stack else [[i] for i in stack])
        return groups

    def forward(self, entries: Sequence[StackEntry]) -> list[torch.Tensor]:
        """Each entry's output, computed without autograd."""
        outputs: list[torch.Tensor | None] = [None] * len(entries)
        with torch.no_grad():
            for stack in self._groups(entries):
                params, x, sizes = self._stack([entries[i] for i in stack])
                out = self._run(params, x, len(stack))
                for i, piece in zip(stack, _unstack(out, sizes), strict=True):
                    outputs[i] = piece
        return [o for o in outputs if o is not None]

    def backward(
        self, entries: Sequence[StackEntry]
    ) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Each entry's input gradient and weight gradients (by name), from a forward
        recomputed on the entry's weights."""
        results: list[tuple[torch.Tensor, dict[str, torch.Tensor]] | None] = [None] * len(entries)
        for stack in self._groups(entries):
            chosen = [entries[i] for i in stack]
            params, x, sizes = self._stack(chosen)
            grad = _joined([e.grad_output for e in chosen], sizes)
            with torch.enable_grad():
                leaves = [x, *params.values()]
                for leaf in leaves:
                    leaf.requires_grad_()
                grads = torch.autograd.grad(self._run(params, x, len(stack)), leaves, grad)
            dxs = _unstack(grads[0], sizes)
            per_name = {
                n: _unstack(g, sizes, rows=False) for n, g in zip(params, grads[1:], strict=True)
            }
            for k, i in enumerate(stack):
                results[i] = (dxs[k], {n: g[k] for n, g in per_name.items()})
        return [r for r in results if r is not None]

    def _stack(
        self, chosen: Sequence[StackEntry]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
        """The weights and inputs of ``chosen`` as one computation takes them: as they
        are for one entry, stacked (inputs padded) for several."""
        sizes = [int(e.inputs.shape[0]) for e in chosen]
        if len(chosen) == 1:
            params = {n: chosen[0].params[n].detach() for n in self._names}
        else:
            params = {n: torch.stack([e.params[n].detach() for e in chosen]) for n in self._names}
        return params, _joined([e.inputs for e in chosen], sizes), sizes

    def _run(self, params: dict[str, torch.Tensor], x: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` entries' outputs: mapped over the stack, or one entry's as it is."""
        return self._mapped(params, x) if n > 1 else self._call(params, x)


def _joined(tensors: Sequence[torch.Tensor | None], sizes: Sequence[int]) -> torch.Tensor:
    """One entry's tensor as it is; several as [len, max(sizes), ...], each one's rows
    then zero rows (a missing tensor: all zeros)."""
    first = next(t for t in tensors if t is not None)
    if len(tensors) == 1:
        return first.detach()
    out = first.new_zeros((len(tensors), max(sizes), *first.shape[1:]))
    for k, t in enumerate(tensors):
        if t is not None:
            out[k, : sizes[k]] = t
    return out


def _unstack(t: torch.Tensor, sizes: Sequence[int], *, rows: bool = True) -> list[torch.Tensor]:
    """Each entry's part of ``t`` (its own rows of a stacked result, padding dropped, if
    ``rows``): ``t`` itself when one entry was computed as it is."""
    if len(sizes) == 1:
        return [t]
    return [t[k, :n] if rows else t[k] for k, n in enumerate(sizes)]
