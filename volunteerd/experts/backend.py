"""ExpertBackend: one expert's module, its own optimizer, and the compute calls.

Two ways to train, both answering "here are the gradients of your outputs":

* stateless (Learning@home): ``backward`` gets the inputs again with the output
  gradients, re-runs the forward with autograd on, returns the input gradients and
  steps the optimizer. Nothing is kept between requests.
* retained: ``forward_retained`` runs the forward with autograd on and keeps the
  graph; ``backward_retained`` later back-propagates through it. This saves the second
  forward (a quarter of the work) and the trainer need not send the inputs again. An
  optimizer step taken in between (another trainer's backward) copies the weights on
  write, so the kept graph stays valid and the gradient is that of the function the
  trainer saw; without such interleaving nothing is copied.

Both backwards return the input gradients and leave the parameter gradients accumulated;
``step`` applies them. The runtime answers a backward first and steps right after, so
the optimizer's work is off the trainer's critical path. These methods block and must
run on the device's worker thread, never on the event loop.

With a ``StepCheck`` a step that would make a weight or an optimizer state non-finite,
or move the weights by more than a bound relative to their norm, is refused before it
is applied (its bounds already show it) or undone after: weights, optimizer state and
the update count are exactly what they were before it.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from volunteerd.config import ExpertsConfig, OptimizerConfig
from volunteerd.errors import BadShape, ConfigError
from volunteerd.experts.checkpoint_file import MAX_UPDATES, CheckpointError, ExpertState
from volunteerd.experts.registry import build_module, schemas_for
from volunteerd.experts.stepcheck import StepCheck, StepMemo, StepOutcome
from volunteerd.experts.tensor_codec import TORCH_DTYPES
from volunteerd.wire import ExpertInfo

# torch's autograd runs a CUDA backward on a thread of its own, which has no current
# CUDA context until cuBLAS makes the device's primary context current there; torch says
# so once per process with a UserWarning (seen on an H200 with torch 2.11). Nothing is
# wrong, and a volunteer's log need not say otherwise.
warnings.filterwarnings(
    "ignore",
    message="Attempting to run cuBLAS, but there was no current CUDA context",
    category=UserWarning,
)

__all__ = [
    "ExpertBackend",
    "Retained",
    "StepCheck",
    "StepMemo",
    "StepOutcome",
    "WeightsSnapshot",
    "make_optimizer",
]


@dataclass(frozen=True, slots=True)
class _Keys:
    whole: frozenset[str]  # what the optimizer keeps per parameter once it stepped
    partial: bool  # whether a subset is fine (missing buffers start afresh)


# Per parameter: Adam needs all three or nothing (it creates them together); SGD's
# momentum buffer may be missing (no momentum, or not created yet).
_OPTIMIZER_KEYS = {
    "adam": _Keys(frozenset({"step", "exp_avg", "exp_avg_sq"}), partial=False),
    "sgd": _Keys(frozenset({"momentum_buffer"}), partial=True),
}
# A running mean of squares: a negative one makes Adam's step the square root of one.
_NOT_NEGATIVE = frozenset({"exp_avg_sq"})
# The dtypes of an optimizer's step count (torch's ``_get_scalar_dtype``: float32, or
# float64 under a float64 default dtype); its other buffers are their parameter's dtype.
_STEP_DTYPES = (torch.float32, torch.float64)


def make_optimizer(
    params: Sequence[nn.Parameter], config: OptimizerConfig
) -> torch.optim.Optimizer:
    """The configured optimizer, fused where torch has a fused kernel for the device.

    An expert steps after every backward request, so the step is on the hot path: on a
    CPU the fused Adam is ~5x faster than the default (5.6 vs 27 ms for 2.1M weights)."""
    params = list(params)
    error: Exception | None = None
    for fused in (True, None):
        kwargs = {"fused": True} if fused else {}
        try:
            if config.name == "sgd":
                return torch.optim.SGD(
                    params,
                    lr=config.lr,
                    momentum=config.momentum,
                    weight_decay=config.weight_decay,
                    **kwargs,
                )
            return torch.optim.Adam(
                params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, **kwargs
            )
        except (RuntimeError, ValueError, TypeError) as exc:
            error = exc  # no fused kernel for this device or dtype, or a bad setting
    raise ConfigError(f"experts.optimizer: {error}")


@dataclass(eq=False, slots=True)
class WeightsSnapshot:
    """The weights one generation of kept forwards was computed with.

    ``params`` are aliases of the expert's parameters (same storage, a version counter
    of their own). While no optimizer step happens they *are* the live weights; a step
    taken while kept forwards still need them first moves the live parameters to fresh
    storage (copy on write), leaving the old values to the aliases."""

    params: dict[str, torch.Tensor]
    nbytes: int
    pending: int = 0  # kept forwards of this generation not yet back-propagated


@dataclass(eq=False, slots=True)
class KeptGraph:
    """The graph of several requests' forwards merged into one batch: their inputs
    joined (``leaves``), the joined ``output`` with its graph, and each request's rows
    (``sizes``, in order). While every request still waits for its backward the graph
    can take them all in one backward; once one has gone alone (or was dropped), the
    graph is released and the rest are recomputed from their inputs on the same
    weights."""

    leaves: list[torch.Tensor]
    output: torch.Tensor | None
    sizes: list[int]

    def release(self) -> None:
        self.output = None


@dataclass(eq=False, slots=True)
class Retained:
    """A forward pass kept for its backward: inputs, output, weights. Alone, ``leaves``
    and ``output`` are the graph's own; as a piece of a merged forward (``graph``, its
    rows the ``index``-th of ``graph.sizes``) they are detached views of its rows. A
    forward computed stacked with other experts' (``stacked``) keeps no graph: its
    backward recomputes it from ``leaves`` on ``weights``."""

    leaves: list[torch.Tensor]
    output: torch.Tensor
    weights: WeightsSnapshot
    nbytes: int  # activations saved for backward (its share), weights not included
    consumed: bool = False
    graph: KeptGraph | None = None
    index: int = 0
    stacked: bool = False

    def __del__(self) -> None:
        # Dropped unused (expired, evicted): its generation no longer needs protecting,
        # and its merged graph can no longer take all its requests at once.
        if not self.consumed:
            self.weights.pending -= 1
            if self.graph is not None:
                self.graph.release()


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on the same storage with a version counter of its own (detach() would
    share the counter, and the optimizer's in-place step would then invalidate graphs
    that copy-on-write has already protected)."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
    return alias.requires_grad_()


# Input bytes per piece of a forward or stateless backward (ExpertBackend._pieces).
CHUNK_BYTES = 32 << 20


def _check_gradient_shapes(
    outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor]
) -> None:
    """Raise BadShape (the peer's error) rather than autograd's RuntimeError (an
    internal one) when gradients do not fit the outputs they are for. The runtime
    checks the shapes before queueing; this holds for any module."""
    got = [tuple(g.shape) for g in grad_outputs]
    made = [tuple(o.shape) for o in outputs]
    if got != made:
        raise BadShape(f"output gradients of shapes {got} for outputs of shapes {made}")


class ExpertBackend:
    """A hosted expert. Parameters are float32 on ``device``; the wire dtype may be
    narrower (inputs are widened for compute and outputs narrowed back)."""

    def __init__(
        self, uid: str, config: ExpertsConfig, device: torch.device, max_batch_size: int
    ) -> None:
        self.uid = uid
        self.device = device
        self.config = config  # what it was built from: its seeded weights, if ever needed
        self.module = build_module(config, uid).to(device)
        self.optimizer = make_optimizer(list(self.module.parameters()), config.optimizer)
        self.wire_dtype = TORCH_DTYPES[config.dtype]
        inputs, outputs = schemas_for(config)
        self.info = ExpertInfo(
            uid=uid,
            expert_type=config.type,
            hidden_dim=config.hidden_dim,
            inputs=inputs,
            outputs=outputs,
            max_batch_size=max_batch_size,
        )
        self.updates = 0
        # Whose expert this is (ExpertState.experiment): a project's joiner sets it
        self.experiment = ""
        # Counts writes to the weights other than optimizer steps (a loaded checkpoint,
        # a replica average): (updates, revision) changes whenever the weights do.
        self.revision = 0
        # Every write to the weights, optimizer steps included (kept, refused or undone
        # alike: counting one too many only costs a replica a fetch), after a random
        # name of this backend: ``weights_version`` changes whenever the weights may
        # have, and a backend built again under the same uid (a restart, a joiner's
        # new copy) never repeats an old one. (updates, revision) stops at MAX_UPDATES
        # and does not see a step that broke the weights before the checkpoint put
        # them back.
        self._writes = 0
        self._weights_name = secrets.token_hex(8)
        # the count goes out keyed: a token tells a replica "changed or not", never how
        # many steps this expert took (refused and undone ones too) since it started
        self._weights_key = secrets.token_bytes(16)
        self.optimizer_name = config.optimizer.name
        self._snapshot: WeightsSnapshot | None = None
        # Backwards of merged kept forwards: through their graph together, or recomputed
        self.kept_together = 0
        self.kept_recomputed = 0
        self._step_memo = StepMemo()  # valid while (updates, revision) says so

    def _leaves(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [x.detach().to(self.device, torch.float32).requires_grad_() for x in inputs]

    def _pieces(self, inputs: Sequence[torch.Tensor]) -> list[slice]:
        """The rows of a batch in pieces of at most ``CHUNK_BYTES`` of (float32) input
        each: rows are independent, and a transformer block's activations are ~14
        times its input (one 256 MiB request peaked at ~3.7 GB, several merged at
        more). Batches of ordinary size are one piece."""
        rows = int(inputs[0].shape[0]) if inputs else 0
        per_row = sum(x[0].numel() for x in inputs) * 4 if rows else 0
        step = max(1, CHUNK_BYTES // per_row) if per_row else max(rows, 1)
        return [slice(start, start + step) for start in range(0, rows, step)] or [slice(0, 0)]

    def forward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.inference_mode():
            outs = [
                self.module(*(x[rows].to(self.device, torch.float32) for x in inputs)).to(
                    self.wire_dtype
                )
                for rows in self._pieces(inputs)
            ]
            return [outs[0] if len(outs) == 1 else torch.cat(outs)]

    def backward(
        self, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Stateless: re-run the forward and return the input gradients. The parameter
        gradients accumulate until ``step``. A large batch goes through in pieces
        (``_pieces``), each piece's graph freed before the next."""
        leaves = self._leaves(inputs)
        if any(g.shape[:1] != leaves[0].shape[:1] for g in grad_outputs):
            _check_gradient_shapes([leaves[0]], grad_outputs)  # raises: not row for row
        with torch.enable_grad():
            for rows in self._pieces(leaves):
                out = self.module(*(leaf[rows] for leaf in leaves))
                grads = [g[rows] for g in grad_outputs]
                _check_gradient_shapes([out], grads)
                torch.autograd.backward([out], [self._wide(g) for g in grads])
        return self._input_grads(leaves)

    def forward_retained(
        self, inputs: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], Retained]:
        """Forward with autograd on, on this generation's weights; keep the graph."""
        [kept] = self.forward_retained_many([inputs])
        return kept

    def forward_retained_many(
        self, items: Sequence[Sequence[torch.Tensor]]
    ) -> list[tuple[list[torch.Tensor], Retained]]:
        """Forwards of several requests with autograd on, merged into one batch on this
        generation's weights; one kept graph for all (``KeptGraph``), a ``Retained``
        piece for each request."""
        weights = self._weights()
        weight_ptrs = {p.untyped_storage().data_ptr() for p in weights.params.values()}
        # Every storage the kept graph holds, each once (a tensor saved by two nodes
        # costs once): what the retained-activation budget must see.
        held: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weight_ptrs:
                held[storage.data_ptr()] = storage.nbytes()
            return t

        sizes = [int(item[0].shape[0]) for item in items]
        joined = [x[0] if len(items) == 1 else torch.cat(x) for x in zip(*items, strict=True)]
        leaves = self._leaves(joined)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = functional_call(self.module, weights.params, tuple(leaves))
        for kept in (out, *leaves):
            held[kept.untyped_storage().data_ptr()] = kept.untyped_storage().nbytes()
        weights.pending += len(items)
        saved = sum(held.values())
        wire = out.detach().to(self.wire_dtype)
        if len(items) == 1:
            return [([wire], Retained(leaves, out, weights, saved))]
        graph = KeptGraph(leaves, out, sizes)
        total = sum(sizes)
        out_rows = wire.split(sizes)
        detached = out.detach().split(sizes)
        rows = [leaf.detach().split(sizes) for leaf in leaves]
        return [
            (
                [out_rows[i]],
                Retained(
                    [r[i] for r in rows],
                    detached[i],
                    weights,
                    -(-saved * size // total),
                    graph=graph,
                    index=i,
                ),
            )
            for i, size in enumerate(sizes)
        ]

    def backward_retained(
        self, items: Sequence[tuple[Retained, Sequence[torch.Tensor]]]
    ) -> list[list[torch.Tensor]]:
        """Back-propagate each retained forward; parameter gradients accumulate until
        ``step``. The pieces of a merged forward that all come in one call go back
        through their graph together; others are recomputed from their inputs on the
        weights their forward saw."""
        results: list[list[torch.Tensor]] = [[] for _ in items]
        graphs: dict[int, tuple[KeptGraph, list[int]]] = {}
        for i, (retained, grad_outputs) in enumerate(items):
            if retained.stacked:
                self.kept_recomputed += 1
                results[i] = self._recompute(retained, grad_outputs)
                self._consume(retained)
            elif retained.graph is None:
                self._backprop(retained.weights, [retained.output], grad_outputs)
                results[i] = self._input_grads(retained.leaves)
                self._consume(retained)
            else:
                graphs.setdefault(id(retained.graph), (retained.graph, []))[1].append(i)
        for graph, indices in graphs.values():
            pieces = {items[i][0].index: i for i in indices}
            output = graph.output  # None once released
            whole = output is not None and sorted(pieces) == list(range(len(graph.sizes)))
            if whole and output is not None:
                self.kept_together += len(indices)
                order = [pieces[k] for k in range(len(graph.sizes))]
                joined = [
                    torch.cat([self._wide(items[i][1][n]) for i in order])
                    for n in range(len(items[order[0]][1]))
                ]
                self._backprop(items[order[0]][0].weights, [output], joined)
                split = [self._input_grads([leaf])[0].split(graph.sizes) for leaf in graph.leaves]
                for k, i in enumerate(order):
                    results[i] = [s[k] for s in split]
            graph.release()  # taken whole, or the others must be recomputed anyway
            for i in indices:
                retained, grad_outputs = items[i]
                if not whole:
                    self.kept_recomputed += 1
                    results[i] = self._recompute(retained, grad_outputs)
                self._consume(retained)
        return results

    def _recompute(
        self, retained: Retained, grad_outputs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Back-propagate a kept forward whose graph is gone: its forward again, from its
        inputs on the weights it saw."""
        leaves = self._leaves(retained.leaves)
        with torch.enable_grad():
            out = functional_call(self.module, retained.weights.params, tuple(leaves))
        self._backprop(retained.weights, [out], grad_outputs)
        return self._input_grads(leaves)

    # Stacked with other experts (``experts.stacked``): the runtime computes, these
    # keep what a kept forward needs and take the gradients.

    def live_params(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

    def wide_input(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The one input of a batch, on the device in float32 (stacked experts take one)."""
        [x] = inputs
        return x.detach().to(self.device, torch.float32)

    def keep_stacked(
        self, weights: WeightsSnapshot, sizes: Sequence[int], x: torch.Tensor, out: torch.Tensor
    ) -> list[tuple[list[torch.Tensor], Retained]]:
        """Kept forwards (``sizes`` rows each, joined in ``x``) computed stacked on
        ``weights`` (from ``snapshot``): per request its wire output and a ``Retained``
        without a graph (its backward recomputes the forward)."""
        rows = list(sizes)
        wire = out.to(self.wire_dtype).split(rows)
        kept = [
            ([w], Retained([x_rows], o, weights, (x_rows.numel() + o.numel()) * 4, stacked=True))
            for x_rows, o, w in zip(x.split(rows), out.split(rows), wire, strict=True)
        ]
        weights.pending += len(sizes)
        return kept

    def snapshot(self) -> WeightsSnapshot:
        """The weights the next kept forward computes with (this generation's)."""
        return self._weights()

    def add_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        """Add weight gradients computed elsewhere to the accumulated ones (taken
        without a copy when there are none yet, as after a step, and laid out as the
        weight is: the fused optimizers read a gradient in the weight's layout)."""
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                grad = grads[name]
                if param.grad is None and grad.stride() != param.stride():
                    grad = torch.empty_like(param).copy_(grad)
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad += grad

    def finish_stacked(self, retained: Retained) -> None:
        """A stacked kept forward's backward is done (its gradients added)."""
        self.kept_recomputed += 1
        self._consume(retained)

    def narrow(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.wire_dtype)

    def _backprop(
        self,
        weights: WeightsSnapshot,
        outputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor],
    ) -> None:
        """Back-propagate ``outputs`` (a graph on ``weights``' aliases) and add the
        parameter gradients to the live parameters' (None between steps: the first
        backward after a step hands its gradients over without a copy)."""
        live = dict(self.module.named_parameters())
        aliases = weights.params
        for name, alias in aliases.items():
            alias.grad = live[name].grad
        try:
            with torch.enable_grad():
                torch.autograd.backward(list(outputs), [self._wide(g) for g in grad_outputs])
            for name, alias in aliases.items():
                live[name].grad = alias.grad
        finally:
            for alias in aliases.values():
                alias.grad = None

    @staticmethod
    def _consume(retained: Retained) -> None:
        if not retained.consumed:
            retained.consumed = True
            retained.weights.pending -= 1

    def _weights(self) -> WeightsSnapshot:
        if self._snapshot is None:
            params = {name: _alias(p) for name, p in self.module.named_parameters()}
            nbytes = sum(p.numel() * p.element_size() for p in params.values())
            self._snapshot = WeightsSnapshot(params, nbytes)
        return self._snapshot

    def _wide(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, torch.float32)

    def _input_grads(self, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [
            (x.grad if x.grad is not None else torch.zeros_like(x)).to(self.wire_dtype)
            for x in leaves
        ]

    def step(self, check: StepCheck | None = None, *, audit: bool = False) -> StepOutcome:
        """Apply the accumulated gradients (one optimizer step) and clear them. With
        ``check``, a step that breaks the weights is refused or undone (the gradients
        are dropped and ``updates`` stays as it was); ``audit`` asks it for the full
        check."""
        self.begin_step()
        if check is None:
            self.optimizer.step()
            outcome = StepOutcome(None, math.nan, "unchecked")
        else:
            outcome = check.step(
                list(self.module.parameters()),
                self.optimizer,
                self._step_memo,
                version=(self.updates, self.revision),
                audit=audit,
            )
        self.end_step(outcome)
        return outcome

    def begin_step(self) -> None:
        """Before the optimizer writes the weights: kept forwards that still need the
        current values keep them (the live weights move to fresh storage: copy on
        write), and the next kept forward starts a new generation."""
        snapshot = self._snapshot
        if snapshot is not None and snapshot.pending > 0:
            with torch.no_grad():
                for p in self.module.parameters():
                    p.data = p.data.clone()
        self._snapshot = None

    def end_step(self, outcome: StepOutcome) -> None:
        """After the optimizer ran (or was refused): the gradients are cleared and a
        step that was kept is counted."""
        # None, not zeros: the next backward writes its gradients into fresh buffers
        # instead of adding to zeroed ones (one pass over the weights fewer per step).
        self.optimizer.zero_grad(set_to_none=True)
        self._writes += 1
        # The count stops at the most a checkpoint or a replica's state may say: a
        # replica's 2**53, taken as it was, made the next step's 2**53 + 1, which no save
        # and no download could carry any more (every save refused, the expert lost).
        if outcome.undone is None and self.updates < MAX_UPDATES:
            self.updates += 1

    # State for checkpoints and replicas. Like the compute calls, these run on the
    # device's worker thread inside the executor's turn: no step runs meanwhile.

    def state(self, *, moments: bool = True) -> ExpertState:
        """A copy (on the CPU) of the weights, the optimizer state and the update count;
        ``moments=False``: without the optimizer state (what a replica serves)."""
        optimizer_state = {
            int(index): {
                key: value.detach().to("cpu", copy=True)
                for key, value in entry.items()
                if isinstance(value, torch.Tensor)
            }
            for index, entry in (self.optimizer.state_dict()["state"] if moments else {}).items()
        }
        return ExpertState(
            uid=self.uid,
            expert_type=self.info.expert_type,
            hidden_dim=self.info.hidden_dim,
            optimizer=self.optimizer_name,
            updates=self.updates,
            params=self.parameter_copies(),
            optimizer_state=optimizer_state,
            experiment=self.experiment,
        )

    def largest_state_bytes(self) -> int:
        """More than a checkpoint of this expert ever takes: its weights and an optimizer
        state of at most three times their size (Adam's two moments), plus a MiB for the
        header and the step counts. A replica announcing more is refused before its
        bytes come (a 9 KB expert's replica had a joiner fetch and read 300 MiB)."""
        return 4 * self.weights_bytes() + (1 << 20)

    def weights_bytes(self) -> int:
        """The bytes of this expert's weights."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    def parameter_copies(self) -> dict[str, torch.Tensor]:
        """The weights by name, copied to the CPU."""
        return {name: p.detach().to("cpu", copy=True) for name, p in self.module.named_parameters()}

    def live_parameters(self) -> dict[str, torch.Tensor]:
        """The weights by name, not copied: read them only within the same turn."""
        return {name: p.detach() for name, p in self.module.named_parameters()}

    def check_state(self, state: ExpertState) -> None:
        """Raise CheckpointError unless ``state`` fits this expert (type, sizes, names,
        shapes, dtypes, finite values). Each tensor must have its parameter's own dtype
        (a step count: float32 or float64): a value finite in float64 can be an
        infinity in a float32 weight or moment, so nothing is converted."""
        if state.experiment and state.experiment != self.experiment:
            # Another project's expert of the same name, type and width (checkpoints are
            # kept by uid): a volunteer who left one project and joined another started
            # the new one's experts from the old one's weights, and replica averaging
            # carried them into its swarm. A state of no experiment (written before it
            # was kept) is still taken.
            raise CheckpointError(
                f"the state of {state.experiment or 'no project'}'s {state.uid}, this "
                f"expert is {self.experiment or 'no project'}'s"
            )
        if not 0 <= state.updates <= MAX_UPDATES:
            raise CheckpointError(f"{state.updates} updates: not a count of this world")
        if (state.expert_type, state.hidden_dim) != (self.info.expert_type, self.info.hidden_dim):
            raise CheckpointError(
                f"{state.expert_type} of width {state.hidden_dim}, this expert is "
                f"{self.info.expert_type} of width {self.info.hidden_dim}"
            )
        self._check_params(state.params)
        if state.optimizer != self.optimizer_name:
            return  # the weights are still good; the optimizer state is dropped
        params = list(self.module.parameters())
        keys = _OPTIMIZER_KEYS.get(self.optimizer_name)
        for index, entry in state.optimizer_state.items():
            if not 0 <= index < len(params):
                raise CheckpointError(f"optimizer state for parameter {index} of {len(params)}")
            # A replica's state comes from a stranger: what the optimizer would choke on
            # at its next step (a missing buffer, a step count that is not one number)
            # would stop every expert stepped in the same pass, so it is refused here.
            if (
                keys is not None
                and entry
                and not (set(entry) == keys.whole or (keys.partial and set(entry) <= keys.whole))
            ):
                raise CheckpointError(
                    f"optimizer state of parameter {index}: {sorted(entry)}, "
                    f"where {self.optimizer_name} keeps {sorted(keys.whole)}"
                )
            for key, value in entry.items():
                # A buffer is the parameter's own dtype (a step count: a float32 or
                # float64 scalar, as torch makes it): torch converts on load, and a
                # float64 1e300 that passed the check became an inf in float32.
                wanted = _STEP_DTYPES if key == "step" else (params[index].dtype,)
                if value.dtype not in wanted:
                    raise CheckpointError(
                        f"optimizer {key} of parameter {index}: {value.dtype}, "
                        f"not {' or '.join(str(d) for d in wanted)}"
                    )
                if not torch.isfinite(value).all():
                    raise CheckpointError(f"optimizer {key} of parameter {index}: not finite")
                if key == "step":
                    if value.shape != () or not 0 <= float(value) <= MAX_UPDATES:
                        raise CheckpointError(
                            f"optimizer step of parameter {index}: not one count from 0 to 2**53"
                        )
                elif value.shape != params[index].shape:
                    raise CheckpointError(f"optimizer {key} of parameter {index}: wrong shape")
                if key in _NOT_NEGATIVE and bool((value < 0).any()):
                    raise CheckpointError(f"optimizer {key} of parameter {index}: negative")

    def _check_params(self, params: dict[str, torch.Tensor]) -> None:
        own = dict(self.module.named_parameters())
        if list(params) != list(own):
            raise CheckpointError(f"parameters {sorted(params)}, expected {sorted(own)}")
        for name, value in params.items():
            # The weight's own dtype, nothing else: a float64 1e300 is finite, and the
            # copy into a float32 weight made it an inf (a replica's state served NaN
            # from its newcomer). Every honest state has it: ``state()`` copies the
            # weights as they are, whatever the wire dtype (``experts.dtype``).
            if value.shape != own[name].shape or value.dtype != own[name].dtype:
                raise CheckpointError(
                    f"{name}: {value.dtype}{list(value.shape)} does not fit "
                    f"{own[name].dtype}{list(own[name].shape)}"
                )
            if not torch.isfinite(value).all():
                raise CheckpointError(f"{name}: not finite")

    def load_state(self, state: ExpertState, *, moments: bool = True) -> None:
        """Replace the weights, the optimizer state (when ``state`` is for the
        configured optimizer) and the update count. Checks first: raises
        CheckpointError and changes nothing when ``state`` does not fit.

        ``moments=False`` (a state a replica sent): the optimizer starts afresh, as for
        a new expert. A stranger's Adam moments cannot be checked against anything:
        finite ones that Adam could never have made (a first moment over a zero second)
        grew a newcomer's weights from 13 to 1e6 in six honest steps, each one past the
        step check's cheap path, and a huge second moment froze them (a step of exactly
        0 for ~80,000 steps). Weights are another matter: replica averaging pulls them
        back towards the others'; nothing repairs moments."""
        self.check_state(state)
        self._write_parameters(state.params)
        if not moments:
            saved = self.optimizer.state_dict()
            saved["state"] = {}
            self.optimizer.load_state_dict(saved)
        elif state.optimizer == self.optimizer_name:
            saved = self.optimizer.state_dict()  # this config's hyperparameters
            saved["state"] = {
                index: {key: value.clone() for key, value in entry.items()}
                for index, entry in state.optimizer_state.items()
            }
            self.optimizer.load_state_dict(saved)
        self.updates = state.updates

    def set_parameters(self, params: dict[str, torch.Tensor]) -> None:
        """Overwrite the weights (a replica average). Raises CheckpointError when the
        names, shapes or dtypes do not fit or a value is not finite."""
        self._check_params(params)
        self._write_parameters(params)

    def move_to(self, device: torch.device) -> None:
        """Move the weights, their gradient buffers and the optimizer state to ``device``
        (the CPU while the volunteer pauses: frees the GPU's memory). Compute still
        targets ``self.device``: move back before computing. Kept forwards are dropped
        first by the caller; their weight aliases would point at the old storage."""
        self._snapshot = None
        self.module.to(device)
        # Adam's "step" count lives where torch's policy puts it (as load_state_dict
        # does): beside the weights for a fused or capturable optimizer, else on the CPU.
        # Left behind, the step counts of 16 paused experts on an H200 (0.05 MiB) kept a
        # 2 MiB block of the cache from going back to the driver.
        defaults = self.optimizer.defaults
        steps_follow = bool(defaults.get("fused") or defaults.get("capturable"))
        for entry in self.optimizer.state.values():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and (key != "step" or steps_follow):
                    entry[key] = value.to(device)

    def _write_parameters(self, params: dict[str, torch.Tensor]) -> None:
        snapshot = self._snapshot
        with torch.no_grad():
            if snapshot is not None and snapshot.pending > 0:
                # Kept forwards still need the current values: copy on write, as step().
                for p in self.module.parameters():
                    p.data = p.data.clone()
            for name, p in self.module.named_parameters():
                p.data.copy_(params[name])
        self._snapshot = None  # the next kept forward starts a new generation
        self.revision += 1
        self._writes += 1

    def weights_version(self) -> str:
        """An opaque token that changes whenever the weights may have (every optimizer
        step, every ``set_parameters`` and ``load_state``): a replica's ``params`` reply
        carries it, and a requester that sends it back gets "unchanged" instead of the
        weights while it still holds (``wire.messages.ParamsRequest.unless_version``)."""
        count = hashlib.blake2b(
            self._writes.to_bytes(8, "little"), key=self._weights_key, digest_size=8
        ).hexdigest()
        return f"{self._weights_name}.{count}"
