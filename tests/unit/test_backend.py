"""ExpertBackend: the kept-graph backward gives the stateless backward's gradients,
even when other optimizer steps happen in between; a step that would wreck the weights
is undone exactly."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from volunteerd.config import ExpertsConfig
from volunteerd.errors import BadShape
from volunteerd.experts import ExpertBackend
from volunteerd.experts import backend as backend_module
from volunteerd.experts.stepcheck import CARRIED_STEPS, StepCheck


def backend(optimizer: str = "sgd") -> ExpertBackend:
    config = ExpertsConfig(hidden_dim=16, optimizer={"name": optimizer, "lr": 0.1})
    return ExpertBackend("ffn.0.0", config, torch.device("cpu"), 1024)


def test_retained_backward_equals_stateless_backward() -> None:
    a, b = backend(), backend()
    x, g = torch.randn(5, 16), torch.randn(5, 16)
    (ya,) = a.forward([x])
    (yb,), kept = b.forward_retained([x])
    torch.testing.assert_close(ya, yb)
    (grad_a,) = a.backward([x], [g])
    a.step()
    ((grad_b,),) = b.backward_retained([(kept, [g])])
    b.step()
    torch.testing.assert_close(grad_a, grad_b)
    for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
        torch.testing.assert_close(pa, pb)
    assert a.updates == b.updates == 1


def test_gradients_that_do_not_fit_the_outputs_are_a_bad_shape() -> None:
    """Whatever the module, gradients of another shape than its outputs are the
    sender's error (BadShape), found before autograd raises, with nothing accumulated."""
    a = backend()
    with pytest.raises(BadShape, match="for outputs of shapes"):
        a.backward([torch.randn(5, 16)], [torch.randn(4, 16)])
    assert all(p.grad is None for p in a.module.parameters())


@pytest.mark.parametrize("kind", ["ffn", "transformer"])
def test_a_large_batch_runs_in_pieces_with_the_same_results(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transformer block's activations are ~14 times its input: a forward or stateless
    backward over more than CHUNK_BYTES of input runs piece by piece (the peak stays
    bounded), with the results of one call."""
    config = ExpertsConfig(type=kind, hidden_dim=16, num_heads=2, optimizer={"name": "adam"})
    whole = ExpertBackend("ffn.0.0", config, torch.device("cpu"), 1024)
    pieces = ExpertBackend("ffn.0.0", config, torch.device("cpu"), 1024)
    shape = (10, 16) if kind == "ffn" else (10, 3, 16)
    x, g = torch.randn(shape), torch.randn(shape)
    (y_whole,) = whole.forward([x])
    (dx_whole,) = whole.backward([x], [g])
    calls: list[int] = []
    pieces.module.register_forward_hook(lambda _m, args, _out: calls.append(len(args[0])))
    row_bytes = x[0].numel() * 4
    monkeypatch.setattr(backend_module, "CHUNK_BYTES", 3 * row_bytes)  # 3 rows a piece
    (y_pieces,) = pieces.forward([x])
    (dx_pieces,) = pieces.backward([x], [g])
    assert calls == [3, 3, 3, 1, 3, 3, 3, 1]
    torch.testing.assert_close(y_pieces, y_whole)
    torch.testing.assert_close(dx_pieces, dx_whole)
    for p, q in zip(pieces.module.parameters(), whole.module.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(BadShape):  # gradients for other rows: refused before any piece
        pieces.backward([x], [g[:7]])


@pytest.mark.parametrize("arrival", ["together", "apart", "one dropped", "step between"])
def test_merged_kept_forwards_give_each_request_its_own_gradients(arrival: str) -> None:
    """Concurrent kept forwards run as one batch and one graph; their backwards give
    what separate stateless backwards give, whether they come back together (one pass
    through the merged graph), one by one (each recomputed on the weights its forward
    saw), with one of them never coming back, or with another step in between."""
    merged, reference = backend(), backend()
    xs = [torch.randn(n, 16) for n in (3, 5, 2)]
    gs = [torch.randn(n, 16) for n in (3, 5, 2)]
    kept = merged.forward_retained_many([[x] for x in xs])
    at_forward = copy.deepcopy(reference.module)
    for (out,), x in zip([k[0] for k in kept], xs, strict=True):
        torch.testing.assert_close(out, at_forward(x))
    pieces = [k[1] for k in kept]
    assert sum(p.nbytes for p in pieces) >= pieces[0].graph.leaves[0].nbytes  # type: ignore[union-attr]
    answered = [0, 1, 2]
    if arrival == "together":
        grads = merged.backward_retained([(p, [g]) for p, g in zip(pieces, gs, strict=True)])
    elif arrival == "step between":
        merged.backward([torch.randn(4, 16)], [torch.randn(4, 16)])  # another trainer
        merged.step()
        grads = merged.backward_retained([(p, [g]) for p, g in zip(pieces, gs, strict=True)])
        assert pieces[0].graph.output is None  # type: ignore[union-attr]
    elif arrival == "apart":
        grads = [merged.backward_retained([(p, [g])])[0] for p, g in zip(pieces, gs, strict=True)]
    else:
        answered = [0, 2]
        del kept
        dropped = pieces.pop(1)
        del dropped  # its trainer never sent the backward (expired)
        grads = merged.backward_retained(
            [(p, [gs[i]]) for p, i in zip(pieces, answered, strict=True)]
        )
    expected_params = [torch.zeros_like(p) for p in at_forward.parameters()]
    for (grad_x,), i in zip(grads, answered, strict=True):
        x = xs[i].clone().requires_grad_()
        at_forward.zero_grad()
        at_forward(x).backward(gs[i])
        torch.testing.assert_close(grad_x, x.grad)
        for total, p in zip(expected_params, at_forward.parameters(), strict=True):
            total += p.grad
    if arrival != "step between":
        for got, want in zip(merged.module.parameters(), expected_params, strict=True):
            torch.testing.assert_close(got.grad, want)
    assert merged._snapshot is None or merged._snapshot.pending == 0
    together = 3 if arrival in ("together", "step between") else 0
    assert (merged.kept_together, merged.kept_recomputed) == (together, len(answered) - together)


def test_steps_in_between_do_not_break_a_kept_forward() -> None:
    b = backend("adam")
    at_forward = copy.deepcopy(b.module)
    x, g = torch.randn(4, 16), torch.randn(4, 16)
    _, kept = b.forward_retained([x])
    for _ in range(3):  # other trainers' backwards step the expert meanwhile
        b.backward([torch.randn(4, 16)], [torch.randn(4, 16)])
        b.step()
    ((grad_x,),) = b.backward_retained([(kept, [g])])
    b.step()
    # The gradient is that of the function the trainer saw (the weights at forward time).
    x_ref = x.clone().requires_grad_()
    at_forward(x_ref).backward(g)
    torch.testing.assert_close(grad_x, x_ref.grad)
    assert b.updates == 4


def test_gradients_accumulate_until_the_step() -> None:
    b = backend()
    before = [p.detach().clone() for p in b.module.parameters()]
    x, g = torch.randn(3, 16), torch.randn(3, 16)
    b.backward([x], [g])
    b.backward([x], [g])
    assert all(torch.equal(p, q) for p, q in zip(b.module.parameters(), before, strict=True))
    assert b.updates == 0
    b.step()
    assert b.updates == 1
    assert all(p.grad is None for p in b.module.parameters())  # dropped


def test_several_kept_backwards_share_one_step() -> None:
    b = backend()
    items = []
    for _ in range(3):
        x = torch.randn(2, 16)
        _, kept = b.forward_retained([x])
        items.append((kept, [torch.randn(2, 16)]))
    grads = b.backward_retained(items)
    b.step()
    assert len(grads) == 3
    assert b.updates == 1
    assert items[0][0].weights is items[2][0].weights, "one snapshot per optimizer step"
    assert items[0][0].nbytes > 0


def test_weights_are_copied_only_when_a_step_meets_a_kept_forward() -> None:
    b = backend("adam")
    x, g = torch.randn(4, 16), torch.randn(4, 16)
    storage = [p.data_ptr() for p in b.module.parameters()]
    for _ in range(3):  # one trainer: forward, backward, step — nothing to protect
        _, kept = b.forward_retained([x])
        b.backward_retained([(kept, [g])])
        b.step()
    assert [p.data_ptr() for p in b.module.parameters()] == storage
    _, kept = b.forward_retained([x])
    b.backward([x], [g])  # another trainer's backward, and a step, in between
    b.step()
    assert [p.data_ptr() for p in b.module.parameters()] != storage
    b.backward_retained([(kept, [g])])
    b.step()


# The attacks of issue 12: one stateless backward of one sample from a stranger.
ATTACKS = {
    "one input of 3e38": (0, 3e38, None),  # (where in the input, its value, gradients)
    "inputs of 1e20": (None, 1e20, None),
    "gradients of 3e38": (None, None, 3e38),
    "gradients of 1e30": (None, None, 1e30),
    "gradients of 1e6": (None, None, 1e6),
}


def attack(b: ExpertBackend, name: str) -> None:
    where, x_value, g_value = ATTACKS[name]
    generator = torch.Generator().manual_seed(11)
    x, g = torch.randn(1, 16, generator=generator), torch.randn(1, 16, generator=generator)
    if x_value is not None and where is not None:
        x[0, where] = x_value
    elif x_value is not None:
        x.fill_(x_value)
    if g_value is not None:
        g.fill_(g_value)
    b.backward([x], [g])


def honest_steps(backends: list[ExpertBackend], check: StepCheck, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, g = torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator)
        for b in backends:
            b.backward([x], [g * 0.01])
            assert b.step(check).undone is None


def assert_same_state(a: ExpertBackend, b: ExpertBackend) -> None:
    sa, sb = a.state(), b.state()
    assert sa.updates == sb.updates
    for name in sa.params:
        assert torch.equal(sa.params[name], sb.params[name]), name
    assert sa.optimizer_state.keys() == sb.optimizer_state.keys()
    for index, entry in sa.optimizer_state.items():
        assert entry.keys() == sb.optimizer_state[index].keys()
        for key, value in entry.items():
            assert torch.equal(value, sb.optimizer_state[index][key]), (index, key)


@pytest.mark.parametrize(
    ("optimizer", "name", "reason"),
    [
        # NaN gradients (the layer norm's variance overflowed) are refused unapplied.
        ("adam", "one input of 3e38", "non_finite_gradients"),
        ("adam", "inputs of 1e20", "non_finite_gradients"),
        ("adam", "gradients of 3e38", "non_finite"),
        ("adam", "gradients of 1e30", "non_finite_optimizer_state"),
        ("sgd", "one input of 3e38", "non_finite_gradients"),
        ("sgd", "gradients of 3e38", "non_finite_weights"),
        ("sgd", "gradients of 1e30", "too_large_step"),
        ("sgd", "gradients of 1e6", "too_large_step"),
    ],
)
@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "trained"])
def test_a_wrecking_step_is_undone_and_training_goes_on_as_if_it_never_came(
    optimizer: str, name: str, reason: str, trained: bool
) -> None:
    # Unchecked, the attack wrecks the expert: that is what the check is for.
    victim = backend(optimizer)
    attack(victim, name)
    victim.step()
    weights = torch.cat([p.detach().flatten() for p in victim.module.parameters()])
    state = [v for s in victim.optimizer.state.values() for v in s.values()]
    wrecked = not torch.isfinite(weights).all() or not all(torch.isfinite(v).all() for v in state)
    assert wrecked or float(weights.abs().max()) > 1e3

    check = StepCheck(max_ratio=1.0)
    a, twin = backend(optimizer), backend(optimizer)  # twin never sees the attack
    if trained:
        honest_steps([a, twin], check, 3, seed=1)
    attack(a, name)
    outcome = a.step(check)
    # With Adam, whether NaN reaches the gradients, the weights or only the state (an
    # infinite second moment makes the update 0) depends on the values: each is undone
    # (or, NaN gradients, refused before the step).
    non_finite = {"non_finite_gradients", "non_finite_weights", "non_finite_optimizer_state"}
    assert outcome.undone in (non_finite if reason == "non_finite" else {reason})
    assert a.updates == twin.updates == (3 if trained else 0)
    assert_same_state(a, twin)  # bit for bit, optimizer state (or its absence) included
    assert all(p.grad is None for p in a.module.parameters())  # dropped
    honest_steps([a, twin], check, 2, seed=2)
    assert_same_state(a, twin)
    assert check.undone == 1


def test_adam_takes_huge_finite_gradients_in_its_stride() -> None:
    # Adam divides by the gradients' running RMS, so gradients of 1e6 move each weight
    # by at most about the learning rate: the step is applied (the guard's bounds and
    # statistics are what keep such gradients out).
    b = backend("adam")
    attack(b, "gradients of 1e6")
    outcome = b.step(StepCheck(max_ratio=1.0))
    assert outcome.undone is None
    assert 0 < outcome.moved < 1.0


def test_a_step_is_undone_when_it_moves_the_weights_further_than_the_bound() -> None:
    check = StepCheck(max_ratio=1.0)
    a, twin = backend("sgd"), backend("sgd")
    honest_steps([a, twin], check, 1, seed=3)
    a.backward([torch.randn(4, 16)], [torch.randn(4, 16) * 0.01])
    moved = a.step(StepCheck(max_ratio=1e-9))
    assert moved.undone == "too_large_step"
    assert moved.moved > 1e-9
    assert_same_state(a, twin)


def test_an_undone_step_leaves_kept_forwards_intact() -> None:
    b = backend("adam")
    check = StepCheck(max_ratio=1.0)
    at_forward = copy.deepcopy(b.module)
    x, g = torch.randn(4, 16), torch.randn(4, 16)
    _, kept = b.forward_retained([x])
    attack(b, "gradients of 3e38")  # another trainer's backward in between
    assert b.step(check).undone in {"non_finite_weights", "non_finite_optimizer_state"}
    ((grad_x,),) = b.backward_retained([(kept, [g])])
    assert b.step(check).undone is None
    x_ref = x.clone().requires_grad_()
    at_forward(x_ref).backward(g)
    torch.testing.assert_close(grad_x, x_ref.grad)
    assert b.updates == 1


def test_one_shadow_serves_every_expert_of_a_device() -> None:
    check = StepCheck(max_ratio=1.0)
    experts = [backend("adam"), backend("adam")]
    honest_steps(experts, check, 2, seed=4)  # the first step creates Adam's state
    buffers = [t.data_ptr() for t in check._shadow]
    honest_steps(experts, check, 3, seed=5)
    assert [t.data_ptr() for t in check._shadow] == buffers, "allocated once, reused"
    assert check.checked == 10


# The cheap path: a step whose bounds vouch for it is applied without a copy.

CHEAP = {
    "adam": {"name": "adam", "lr": 1e-3},
    "sgd": {"name": "sgd", "lr": 0.1, "weight_decay": 1e-2},
    "sgd-momentum": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
}


def cheap_backend(optimizer: str) -> ExpertBackend:
    config = ExpertsConfig(hidden_dim=16, optimizer=CHEAP[optimizer])
    return ExpertBackend("ffn.0.0", config, torch.device("cpu"), 1024)


def honest_gradients(backends: list[ExpertBackend], generator: torch.Generator) -> None:
    x, g = torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator)
    for b in backends:
        b.backward([x], [g * 0.01])


@pytest.mark.parametrize("optimizer", list(CHEAP))
def test_honest_steps_take_the_cheap_path_and_train_exactly_as_unchecked(optimizer: str) -> None:
    check = StepCheck(max_ratio=1.0)
    a, plain = cheap_backend(optimizer), cheap_backend(optimizer)
    generator = torch.Generator().manual_seed(6)
    for _ in range(5):
        honest_gradients([a, plain], generator)
        outcome = a.step(check)
        assert plain.step().undone is None
        assert (outcome.judged, outcome.undone, outcome.broken) == ("predicted", None, None)
        assert 0 < outcome.moved <= 1.0
    assert check._shadow == [], "nothing was copied"
    assert (check.checked, check.predicted, check.full, check.undone) == (5, 5, 0, 0)
    assert_same_state(a, plain)  # the prediction changes nothing about the step


@pytest.mark.parametrize("optimizer", list(CHEAP))
def test_the_predicted_bound_is_never_below_the_measured_step(optimizer: str) -> None:
    # The same steps measured against the shadow (audit) and bounded (predicted), on
    # twins; gradients honest, then loud and of one sign (Adam's worst case: its moving
    # averages agree), then huge (an SGD step moving the weights 6e4 times their norm).
    measured, bounded = cheap_backend(optimizer), cheap_backend(optimizer)
    check = StepCheck(max_ratio=1e9)  # judge nothing: compare the numbers
    generator = torch.Generator().manual_seed(7)
    for scale in [0.01] * 3 + [1.0, 10.0, 1e3]:
        x = torch.randn(8, 16, generator=generator)
        g = torch.randn(8, 16, generator=generator).abs() * scale
        for b in (measured, bounded):
            b.backward([x], [g])
        exact = measured.step(check, audit=True)
        bound = bounded.step(check)
        assert (exact.judged, bound.judged) == ("full", "predicted")
        assert exact.moved <= bound.moved, scale
    assert_same_state(measured, bounded)


def test_a_step_its_bounds_already_break_is_refused_without_being_applied() -> None:
    # SGD, gradients just under the guard's bound: the lower bound of the step is far
    # above max_ratio, so it is never applied (and nothing needs copying back).
    check = StepCheck(max_ratio=1.0)
    a, twin = cheap_backend("sgd-momentum"), cheap_backend("sgd-momentum")
    generator = torch.Generator().manual_seed(8)
    for _ in range(2):
        honest_gradients([a, twin], generator)
        a.step(check)
        twin.step(check)
    a.backward([torch.randn(1, 16)], [torch.full((1, 16), 9e5)])
    outcome = a.step(check)
    assert (outcome.undone, outcome.judged) == ("too_large_step", "refused")
    assert outcome.moved > 1.0
    assert check._shadow == []
    assert_same_state(a, twin)
    assert all(p.grad is None for p in a.module.parameters())  # dropped
    a.backward([torch.randn(1, 16)], [torch.full((1, 16), float("nan"))])
    assert (a.step(check).undone, check.undone) == ("non_finite_gradients", 2)
    assert_same_state(a, twin)


def test_an_audit_gives_the_full_check_and_still_undoes() -> None:
    check = StepCheck(max_ratio=1.0, full_every=3)
    a, twin = cheap_backend("sgd"), cheap_backend("sgd")
    generator = torch.Generator().manual_seed(9)
    judged = []
    for _ in range(6):
        honest_gradients([a, twin], generator)
        judged.append(a.step(check).judged)
        twin.step()
    assert judged == ["predicted", "predicted", "full"] * 2  # every 3rd step of the expert
    # Asked to audit, an attack step is applied against the shadow and undone from it.
    a.backward([torch.randn(1, 16)], [torch.full((1, 16), 9e5)])
    outcome = a.step(check, audit=True)
    assert (outcome.undone, outcome.judged) == ("too_large_step", "full")
    assert_same_state(a, twin)
    # A bound that cannot vouch for a step (here: a tighter max_ratio than Adam's bound
    # at this learning rate) sends it to the full check too, which keeps an honest one.
    adam = cheap_backend("adam")
    honest_gradients([adam], generator)
    outcome = adam.step(StepCheck(max_ratio=0.05))
    assert (outcome.judged, outcome.undone) == ("full", None)
    assert outcome.moved <= 0.05


def test_weights_broken_behind_the_bounds_are_reported_not_served_as_good() -> None:
    # The bounds rule a broken weight out after a predicted step; the check still looks,
    # at the latest after CARRIED_STEPS more steps (between its passes over the weights
    # an Adam step carries a bound of their norm). Here a weight goes NaN outside any
    # step (as a bit flip would), and finite gradients keep coming (a backward through
    # the NaN would give NaN gradients, which are refused).
    check = StepCheck(max_ratio=1.0)
    b = cheap_backend("adam")
    generator = torch.Generator().manual_seed(10)
    honest_gradients([b], generator)
    assert b.step(check).judged == "predicted"
    honest_gradients([b], generator)
    with torch.no_grad():
        next(b.module.parameters()).view(-1)[0] = float("nan")
    outcomes = []
    for _ in range(CARRIED_STEPS + 1):
        outcomes.append(b.step(check))
        if outcomes[-1].broken:
            break
        for p in b.module.parameters():
            p.grad = torch.randn(p.shape, generator=generator) * 0.01
    assert (outcomes[-1].judged, outcomes[-1].broken, outcomes[-1].undone) == (
        "predicted",
        "non_finite_weights",
        None,
    )
    assert all(o.judged == "predicted" and o.undone is None for o in outcomes)
    # Weights written another way (a checkpoint, an average) are measured anew first.
    b.load_state(cheap_backend("adam").state())
    honest_gradients([b], generator)
    assert b.step(check).judged == "predicted"


@pytest.mark.parametrize("audit", [False, True], ids=["predicted", "full"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_weights_broken_between_steps_are_reported_not_blamed_on_the_gradients(
    optimizer: str, audit: bool
) -> None:
    # A weight goes NaN after a step that measured it (a bit flip): every backward
    # through it gives NaN gradients, whoever sends them. The step is refused or undone
    # and the weights reported broken (the runtime restores them and bans nobody).
    check = StepCheck(max_ratio=1.0)
    b = cheap_backend(optimizer)
    generator = torch.Generator().manual_seed(11)
    honest_gradients([b], generator)
    b.step(check, audit=True)  # measured
    with torch.no_grad():
        next(b.module.parameters()).view(-1)[0] = float("nan")
    honest_gradients([b], generator)
    outcome = b.step(check, audit=audit)
    assert outcome.broken == "non_finite_weights"
    assert outcome.undone in ("non_finite_gradients", "non_finite_weights")
    assert outcome.judged == ("full" if audit else "refused")
    assert b.updates == 1  # not applied, or undone


def test_an_adam_step_carries_a_lower_bound_of_the_weights_norm_between_passes() -> None:
    # Gradients that pull every weight towards zero: the weights' norm shrinks with
    # every step, so a bound carried without allowing for the step would be above it.
    check = StepCheck(max_ratio=1.0)
    b, plain = cheap_backend("adam"), cheap_backend("adam")
    carried = []
    for _ in range(3 * (CARRIED_STEPS + 1)):
        for expert in (b, plain):
            for p in expert.module.parameters():
                p.grad = torch.sign(p.detach()) + 0.1
        outcome = b.step(check)
        assert plain.step().undone is None
        assert (outcome.judged, outcome.undone, outcome.broken) == ("predicted", None, None)
        memo = b._step_memo
        weights = [p.detach().double() for p in b.module.parameters()]
        norm = math.sqrt(sum(float(w.square().sum()) for w in weights))
        assert math.sqrt(memo.weights_sq) <= norm * (1 + 1e-6), memo.carried
        assert outcome.moved <= 1.0
        carried.append(memo.carried)
    # the weights measured once every CARRIED_STEPS + 1 steps, the steps as unchecked
    assert carried == [*range(1, CARRIED_STEPS + 1), 0] * 3
    assert_same_state(b, plain)


@pytest.mark.parametrize(
    "moments",
    ["a first moment over a zero second", "a huge second moment"],
)
def test_a_replicas_state_gives_its_weights_and_count_never_its_moments(moments: str) -> None:
    """A newcomer takes a replica's weights and update count but starts Adam afresh:
    finite moments Adam could never have made grew the weights from 13 to 1e6 in six
    honest steps (each past the cheap check), and a huge second moment froze them."""
    replica = cheap_backend("adam")
    honest_steps([replica], StepCheck(max_ratio=1.0), steps=3, seed=4)
    state = replica.state()
    for entry in state.optimizer_state.values():
        if moments == "a huge second moment":
            entry["exp_avg_sq"].fill_(1e30)
        else:
            entry["exp_avg"].fill_(1.0)
            entry["exp_avg_sq"].zero_()
    newcomer, fresh = cheap_backend("adam"), cheap_backend("adam")
    newcomer.load_state(state, moments=False)
    fresh.set_parameters(state.params)  # the same weights, an optimizer never stepped
    assert newcomer.updates == 3
    assert newcomer.state().optimizer_state == {}
    check = StepCheck(max_ratio=1.0)
    generator = torch.Generator().manual_seed(8)
    before = {n: p.clone() for n, p in state.params.items()}
    for _ in range(6):
        honest_gradients([newcomer, fresh], generator)
        assert newcomer.step(check).undone is None
        fresh.step()
    after = newcomer.state()
    for name, value in after.params.items():
        assert torch.equal(value, fresh.state().params[name]), name  # Adam's own steps
        assert not torch.equal(value, before[name]), name  # it learns
    assert after.updates == 9
    # From our own checkpoint the moments are kept as they were.
    own = cheap_backend("adam")
    own.load_state(replica.state())
    assert_same_state(own, replica)


def test_a_state_of_more_updates_than_any_expert_makes_is_refused() -> None:
    from volunteerd.errors import CheckpointError

    state = cheap_backend("adam").state()
    b = cheap_backend("adam")
    for updates in (10**40, backend_module.MAX_UPDATES + 1, -1):
        state.updates = updates
        with pytest.raises(CheckpointError, match="updates"):
            b.load_state(state)
    state.updates = backend_module.MAX_UPDATES
    b.load_state(state)


def test_a_count_of_the_most_a_state_may_say_stays_storable_after_steps() -> None:
    # A replica may say 2**53 updates; the newcomer's next step made 2**53 + 1, and
    # every checkpoint of the expert (and every download from it) was refused after.
    from volunteerd.experts.checkpoint_file import decode_checkpoint, encode_checkpoint

    state = cheap_backend("adam").state()
    state.updates = backend_module.MAX_UPDATES
    b = cheap_backend("adam")
    b.load_state(state, moments=False)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        honest_gradients([b], generator)
        assert b.step().undone is None
    assert b.updates == backend_module.MAX_UPDATES
    again = decode_checkpoint(b"".join(encode_checkpoint(b.state())))
    assert again.updates == backend_module.MAX_UPDATES
    assert all(torch.equal(again.params[n], v) for n, v in b.state().params.items())


def test_the_weights_version_says_whether_they_changed_and_not_how_often() -> None:
    """A replica's ``params`` reply carries the token; anyone who fetched once may ask
    "changed since?" for ~220 bytes. It must tell that much and no more: the count of
    writes (every step, refused and undone ones too) went out as it was."""
    a, b = backend(), backend()
    first = a.weights_version()
    assert a.weights_version() == first  # nothing written: the same token
    for _ in range(3):
        a.set_parameters(a.parameter_copies())
        b.set_parameters(b.parameter_copies())
    assert a.weights_version() != first
    name_a, count_a = a.weights_version().split(".")
    name_b, count_b = b.weights_version().split(".")
    assert name_a == first.split(".")[0]
    assert name_a != name_b
    assert count_a != "3"  # keyed per backend: no count to read
    assert count_a != count_b
