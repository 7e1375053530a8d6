"""StepCheck: an expert's optimizer step that would break its weights is refused or undone.

A step that would make a weight or an optimizer state non-finite, or move the weights by
more than a bound relative to their norm, is refused before it is applied (its bounds
already show it) or undone after: weights, optimizer state and the update count are
exactly what they were before it. ``ExpertBackend.step`` takes one; the runtime shares
one per device (docs/security.md, "Bad trainers").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["StepCheck", "StepMemo", "StepOutcome"]


# A step is judged by how far it can move the weights, as a fraction of their norm
# (all parameters together). The cheap check predicts an upper bound and a lower bound
# of ‖Δw‖ from norms it takes anyway; see ``StepCheck``.
_SLACK = 1.01  # float32 rounding of the step and of the norms, with room to spare
# Adam keeps its second moment finite while every squared gradient is: float32 squares
# overflow above 1.8e19. Below this, one step cannot make its state non-finite.
_ADAM_MAX_GRADIENT = 1e18
# After a vouched Adam step ‖w‖ is at least what it was less the step's upper bound: the
# next prediction may start from that instead of a pass over the weights, for at most
# this many steps in a row (then a pass measures them, and looks again that they are
# finite).
CARRIED_STEPS = 2

Judged = Literal["unchecked", "predicted", "full", "refused"]


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one optimizer step did.

    ``undone`` names why the step was not kept (``non_finite_gradients``,
    ``non_finite_weights``, ``non_finite_optimizer_state``, ``too_large_step``) or is
    None. ``judged`` says how: ``refused`` (never applied: its prediction already broke
    the bound), ``predicted`` (applied on the strength of its bound, no copy taken),
    ``full`` (applied against the shadow copy and measured), ``unchecked``. ``moved``
    is ‖Δw‖ / ‖w‖ over all parameters together: measured for ``full``, the upper bound
    for ``predicted``, the lower bound for ``refused``, NaN when unchecked.

    ``broken`` (``non_finite_weights``) is set when a predicted step left a weight
    non-finite after all: it cannot be undone (no copy was taken), and the caller must
    not serve these weights (the runtime restores the expert from its checkpoint). The
    bounds make this impossible; it is the check of the check. It is also set, beside
    ``undone``, on a step refused for NaN gradients or undone by the full check when
    the weights were already non-finite before it (broken behind a carried bound, or
    by a bit flip): the gradients are then not the sender's fault."""

    undone: str | None
    moved: float
    judged: Judged = "full"
    broken: str | None = None


@dataclass(slots=True)
class StepMemo:
    """What the check measured after an expert's last step, so that the next step's
    prediction needs no pass over the weights before it. One per expert, owned by the
    backend; ``version`` is the backend's (updates, revision) it is valid for."""

    version: tuple[int, int] | None = None
    weights_sq: float = math.nan  # ‖w‖²
    # ‖SGD momentum buffers‖² (0 when there are none): measured by a full check, else
    # an upper bound carried from step to step (μ·b + (1-d)·‖g + wd·w‖ each time)
    momentum_sq: float = math.nan
    since_audit: int = 0  # steps since the last full check
    # Steps since the weights were last measured: while above 0, ``weights_sq`` is a
    # lower bound carried over them (``CARRIED_STEPS``).
    carried: int = 0


class StepCheck:
    """Keeps an optimizer step from breaking the weights: a step that would make a
    weight or an optimizer state non-finite, or move the weights by more than
    ``max_ratio`` times their norm, is refused before it is applied or undone after.

    The cheap path, taken by almost every step, copies nothing. Before the step it
    takes the gradients' norm (one pass over them) and bounds how far the optimizer can
    move the weights:

    * SGD: Δw = lr·(g + wd·w), with momentum lr·(μ·b + (1-d)·(g + wd·w)): ‖Δw‖ lies
      between the bounds the triangle inequality gives (for the buffer b, an upper
      bound of its norm carried from step to step, exact after each full check);
    * Adam: whatever the gradients, each weight moves by at most
      lr·(1-β1)/√((1-β2)(1-β1²/β2)) (7.27 lr for the default betas; by Cauchy-Schwarz
      on the two moving averages, bias correction included), so ‖Δw‖ ≤ that times √N; its
      state stays finite while every gradient is finite and below 1e18.

    A step whose gradients hold a NaN, or whose lower bound is above ``max_ratio``, is
    refused without being applied. One whose upper bound is within ``max_ratio`` is
    applied ("predicted"); after it one pass over the weights takes their norm (for
    the next prediction, and to see that they are finite). After an Adam step the pass
    may wait: ‖w‖ minus the step's upper bound is a lower bound of the new norm, and
    the next prediction starts from it while it can still vouch for a step of the same
    bound, for at most ``CARRIED_STEPS`` steps in a row (at the default learning rate,
    two of every three passes on an ffn of hidden size 512, one of two at 1024). Any
    other step, every step the caller asks to ``audit``, and every ``full_every``-th
    step of an expert (0 = never) gets the full check: the weights and the optimizer
    state are copied into a shadow first, the step is measured against it and undone
    from it when refused. In all, the cheap path reads the gradients once and the
    weights at most once; the full check copies the weights and the state, and reads
    them twice more.

    The shadow's buffers are allocated once and reused for as long as the tensors keep
    their shapes, dtypes and devices: share one check among all experts of a device
    (their steps run one at a time on its worker). It holds one expert's weights and
    optimizer state, and its weights once more (their differences). Not thread-safe:
    call from the worker."""

    def __init__(self, max_ratio: float, *, full_every: int = 0) -> None:
        self.max_ratio = max_ratio
        self.full_every = full_every
        self._shadow: list[torch.Tensor] = []
        self._deltas: list[torch.Tensor] = []
        self.checked = 0  # steps judged, by any path
        self.undone = 0  # steps refused or undone
        self.predicted = 0  # steps applied on their prediction alone
        self.full = 0  # steps given the full check

    def step(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        memo: StepMemo | None = None,
        *,
        version: tuple[int, int] = (0, 0),
        audit: bool = False,
    ) -> StepOutcome:
        """``optimizer.step()`` on ``params``, refused or undone when it breaks them.
        ``memo`` and ``version`` (the expert's (updates, revision) now) let the cheap
        path reuse what the last step measured; ``audit`` asks for the full check."""
        memo = memo if memo is not None else StepMemo()
        due = self._count(memo, audit)
        outcome = None if due else self._predicted(params, optimizer, memo, version)
        if outcome is None:
            outcome = self._checked_fully(params, optimizer, memo, version)
        return self._tally(outcome)

    # The pieces of ``step``. ``experts.multistep.step_many`` runs them for many experts
    # at once: it counts each step, takes the norms of all cheap-path experts in one
    # pass, vouches for each, steps the vouched ones together, takes their weights'
    # norms in one pass, and gives the rest the full check one by one.

    def _count(self, memo: StepMemo, audit: bool) -> bool:
        """Count a step; True when it is due for the full check."""
        self.checked += 1
        memo.since_audit += 1
        return audit or (self.full_every > 0 and memo.since_audit >= self.full_every)

    def _predicted(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        memo: StepMemo,
        version: tuple[int, int],
    ) -> StepOutcome | None:
        """The cheap path: the step refused or applied on its bounds, or None when
        they cannot vouch for it (then it needs the full check)."""
        kind = _kind(optimizer)
        if kind is None:
            return None
        norms = _sums_sq(_before(params, optimizer, memo, version))
        verdict = self._vouch(kind, params, optimizer, memo, version, norms)
        if not isinstance(verdict, _Vouched):
            return verdict
        with torch.no_grad():
            optimizer.step()
            weights_sq = None if verdict.carries else _sums_sq([params])[0]
        return self._after_predicted(params, memo, version, verdict, weights_sq)

    def _vouch(
        self,
        kind: _Kind,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        memo: StepMemo,
        version: tuple[int, int],
        norms: Sequence[float],
    ) -> StepOutcome | _Vouched | None:
        """The cheap path's verdict before the step, from the squared norms of what
        ``_before`` named: the step refused, vouched for, or None (it needs the full
        check). Brings ``memo`` up to date when the norms include the weights'."""
        g_sq = norms[0]
        if len(norms) > 1:
            memo.weights_sq, memo.momentum_sq = norms[1], norms[2]
            memo.version = version
            memo.carried = 0
            if not math.isfinite(memo.weights_sq + memo.momentum_sq):
                return None  # the full check will say what is wrong
        # float32 norms: a square overflows to inf for huge but finite gradients; only
        # a NaN proves a non-finite one.
        if math.isnan(g_sq):
            # Refused; and weights broken since they were last measured (a carried
            # bound, a bit flip) give NaN gradients to every sender: they are reported
            # as broken, not blamed on the sender.
            broken = None if _all_finite(params) else "non_finite_weights"
            return StepOutcome("non_finite_gradients", math.nan, "refused", broken)
        if math.isinf(g_sq):
            return None
        w = math.sqrt(memo.weights_sq)
        bounds = _bounds(kind, optimizer, params, math.sqrt(g_sq), w, math.sqrt(memo.momentum_sq))
        if bounds is None or w <= 0:
            return None
        lower, upper, momentum = bounds
        if lower > self.max_ratio * w:
            return StepOutcome("too_large_step", lower / w, "refused")
        if upper > self.max_ratio * w:
            return None  # (also when w is a carried bound: the full check measures)
        return _Vouched(upper, w, momentum, self._carries(kind, optimizer, memo, upper, w))

    def _carries(
        self,
        kind: _Kind,
        optimizer: torch.optim.Optimizer,
        memo: StepMemo,
        upper: float,
        w: float,
    ) -> bool:
        """Whether the weights' pass after a vouched step may wait: an Adam step, whose
        bound does not grow with ‖w‖, that leaves a lower bound of it from which the
        next step of the same bound is still vouched for."""
        if kind != "adam" or memo.carried >= CARRIED_STEPS:
            return False
        group = optimizer.param_groups[0]
        if group.get("decoupled_weight_decay") and group["weight_decay"]:
            return False
        return upper <= self.max_ratio * (w - upper)

    def _after_predicted(
        self,
        params: Sequence[torch.Tensor],
        memo: StepMemo,
        version: tuple[int, int],
        vouched: _Vouched,
        weights_sq: float | None,
    ) -> StepOutcome:
        """The outcome of a vouched step that was applied, given the weights' ‖w‖²
        after it: for the next prediction, and to see they are finite (a NaN or inf
        anywhere shows in it); None (where ``vouched.carries``) to carry a lower bound
        instead. The buffers' bound needs no pass over them."""
        self.predicted += 1
        memo.momentum_sq = vouched.momentum * vouched.momentum
        memo.version = (version[0] + 1, version[1])
        if weights_sq is None:
            memo.weights_sq = (vouched.w - vouched.upper) ** 2
            memo.carried += 1
            return StepOutcome(None, vouched.upper / vouched.w, "predicted")
        memo.weights_sq = weights_sq
        memo.carried = 0
        broken = None
        if not math.isfinite(memo.weights_sq) and not _all_finite(params):
            broken = "non_finite_weights"  # (else finite weights whose squares overflow)
        return StepOutcome(None, vouched.upper / vouched.w, "predicted", broken)

    def _checked_fully(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        memo: StepMemo,
        version: tuple[int, int],
    ) -> StepOutcome:
        """The step with the full check; ``memo`` measured anew when it is kept."""
        self.full += 1
        memo.since_audit = 0
        outcome = self._full(params, optimizer)
        if outcome.undone is None:
            self._remember(params, optimizer, memo, (version[0] + 1, version[1]))
        return outcome

    def _tally(self, outcome: StepOutcome) -> StepOutcome:
        if outcome.undone is not None:
            self.undone += 1
        return outcome

    def _measure(
        self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, memo: StepMemo
    ) -> None:
        """‖w‖² and ‖momentum‖² into ``memo`` (one pass over each; a NaN or inf in
        either shows as a non-finite sum)."""
        with torch.no_grad():
            memo.weights_sq, memo.momentum_sq = _sums_sq(
                [params, _momentum_buffers(params, optimizer)]
            )

    def _remember(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        memo: StepMemo,
        version: tuple[int, int],
    ) -> None:
        self._measure(params, optimizer, memo)
        memo.version = version
        memo.carried = 0

    def _full(
        self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
    ) -> StepOutcome:
        """The step against a shadow copy of the weights and the optimizer state."""
        # The state as it was: the same tensor objects (the step changes them in place,
        # and the shadow keeps their values) and the plain values, per parameter.
        before = [dict(optimizer.state[p]) if p in optimizer.state else None for p in params]
        saved = [*params]
        for entry in before:
            saved.extend(v for v in (entry or {}).values() if isinstance(v, torch.Tensor))
        self._shadow = _fit(self._shadow, saved)
        shadow = self._shadow[: len(saved)]
        with torch.no_grad():
            torch._foreach_copy_(shadow, saved)
            optimizer.step()
            outcome = self._judge(params, optimizer)
            if outcome.undone is None:
                return outcome
            # Back to the shadow, in place: the weights (kept forwards' aliases and the
            # optimizer keep pointing at them) and the old state tensors, which go back
            # into the state; a parameter that had no state (the first step creates it)
            # has none again.
            torch._foreach_copy_(saved, shadow)
        for p, entry in zip(params, before, strict=True):
            if entry is None:
                optimizer.state.pop(p, None)
            else:
                optimizer.state[p] = entry
        return outcome

    def _judge(
        self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
    ) -> StepOutcome:
        self._deltas = _fit(self._deltas, params)
        n = len(params)
        moved_sq, norm_sq = _distance(params, self._shadow[:n], self._deltas[:n])
        # Adam's second moment is finite only if every gradient so far was finite and
        # below 1.8e19 (its square overflows above), which bounds the first moment too:
        # checking it alone is enough, and it is never negative, so its max is its
        # largest |value|. Other state (SGD's momentum) is checked whole.
        extremes = []
        for p in params:
            entry = optimizer.state.get(p, {})
            if "exp_avg_sq" in entry:
                extremes.append(entry["exp_avg_sq"].amax())
                continue
            for value in entry.values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    extremes.extend(torch.aminmax(value))
        state_max = (
            torch.stack([e.double() for e in extremes]).abs().max()
            if extremes
            else torch.zeros_like(moved_sq)
        )
        # One transfer of three floats, even on a GPU.
        moved_sq_f, norm_sq_f, state_max_f = torch.stack([moved_sq, norm_sq, state_max]).tolist()
        moved = math.sqrt(moved_sq_f) / max(math.sqrt(norm_sq_f), 1e-12)
        if not math.isfinite(norm_sq_f) and not _all_finite(self._shadow[: len(params)]):
            # broken before this step (see ``_vouch``): undone, and reported as broken
            return StepOutcome("non_finite_weights", moved, "full", "non_finite_weights")
        if not math.isfinite(moved_sq_f):
            # NaN or inf in the new weights, or a step so large its square overflows.
            finite = _all_finite(params)
            return StepOutcome("non_finite_weights" if not finite else "too_large_step", moved)
        if not math.isfinite(state_max_f):
            return StepOutcome("non_finite_optimizer_state", moved)
        if moved > self.max_ratio:
            return StepOutcome("too_large_step", moved)
        return StepOutcome(None, moved)


_Kind = Literal["sgd", "adam"]


@dataclass(frozen=True, slots=True)
class _Vouched:
    """A step the cheap path's bounds vouch for: apply it, then ``_after_predicted``."""

    upper: float  # upper bound of ‖Δw‖
    w: float  # ‖w‖ before the step (or a lower bound of it, carried)
    momentum: float  # upper bound of the momentum buffers' norm after the step
    carries: bool = False  # after the step, carry a lower bound of ‖w‖ (no pass)


def _before(
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    memo: StepMemo,
    version: tuple[int, int],
) -> list[list[torch.Tensor]]:
    """What the cheap path measures before a step: the gradients, and the weights and
    the momentum buffers too when ``memo`` is not valid for ``version`` (the weights
    were written another way since, or the last measure was not finite)."""
    grads = [p.grad for p in params if p.grad is not None]
    if memo.version == version and math.isfinite(memo.weights_sq + memo.momentum_sq):
        return [grads]
    return [grads, list(params), _momentum_buffers(params, optimizer)]


def _kind(optimizer: torch.optim.Optimizer) -> _Kind | None:
    """The optimizers whose step the cheap path can bound (one parameter group)."""
    if len(optimizer.param_groups) != 1:
        return None
    if type(optimizer) is torch.optim.SGD:
        return "sgd"
    if type(optimizer) is torch.optim.Adam:
        return "adam"
    return None


def _bounds(
    kind: _Kind,
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    g: float,
    w: float,
    b: float,
) -> tuple[float, float, float] | None:
    """Lower and upper bounds of ‖Δw‖ for the next step, from the norms of the
    gradients ``g``, the weights ``w`` and the momentum buffers ``b`` (or an upper
    bound of it), and an upper bound of the buffers' norm after the step; None when
    the optimizer's settings leave the step unbounded."""
    group = optimizer.param_groups[0]
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    if kind == "adam":
        beta1, beta2 = (float(x) for x in group["betas"])
        q = beta1 * beta1 / beta2
        if g + wd * w >= _ADAM_MAX_GRADIENT or q >= 1 or not 0 <= beta1 < 1:
            return None
        # |m̂ / √v̂| ≤ (1-β1)/√((1-β2)(1-q)) for every t (the bias-corrected bound
        # rises towards it); ε only makes the step smaller.
        per_weight = lr * (1 - beta1) / math.sqrt((1 - beta2) * (1 - q))
        n = sum(p.numel() for p in params)
        decay = lr * wd * w if group.get("decoupled_weight_decay") else 0.0  # AdamW-style
        return 0.0, _SLACK * (per_weight * math.sqrt(n) + decay), 0.0
    momentum = float(group["momentum"])
    dampening = float(group["dampening"])
    nesterov = bool(group["nesterov"])
    g_low, g_high = max(g - wd * w, 0.0), g + wd * w  # ‖g + wd·w‖
    if momentum == 0:
        return lr * g_low / _SLACK, _SLACK * lr * g_high, 0.0
    # A buffer starts as the gradient itself, then μ·b + (1-d)·g.
    first = any("momentum_buffer" not in optimizer.state.get(p, {}) for p in params)
    weight = 1.0 if first else 1 - dampening
    buffer_high = _SLACK * (momentum * b + max(weight, 1 - dampening) * g_high)
    if nesterov:
        return 0.0, _SLACK * lr * (g_high + momentum * buffer_high), buffer_high
    buffer_low = max(min(weight, 1 - dampening) * g_low - momentum * b, 0.0)
    return lr * buffer_low / _SLACK, lr * buffer_high, buffer_high


def _momentum_buffers(
    params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
) -> list[torch.Tensor]:
    out = []
    for p in params:
        buffer = optimizer.state.get(p, {}).get("momentum_buffer")
        if isinstance(buffer, torch.Tensor):
            out.append(buffer)
    return out


def _sums_sq(segments: Sequence[Sequence[torch.Tensor]]) -> list[float]:
    """Σ‖t‖² of each segment of tensors (0 for an empty one), from one foreach pass over
    all of them and one transfer: float32 sums (NaN if a value is NaN, inf if one is
    infinite or the sum overflows). The tensors share one device."""
    flat = [t for segment in segments for t in segment]
    if not flat:
        return [0.0] * len(segments)
    with torch.no_grad():
        squares = torch.stack(torch._foreach_norm(flat)).square()
        sums, start = [], 0
        for segment in segments:
            sums.append(squares[start : start + len(segment)].sum())
            start += len(segment)
        return torch.stack(sums).tolist()


def _distance(
    new: Sequence[torch.Tensor], old: list[torch.Tensor], deltas: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """‖new - old‖² and ‖old‖² over all tensors, as float64 scalars on their device
    (NaN or inf when a value is); ``deltas`` are preallocated buffers for the
    differences (on a loaded CPU, one pass into them was steadier than chunks)."""
    for delta, a, b in zip(deltas, new, old, strict=True):
        torch.sub(a, b, out=delta)
    moved = torch.stack(torch._foreach_norm(deltas)).double().square().sum()
    norm = torch.stack(torch._foreach_norm(old)).double().square().sum()
    return moved, norm


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _fit(buffers: list[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``buffers`` if they match ``like`` in number, shape, dtype and device, else new."""
    if len(buffers) >= len(like) and all(
        b.shape == t.shape and b.dtype == t.dtype and b.device == t.device
        for b, t in zip(buffers, like, strict=False)  # zip stops at the shorter
    ):
        return buffers
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
