"""ExpertBackend: the kept-graph backward gives the stateless backward's gradients,
even when other optimizer steps happen in between."""

from __future__ import annotations

import copy

import torch

from volunteerd.config import ExpertsConfig
from volunteerd.experts import ExpertBackend


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
    assert all(p.grad is not None and not p.grad.any() for p in b.module.parameters())


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
