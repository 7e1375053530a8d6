"""step_many: the optimizer steps of many experts of a device in one pass.

A daemon that hosts many small experts steps them one after another, and part of each
step is a fixed cost: the optimizer's own bookkeeping around its kernel, and on the
check's cheap path two small norm reductions with a host sync each (on a GPU, kernel
launches and a wait each). ``step_many`` does for a list of experts what
``ExpertBackend.step`` does for each, with those costs paid once
(benchmarks/multistep.py measures what that saves):

* one norm pass (and one sync) over the gradients of every expert on the cheap path,
  each expert's bounds judged as ``StepCheck`` judges them;
* one optimizer call per group of experts whose optimizers match (type, hyperparameters,
  device, dtype): ``torch.optim.adam.adam`` or ``torch.optim.sgd.sgd`` with the
  kernel choice of the experts' own optimizers (fused where the device has it), fed
  every parameter's own state tensors, so each expert keeps its own update count and
  bias correction and a later ``optimizer.step()`` or ``state_dict()`` sees the state
  its own steps would have left;
* one norm pass (and one sync) over the weights of every expert stepped that way whose
  check does not carry a bound of their norm instead (``StepCheck``).

The weights, optimizer states, update counts, outcomes and the check's counters are
those of ``[b.step(check, audit=a) for b, a in zip(backends, audits)]``: the kernels
and the norms are the same per tensor, only gathered. What cannot be gathered goes
alone, as in ``ExpertBackend.step``: a step due for the full check, or one the bounds
cannot vouch for, gets ``StepCheck``'s full check (copy, step, measure, undo) one
expert at a time; an optimizer not yet initialised (its first step creates its state),
of another type, with more than one parameter group or with step hooks, takes its own
``optimizer.step()``. Like ``ExpertBackend.step`` it blocks: call it on the device's
worker.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch.optim import adam as torch_adam
from torch.optim import optimizer as torch_optimizer
from torch.optim import sgd as torch_sgd

from volunteerd.experts.backend import ExpertBackend
from volunteerd.experts.stepcheck import (
    StepCheck,
    StepOutcome,
    _before,
    _Kind,
    _kind,
    _sums_sq,
    _Vouched,
)

__all__ = ["step_many"]


def step_many(
    backends: Sequence[ExpertBackend], check: StepCheck | None, audits: Sequence[bool]
) -> list[StepOutcome]:
    """One optimizer step of each of ``backends`` (each at most once), refused or undone
    when ``check`` finds it breaks that expert's weights (``audits[i]`` asks for the full
    check of the i-th); ``check`` None steps them unchecked. Returns their outcomes, in
    order, as ``ExpertBackend.step`` would. Gradients that are None are skipped, as the
    optimizers skip them."""
    if len(backends) != len(audits):
        raise ValueError(f"{len(backends)} experts but {len(audits)} audit flags")
    if len({id(b) for b in backends}) != len(backends):
        raise ValueError("an expert is listed twice: it steps once per call")
    for b in backends:
        b.begin_step()
    outcomes: dict[int, StepOutcome] = {}
    if check is None:
        with torch.no_grad():
            _step_together([b.optimizer for b in backends])
        outcomes = {i: StepOutcome(None, math.nan, "unchecked") for i in range(len(backends))}
    else:
        by_device: dict[torch.device, list[int]] = {}
        for i, b in enumerate(backends):
            by_device.setdefault(_device(b), []).append(i)
        for indices in by_device.values():  # norms are gathered on one device
            done = _step_checked(
                [backends[i] for i in indices], check, [audits[i] for i in indices]
            )
            outcomes.update(zip(indices, done, strict=True))
    for i, b in enumerate(backends):
        b.end_step(outcomes[i])
    return [outcomes[i] for i in range(len(backends))]


def _step_checked(
    backends: Sequence[ExpertBackend], check: StepCheck, audits: Sequence[bool]
) -> list[StepOutcome]:
    """``StepCheck.step`` for each of ``backends`` (all on one device), the cheap path's
    norms and steps gathered."""
    params = [list(b.module.parameters()) for b in backends]
    optimizers = [b.optimizer for b in backends]
    versions = [(b.updates, b.revision) for b in backends]
    memos = [b._step_memo for b in backends]
    outcomes: dict[int, StepOutcome] = {}
    cheap: list[tuple[int, _Kind]] = []
    full: list[int] = []
    for i in range(len(backends)):
        due = check._count(memos[i], audits[i])
        kind = _kind(optimizers[i])
        if due or kind is None:
            full.append(i)
        else:
            cheap.append((i, kind))

    # Before the steps: one pass over the gradients of all (and the weights and buffers
    # of those whose memo is out of date), then each expert's verdict.
    measured = [_before(params[i], optimizers[i], memos[i], versions[i]) for i, _ in cheap]
    sums = iter(_sums_sq([segment for segments in measured for segment in segments]))
    vouched: list[tuple[int, _Vouched]] = []
    for (i, kind), segments in zip(cheap, measured, strict=True):
        norms = [next(sums) for _ in segments]
        verdict = check._vouch(kind, params[i], optimizers[i], memos[i], versions[i], norms)
        if verdict is None:
            full.append(i)
        elif isinstance(verdict, StepOutcome):
            outcomes[i] = verdict
        else:
            vouched.append((i, verdict))

    # The vouched steps together, then one pass over the weights of those that cannot
    # carry a bound of their norm instead.
    with torch.no_grad():
        _step_together([optimizers[i] for i, _ in vouched])
    measured_after = [(i, verdict) for i, verdict in vouched if not verdict.carries]
    weights_sq = dict(
        zip(
            [i for i, _ in measured_after],
            _sums_sq([params[i] for i, _ in measured_after]),
            strict=True,
        )
    )
    for i, verdict in vouched:
        outcomes[i] = check._after_predicted(
            params[i], memos[i], versions[i], verdict, weights_sq.get(i)
        )

    # The rest one by one against the check's shadow, which can undo them.
    for i in sorted(full):
        outcomes[i] = check._checked_fully(params[i], optimizers[i], memos[i], versions[i])
    return [check._tally(outcomes[i]) for i in range(len(backends))]


def _device(backend: ExpertBackend) -> torch.device:
    return next((p.device for p in backend.module.parameters()), backend.device)


# Gathering optimizer steps.


def _step_together(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """``optimizer.step()`` of each: one call per group of optimizers that can share
    one (``_group_key``), the others alone."""
    groups: dict[Hashable, list[torch.optim.Optimizer]] = {}
    for optimizer in optimizers:
        key = _group_key(optimizer)
        if key is None:
            optimizer.step()
        elif key != ():  # () has no gradients: nothing to step
            groups.setdefault(key, []).append(optimizer)
    for members in groups.values():
        if type(members[0]) is torch.optim.Adam:
            _adam(members)
        else:
            _sgd(members)


def _group_key(optimizer: torch.optim.Optimizer) -> Hashable | None:
    """What must match for optimizers to step in one call: their type, every setting of
    their one parameter group, the device and dtype of the parameters. ``()`` when no
    parameter has a gradient; None when this optimizer must step alone: another type,
    several groups, step hooks or wrappers or a gradient scaler (its own ``step`` runs
    them), tensor-valued settings, state not yet created (``step`` creates it the
    Adam/SGD way), sparse gradients, or parameters on several devices or dtypes."""
    kind = type(optimizer)
    if kind not in (torch.optim.Adam, torch.optim.SGD) or len(optimizer.param_groups) != 1:
        return None
    if _step_observed(optimizer) or getattr(optimizer, "grad_scale", None) is not None:
        return None
    group = optimizer.param_groups[0]
    settings = tuple(sorted((k, v) for k, v in group.items() if k != "params"))
    if group["differentiable"] or any(_holds_tensor(v) for _, v in settings):
        return None
    stepped = [(p, p.grad) for p in group["params"] if p.grad is not None]
    if not stepped:
        return ()
    where = {(p.device, p.dtype) for p, _ in stepped}
    if len(where) != 1 or any(g.is_sparse or not p.is_floating_point() for p, g in stepped):
        return None
    if not all(_state_ready(kind, group, optimizer.state.get(p, {})) for p, _ in stepped):
        return None
    key = (kind, settings, *where)
    try:
        hash(key)
    except TypeError:  # a setting of a type torch does not use
        return None
    return key


def _state_ready(kind: type, group: dict[str, Any], state: dict[str, Any]) -> bool:
    if kind is torch.optim.Adam:
        keys = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        return all(isinstance(state.get(key), torch.Tensor) for key in keys)
    return group["momentum"] == 0 or isinstance(state.get("momentum_buffer"), torch.Tensor)


def _step_observed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether something runs in ``optimizer.step()`` besides the step: hooks, or a
    wrapper put on the instance (an LR scheduler counts the calls that way)."""
    return bool(
        "step" in vars(optimizer)
        or optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
    )


def _holds_tensor(value: object) -> bool:
    if isinstance(value, tuple | list):
        return any(_holds_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)


def _adam(members: Sequence[torch.optim.Optimizer]) -> None:
    """``Adam.step`` of each of ``members`` (settings equal, state created) in one call
    of the functional ``adam``, each parameter with its own state: what ``Adam.step``
    passes it for one optimizer, concatenated."""
    group = members[0].param_groups[0]
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
    for optimizer in members:
        for p in optimizer.param_groups[0]["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
    beta1, beta2 = group["betas"]
    torch_adam.adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        foreach=group["foreach"],
        capturable=group["capturable"],
        differentiable=False,
        fused=group["fused"],
        has_complex=False,
        decoupled_weight_decay=group["decoupled_weight_decay"],
        amsgrad=group["amsgrad"],
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
    )


def _sgd(members: Sequence[torch.optim.Optimizer]) -> None:
    """``SGD.step`` of each of ``members`` (settings equal, momentum buffers created)
    in one call of the functional ``sgd``; the buffers are updated in place, so the
    state needs no writing back."""
    group = members[0].param_groups[0]
    params, grads = [], []
    buffers: list[torch.Tensor | None] = []
    for optimizer in members:
        for p in optimizer.param_groups[0]["params"]:
            if p.grad is None:
                continue
            params.append(p)
            grads.append(p.grad)
            if group["momentum"] != 0:
                buffers.append(optimizer.state[p]["momentum_buffer"])
    torch_sgd.sgd(
        params,
        grads,
        buffers,
        has_sparse_grad=False,
        foreach=group["foreach"],
        fused=group["fused"],
        weight_decay=group["weight_decay"],
        momentum=group["momentum"],
        lr=group["lr"],
        dampening=group["dampening"],
        nesterov=group["nesterov"],
        maximize=group["maximize"],
    )
