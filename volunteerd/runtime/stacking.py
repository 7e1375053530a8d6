"""Experts of one architecture and size computed as one call per job, where that pays
(``runtime.stack_experts``; by default on GPUs only, see ``experts.stacked``).

When a job of the device's batcher holds batches of one kind for several such experts
(``batching.Together``), this module runs them stacked: forwards in one stacked
forward, backwards in one stacked forward and backward. What each expert keeps and
counts is as if its batch had run alone, with one difference: a kept forward computed
stacked keeps no graph (its inputs and the weights it saw), and its backward recomputes
the forward, stacked again when other experts' backwards come in the same job. A
backward's weight gradients are added to its expert's own, its senders and staleness
noted, as the batch's own compute function does.

A broken expert's batch is refused (``Busy``) without holding back the others. A
backward batch holding a kept forward that has its graph runs on its own lane's compute
function, after the stacked ones. Nothing changes before the stacked call has
succeeded: if it raises, the batcher runs every batch alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from volunteerd.experts import ExpertBackend
from volunteerd.experts.stacked import StackEntry, Stacker
from volunteerd.runtime.batching import Lane, Together, batch_failed
from volunteerd.runtime.guard import Sender
from volunteerd.runtime.retained import StalenessMeter

if TYPE_CHECKING:
    from volunteerd.config import RuntimeConfig

__all__ = [
    "AUTO_MIN_STACK",
    "Kind",
    "Member",
    "Stacking",
    "cat_rows",
    "split_rows",
    "stacks_on",
]


Tensors = list[torch.Tensor]
Kind = Literal["forward", "backward", "forward-retained", "backward-retained"]
Answer = list[Any] | Exception


def cat_rows(columns: list[Tensors]) -> Tensors:
    """Requests' tensors joined row-wise, tensor by tensor."""
    return [c[0] if len(c) == 1 else torch.cat(c) for c in zip(*columns, strict=True)]


def split_rows(outputs: Tensors, sizes: list[int]) -> list[Tensors]:
    """``cat_rows`` undone: each request's rows of every tensor."""
    if len(sizes) == 1:
        return [outputs]
    pieces = [o.split(sizes) for o in outputs]
    return [[p[i] for p in pieces] for i in range(len(sizes))]


# With "auto", experts stack from this many on (on the H200 one by one cost ~0.65 ms
# per expert, stacked ~1.9 ms + ~0.14 ms per expert: even at ~4); "always" stacks two.
AUTO_MIN_STACK = 4


def stacks_on(config: RuntimeConfig, device: torch.device) -> int:
    """From how many experts a runtime on ``device`` stacks them (0: never)."""
    if config.stack_experts == "auto":
        return AUTO_MIN_STACK if device.type == "cuda" else 0
    return 2 if config.stack_experts == "always" else 0


class Member(Protocol):
    """What stacking needs of a hosted expert (``service._Hosted``)."""

    backend: ExpertBackend
    staleness: StalenessMeter
    compute_s: float
    forward_retained: Lane[Any, Any]
    backward_retained: Lane[Any, Any]

    def refuse_if_broken(self) -> None: ...

    def heard(self, senders: Iterable[Sender]) -> None: ...


class Stacking:
    """The ``Together`` of each lane of hosted experts, and the stacked calls."""

    def __init__(self, min_stack: int = 2) -> None:
        self.min_stack = min_stack
        self._stackers: dict[Hashable, Stacker] = {}
        self.calls = 0  # stacked calls made (several experts' batches each)
        self.batches = 0  # batches those calls answered

    def together(self, member: Member, kind: Kind) -> Together | None:
        backend = member.backend
        if backend.config.type != "ffn":  # one input, one output, rows independent
            return None
        shape = (backend.config.type, backend.config.hidden_dim)
        if shape not in self._stackers:
            self._stackers[shape] = Stacker(backend.module, min_stack=self.min_stack)
        stacker = self._stackers[shape]
        run = _RUNS[kind]

        def counted(batches: list[tuple[Any, list[Any]]]) -> list[Answer]:
            answers = run(stacker, batches)
            self.calls += 1
            self.batches += len(batches)
            return answers

        return Together((kind, shape), member, counted)


def _charge(members: Sequence[Member], rows: Sequence[int], seconds: float) -> None:
    """A stacked call's time, shared out as compute time by rows."""
    total = sum(rows) or 1
    for member, n in zip(members, rows, strict=True):
        member.compute_s += seconds * n / total


def _admitted(batches: list[tuple[Any, list[Any]]], answers: list[Answer]) -> Iterator[int]:
    """The batches whose expert can compute (the others are answered Busy)."""
    for b, (member, _) in enumerate(batches):
        try:
            member.refuse_if_broken()
        except Exception as exc:
            answers[b] = exc
            continue
        yield b


def _forward(stacker: Stacker, batches: list[tuple[Any, list[Any]]]) -> list[Answer]:
    answers: list[Answer] = [[] for _ in batches]
    chosen, entries, sizes = [], [], []
    for b in _admitted(batches, answers):
        member, items = batches[b]
        chosen.append(b)
        sizes.append([t[0].shape[0] for t in items])
        backend = member.backend
        entries.append(StackEntry(backend.live_params(), backend.wide_input(cat_rows(items))))
    start = time.perf_counter()
    outputs = stacker.forward(entries)
    for b, rows, out in zip(chosen, sizes, outputs, strict=True):
        answers[b] = split_rows([batches[b][0].backend.narrow(out)], rows)
    _charge([batches[b][0] for b in chosen], [sum(r) for r in sizes], time.perf_counter() - start)
    return answers


def _forward_retained(stacker: Stacker, batches: list[tuple[Any, list[Any]]]) -> list[Answer]:
    answers: list[Answer] = [[] for _ in batches]
    admitted = list(_admitted(batches, answers))
    inputs = {b: batches[b][0].backend.wide_input(cat_rows(batches[b][1])) for b in admitted}
    # A batch that would be computed alone (too large to pad others up to, or in a stack
    # too small to pay) keeps its graph instead, on its own lane: stacked, its backward
    # would recompute it for nothing.
    alone = [admitted[i] for i in stacker.alone([StackEntry({}, inputs[b]) for b in admitted])]
    chosen = [b for b in admitted if b not in alone]
    entries, versions, snapshots = [], [], []
    for b in chosen:
        backend = batches[b][0].backend
        versions.append(backend.updates)  # on the worker: no step runs meanwhile
        snapshots.append(backend.snapshot())
        entries.append(StackEntry(snapshots[-1].params, inputs[b]))
    start = time.perf_counter()
    outputs = stacker.forward(entries)
    for b, version, weights, entry, out in zip(
        chosen, versions, snapshots, entries, outputs, strict=True
    ):
        rows = [t[0].shape[0] for t in batches[b][1]]
        kept = batches[b][0].backend.keep_stacked(weights, rows, entry.inputs, out)
        answers[b] = [(*k, version) for k in kept]
    rows_of = [int(inputs[b].shape[0]) for b in chosen]
    _charge([batches[b][0] for b in chosen], rows_of, time.perf_counter() - start)
    _each_alone(batches, alone, answers, lambda member: member.forward_retained)
    return answers


def _backward(stacker: Stacker, batches: list[tuple[Any, list[Any]]]) -> list[Answer]:
    answers: list[Answer] = [[] for _ in batches]
    chosen, entries, sizes = [], [], []
    for b in _admitted(batches, answers):
        member, items = batches[b]
        backend = member.backend
        joined = cat_rows([tensors for tensors, _ in items])
        chosen.append(b)
        sizes.append([t[0].shape[0] for t, _ in items])
        x, g = backend.wide_input(joined[:1]), backend.wide_input(joined[1:])
        entries.append(StackEntry(backend.live_params(), x, g))
    start = time.perf_counter()
    results = stacker.backward(entries)
    for b, rows, (dx, grads) in zip(chosen, sizes, results, strict=True):
        member, items = batches[b]
        member.backend.add_gradients(grads)
        member.heard(sender for _, sender in items)
        member.staleness.record_stateless(len(items))
        answers[b] = split_rows([member.backend.narrow(dx)], rows)
    _charge([batches[b][0] for b in chosen], [sum(r) for r in sizes], time.perf_counter() - start)
    return answers


def _backward_retained(stacker: Stacker, batches: list[tuple[Any, list[Any]]]) -> list[Answer]:
    answers: list[Answer] = [[] for _ in batches]
    chosen, alone, entries, owners = [], [], [], []
    for b in _admitted(batches, answers):
        member, items = batches[b]
        if not all(kept.stacked and not kept.consumed for kept, _, _, _ in items):
            alone.append(b)  # a kept graph goes back through itself
            continue
        chosen.append(b)
        for i, (kept, grads, _, _) in enumerate(items):
            owners.append((b, i))
            g = member.backend.wide_input(grads)
            entries.append(StackEntry(kept.weights.params, kept.leaves[0], g))
    start = time.perf_counter()
    results = stacker.backward(entries)
    seconds = time.perf_counter() - start
    for b in chosen:
        answers[b] = [None] * len(batches[b][1])
    for (b, i), (dx, grads) in zip(owners, results, strict=True):
        member, items = batches[b]
        kept, _, sender, version = items[i]
        backend = member.backend
        backend.add_gradients(grads)
        backend.finish_stacked(kept)
        member.heard([sender])
        # the next step (updates + 1) applies them: staleness = updates since the forward
        member.staleness.record(backend.updates - version)
        answers[b][i] = [backend.narrow(dx)]  # type: ignore[index]
    rows = [sum(int(k.leaves[0].shape[0]) for k, _, _, _ in batches[b][1]) for b in chosen]
    _charge([batches[b][0] for b in chosen], rows, seconds)
    _each_alone(batches, alone, answers, lambda member: member.backward_retained)
    return answers


def _each_alone(
    batches: list[tuple[Any, list[Any]]],
    alone: list[int],
    answers: list[Answer],
    lane_of: Callable[[Member], Lane[Any, Any]],
) -> None:
    """The ``alone`` batches on their own lanes' compute (after the stacked call)."""
    for b in alone:
        member, items = batches[b]
        lane = lane_of(member)
        try:
            answers[b] = lane.compute(items)
        except Exception as exc:  # its own failure, as the batcher would have it
            batch_failed(lane.name, exc)
            answers[b] = exc


_RUNS: dict[Kind, Callable[[Stacker, list[tuple[Any, list[Any]]]], list[Answer]]] = {
    "forward": _forward,
    "forward-retained": _forward_retained,
    "backward": _backward,
    "backward-retained": _backward_retained,
}
