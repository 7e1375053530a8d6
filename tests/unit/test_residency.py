"""Pausing moves the experts (weights, gradient buffers, Adam state) off the device and
back, and they compute the same afterwards. The CUDA case runs where there is a GPU."""

from __future__ import annotations

import pytest
import torch

from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.residency import release_device, restore_device

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


def trained_runtime(device: str) -> ExpertRuntime:
    experts = ExpertsConfig(uids="ffn.0.[0:2]", hidden_dim=64)
    runtime = ExpertRuntime(
        experts.uid_list(),
        experts,
        RuntimeConfig(device=device),
        WireLimits(),
        torch.device(device),
    )
    for uid in runtime.uids:  # one step, so that Adam has state to move
        backend = runtime.backend(uid)
        x = torch.randn(8, 64)
        backend.backward([x], [torch.ones(8, 64)])
        backend.step()
    return runtime


def places(runtime: ExpertRuntime) -> set[str]:
    out = set()
    for uid in runtime.uids:
        backend = runtime.backend(uid)
        for p in backend.module.parameters():
            out.add(p.device.type)
            if p.grad is not None:
                out.add(p.grad.device.type)
        for entry in backend.optimizer.state.values():
            out.update(v.device.type for k, v in entry.items() if k != "step")
    return out


@pytest.mark.parametrize("device", DEVICES)
async def test_release_and_restore_keep_what_the_experts_compute(device: str) -> None:
    runtime = trained_runtime(device)
    x = torch.randn(4, 64)
    before = {uid: runtime.backend(uid).forward([x])[0].cpu() for uid in runtime.uids}
    if device == "cuda":
        used = torch.cuda.memory_allocated()

    await release_device(runtime)
    assert places(runtime) == {"cpu"}
    if device == "cuda":
        assert torch.cuda.memory_allocated() < used

    await restore_device(runtime)
    assert places(runtime) == {device}
    for uid in runtime.uids:
        backend = runtime.backend(uid)
        torch.testing.assert_close(backend.forward([x])[0].cpu(), before[uid])
        backend.backward([x], [torch.ones(4, 64)])
        backend.step()  # the optimizer still works on the moved state
        assert backend.updates == 2
