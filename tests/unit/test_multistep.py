"""step_many: many experts' optimizer steps gathered into one pass end exactly where
stepping them one by one ends: weights and optimizer state bit for bit, update counts,
outcomes and the check's counters; a step the check refuses or undoes is refused or
undone for its expert alone."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch.optim import adam as torch_adam

from volunteerd.config import ExpertsConfig
from volunteerd.experts import ExpertBackend
from volunteerd.experts.multistep import _group_key, step_many
from volunteerd.experts.stepcheck import StepCheck, StepOutcome

OPTIMIZERS = {
    "adam": {"name": "adam", "lr": 1e-3},
    "adam-fast": {"name": "adam", "lr": 3e-3},  # another group
    "sgd-momentum": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "sgd-decay": {"name": "sgd", "lr": 0.05, "weight_decay": 1e-2},
}


def expert(optimizer: str, index: int) -> ExpertBackend:
    config = ExpertsConfig(hidden_dim=16, optimizer=OPTIMIZERS[optimizer])
    return ExpertBackend(f"ffn.0.{index}", config, torch.device("cpu"), 64)


def twins(optimizers: Sequence[str]) -> tuple[list[ExpertBackend], list[ExpertBackend]]:
    """Two identical sets of experts (each expert's own weights): one to step one by
    one, one to step together."""
    return (
        [expert(name, i) for i, name in enumerate(optimizers)],
        [expert(name, i) for i, name in enumerate(optimizers)],
    )


def backward(
    groups: Sequence[Sequence[ExpertBackend]], generator: torch.Generator, scale: float = 0.01
) -> None:
    """The same gradients into the experts of each group (twins); each group its own."""
    for group in groups:
        x = torch.randn(8, 16, generator=generator)
        g = torch.randn(8, 16, generator=generator) * scale
        for b in group:
            b.backward([x], [g])


def one_by_one(
    backends: Sequence[ExpertBackend], check: StepCheck | None, audits: Sequence[bool]
) -> list[StepOutcome]:
    return [b.step(check, audit=audit) for b, audit in zip(backends, audits, strict=True)]


def assert_same_outcomes(xs: Sequence[StepOutcome], ys: Sequence[StepOutcome]) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert (x.undone, x.judged, x.broken) == (y.undone, y.judged, y.broken)
        assert x.moved == y.moved or (math.isnan(x.moved) and math.isnan(y.moved))


def assert_same_state(xs: Sequence[ExpertBackend], ys: Sequence[ExpertBackend]) -> None:
    """Weights, optimizer state (as a checkpoint sees it) and update counts, bit for bit."""
    for a, b in zip(xs, ys, strict=True):
        sa, sb = a.state(), b.state()
        assert sa.updates == sb.updates, a.uid
        for name in sa.params:
            assert torch.equal(sa.params[name], sb.params[name]), (a.uid, name)
        assert sa.optimizer_state.keys() == sb.optimizer_state.keys(), a.uid
        for index, entry in sa.optimizer_state.items():
            assert entry.keys() == sb.optimizer_state[index].keys()
            for key, value in entry.items():
                assert value.dtype == sb.optimizer_state[index][key].dtype, (a.uid, key)
                assert torch.equal(value, sb.optimizer_state[index][key]), (a.uid, index, key)


def counters(check: StepCheck | None) -> tuple[int, ...]:
    return () if check is None else (check.checked, check.predicted, check.full, check.undone)


MIXED = ["adam", "adam", "adam-fast", "sgd-momentum", "sgd-momentum", "sgd-decay"]


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_experts_step_together_exactly_as_one_by_one(checked: bool) -> None:
    # Adam at two learning rates and SGD with and without momentum in one call; the
    # experts start from different histories (3 steps, none, 1 step, ...), so that
    # their update counts, bias corrections and full-check turns differ.
    alone, together = twins(MIXED)
    check_alone, check_together = (
        (StepCheck(1.0, full_every=3), StepCheck(1.0, full_every=3)) if checked else (None, None)
    )
    generator = torch.Generator().manual_seed(1)
    for i, history in enumerate([3, 0, 1, 2, 0, 1]):
        for _ in range(history):
            backward([(alone[i], together[i])], generator)
            alone[i].step(check_alone)
            together[i].step(check_together)
    pairs = list(zip(alone, together, strict=True))
    judged = set()
    for _ in range(4):
        backward(pairs, generator)
        audits = [False] * len(MIXED)
        expected = one_by_one(alone, check_alone, audits)
        outcomes = step_many(together, check_together, audits)
        assert_same_outcomes(outcomes, expected)
        assert_same_state(together, alone)
        assert counters(check_together) == counters(check_alone)
        judged |= {outcome.judged for outcome in outcomes}
        assert all(outcome.undone is None for outcome in outcomes)
    assert judged == ({"predicted", "full"} if checked else {"unchecked"})
    # A later plain step (the optimizer's own) carries on from the state left.
    backward(pairs, generator)
    assert_same_outcomes(one_by_one(together, None, audits), one_by_one(alone, None, audits))
    assert_same_state(together, alone)
    assert all(p.grad is None or not p.grad.any() for b in together for p in b.module.parameters())


def test_a_checkpoint_taken_after_stepping_together_resumes_as_one_by_one() -> None:
    alone, together = twins(["adam", "adam", "sgd-momentum"])
    pairs = list(zip(alone, together, strict=True))
    generator = torch.Generator().manual_seed(2)
    audits = [False] * 3
    for _ in range(3):
        backward(pairs, generator)
        one_by_one(alone, None, audits)
        step_many(together, None, audits)
    resumed = [expert(name, i) for i, name in enumerate(["adam", "adam", "sgd-momentum"])]
    for r, b in zip(resumed, together, strict=True):
        r.load_state(b.state())
    pairs = list(zip(alone, resumed, strict=True))
    for _ in range(2):
        backward(pairs, generator)
        one_by_one(alone, None, audits)
        step_many(resumed, StepCheck(1.0), audits)
    assert_same_state(resumed, alone)


def test_one_optimizer_call_per_group_of_equal_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    experts = [expert(name, i) for i, name in enumerate(["adam", "adam-fast", "adam", "adam"])]
    generator = torch.Generator().manual_seed(3)
    for b in experts:  # the first step creates the state: each optimizer its own
        backward([[b]], generator)
        b.step()
    calls: list[int] = []
    real = torch_adam.adam

    def counted(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        calls.append(len(params))
        real(params, *args, **kwargs)

    monkeypatch.setattr(torch_adam, "adam", counted)
    for b in experts:
        backward([[b]], generator)
    step_many(experts, StepCheck(1.0), [False] * 4)
    per_expert = len(list(experts[0].module.parameters()))
    assert sorted(calls) == [per_expert, 3 * per_expert]  # lr 3e-3 alone, lr 1e-3 together
    assert [b.updates for b in experts] == [2] * 4


def test_what_can_share_a_call() -> None:
    adam, peer, faster, sgd, momentum = (
        expert(name, i)
        for i, name in enumerate(["adam", "adam", "adam-fast", "sgd-decay", "sgd-momentum"])
    )
    generator = torch.Generator().manual_seed(4)
    backward([[adam], [peer], [faster], [sgd], [momentum]], generator)
    # Not yet initialised: Adam's state and SGD's momentum buffers come with the first
    # step, which the optimizer takes itself. Plain SGD keeps no state.
    assert _group_key(adam.optimizer) is None
    assert _group_key(momentum.optimizer) is None
    assert _group_key(sgd.optimizer) is not None
    for b in (adam, peer, faster, momentum):
        b.step()
    backward([[adam], [peer], [faster], [momentum]], generator)
    assert _group_key(adam.optimizer) is not None
    assert _group_key(adam.optimizer) == _group_key(peer.optimizer)
    assert _group_key(adam.optimizer) != _group_key(faster.optimizer)
    assert _group_key(momentum.optimizer) is not None
    # An optimizer with a step hook, or whose step an LR scheduler wraps, steps itself.
    momentum.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: None)
    assert _group_key(momentum.optimizer) is None
    torch.optim.lr_scheduler.StepLR(peer.optimizer, step_size=1)
    assert _group_key(peer.optimizer) is None
    sgd.optimizer.zero_grad(set_to_none=True)
    assert _group_key(sgd.optimizer) == ()  # no gradients: nothing to step


def test_nan_gradients_are_refused_for_their_expert_alone() -> None:
    alone, together = twins(["adam"] * 3)
    pairs = list(zip(alone, together, strict=True))
    check_alone, check_together = StepCheck(1.0), StepCheck(1.0)
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        backward(pairs, generator)
        one_by_one(alone, check_alone, [False] * 3)
        step_many(together, check_together, [False] * 3)
    backward(pairs, generator)
    for b in pairs[1]:
        b.backward([torch.randn(1, 16)], [torch.full((1, 16), float("nan"))])
    expected = one_by_one(alone, check_alone, [False] * 3)
    outcomes = step_many(together, check_together, [False] * 3)
    assert_same_outcomes(outcomes, expected)
    assert [(o.undone, o.judged) for o in outcomes] == [
        (None, "predicted"),
        ("non_finite_gradients", "refused"),
        (None, "predicted"),
    ]
    assert [b.updates for b in together] == [3, 2, 3]
    assert_same_state(together, alone)
    assert counters(check_together) == counters(check_alone)


def test_too_large_steps_are_refused_or_undone_for_their_expert_alone() -> None:
    # Gradients of 9e5: the bounds of expert 0's step already break max_ratio (refused,
    # never applied); expert 2 is audited, so its step is applied against the shadow,
    # measured and undone; expert 1 and 3 step.
    alone, together = twins(["sgd-momentum"] * 4)
    pairs = list(zip(alone, together, strict=True))
    check_alone, check_together = StepCheck(1.0), StepCheck(1.0)
    generator = torch.Generator().manual_seed(6)
    for _ in range(2):
        backward(pairs, generator)
        one_by_one(alone, check_alone, [False] * 4)
        step_many(together, check_together, [False] * 4)
    backward(pairs[1::2], generator)
    for pair in pairs[0::2]:
        x = torch.randn(1, 16, generator=generator)
        for b in pair:
            b.backward([x], [torch.full((1, 16), 9e5)])
    audits = [False, False, True, False]
    expected = one_by_one(alone, check_alone, audits)
    outcomes = step_many(together, check_together, audits)
    assert_same_outcomes(outcomes, expected)
    assert [(o.undone, o.judged) for o in outcomes] == [
        ("too_large_step", "refused"),
        (None, "predicted"),
        ("too_large_step", "full"),
        (None, "predicted"),
    ]
    assert [b.updates for b in together] == [2, 3, 2, 3]
    assert_same_state(together, alone)
    assert counters(check_together) == counters(check_alone)


def test_an_audited_expert_gets_the_full_check_and_the_others_the_cheap_path() -> None:
    alone, together = twins(["adam", "adam", "sgd-decay"])
    pairs = list(zip(alone, together, strict=True))
    check_alone, check_together = StepCheck(1.0), StepCheck(1.0)
    generator = torch.Generator().manual_seed(7)
    for audits in ([False, False, False], [False, True, False], [True, False, True]):
        backward(pairs, generator)
        expected = one_by_one(alone, check_alone, audits)
        outcomes = step_many(together, check_together, audits)
        assert_same_outcomes(outcomes, expected)
        assert [o.judged for o in outcomes] == [
            "full" if audit else "predicted" for audit in audits
        ]
        assert_same_state(together, alone)
    assert counters(check_together) == counters(check_alone) == (9, 6, 3, 0)


def test_a_step_the_bounds_cannot_vouch_for_gets_the_full_check() -> None:
    # Adam's bound at lr 1e-3 is above a max_ratio of 0.05 on these small experts: the
    # cheap path cannot vouch, the full check measures the step and keeps it.
    alone, together = twins(["adam", "adam"])
    pairs = list(zip(alone, together, strict=True))
    check_alone, check_together = StepCheck(0.05), StepCheck(0.05)
    generator = torch.Generator().manual_seed(8)
    for _ in range(2):
        backward(pairs, generator)
        expected = one_by_one(alone, check_alone, [False, False])
        outcomes = step_many(together, check_together, [False, False])
        assert_same_outcomes(outcomes, expected)
        assert [(o.judged, o.undone) for o in outcomes] == [("full", None)] * 2
    assert_same_state(together, alone)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_parameters_without_gradients_are_skipped(checked: bool) -> None:
    # Expert 0 lost one parameter's gradient, expert 1 got no backward at all (its
    # gradients are None or zero, as the last step left them).
    alone, together = twins(["adam", "adam", "sgd-momentum"])
    pairs = list(zip(alone, together, strict=True))
    check_alone, check_together = (StepCheck(1.0), StepCheck(1.0)) if checked else (None, None)
    generator = torch.Generator().manual_seed(9)
    for _ in range(2):
        backward(pairs, generator)
        one_by_one(alone, check_alone, [False] * 3)
        step_many(together, check_together, [False] * 3)
    backward([pairs[0], pairs[2]], generator)
    for b in pairs[0]:
        next(b.module.parameters()).grad = None
    expected = one_by_one(alone, check_alone, [False] * 3)
    outcomes = step_many(together, check_together, [False] * 3)
    assert_same_outcomes(outcomes, expected)
    assert_same_state(together, alone)
    assert counters(check_together) == counters(check_alone)


def test_a_kept_forward_keeps_the_weights_it_saw() -> None:
    alone, together = twins(["adam", "adam"])
    pairs = list(zip(alone, together, strict=True))
    generator = torch.Generator().manual_seed(10)
    backward(pairs, generator)
    one_by_one(alone, None, [False, False])
    step_many(together, None, [False, False])
    x, g = torch.randn(4, 16, generator=generator), torch.randn(4, 16, generator=generator)
    kept = {id(b): b.forward_retained([x])[1] for b in (*alone, *together)}
    backward(pairs, generator)  # other trainers' backwards, and a step, in between
    one_by_one(alone, StepCheck(1.0), [False, False])
    step_many(together, StepCheck(1.0), [False, False])
    grads = {id(b): b.backward_retained([(kept[id(b)], [g])])[0][0] for b in (*alone, *together)}
    for a, b in pairs:
        assert torch.equal(grads[id(a)], grads[id(b)])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda b: step_many([b, b], None, [False, False]), "twice"),
        (lambda b: step_many([b], None, []), "audit flags"),
    ],
)
def test_misuse_is_refused_before_anything_steps(
    call: Callable[[ExpertBackend], object], message: str
) -> None:
    b = expert("adam", 0)
    backward([[b]], torch.Generator().manual_seed(11))
    before = [p.detach().clone() for p in b.module.parameters()]
    with pytest.raises(ValueError, match=message):
        call(b)
    assert all(torch.equal(p, q) for p, q in zip(b.module.parameters(), before, strict=True))
    assert b.updates == 0
