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
    ((grad_b,),) = b.backward_retained([(kept, [g])])
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
    ((grad_x,),) = b.backward_retained([(kept, [g])])
    # The gradient is that of the function the trainer saw (the weights at forward time).
    x_ref = x.clone().requires_grad_()
    at_forward(x_ref).backward(g)
    torch.testing.assert_close(grad_x, x_ref.grad)
    assert b.updates == 4


def test_several_kept_backwards_share_one_step() -> None:
    b = backend()
    items = []
    for _ in range(3):
        x = torch.randn(2, 16)
        _, kept = b.forward_retained([x])
        items.append((kept, [torch.randn(2, 16)]))
    grads = b.backward_retained(items)
    assert len(grads) == 3
    assert b.updates == 1
    assert items[0][0].weights is items[2][0].weights, "one snapshot per optimizer step"
    assert items[0][0].nbytes > 0
