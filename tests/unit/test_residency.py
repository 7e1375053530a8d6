"""Pausing moves the experts (weights, gradient buffers, Adam state) off the device and
back, and they compute the same afterwards. The CUDA case runs where there is a GPU."""

from __future__ import annotations

import pytest
import torch

from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.experts import ExpertBackend
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.residency import _empty_cache, release_device, restore_device

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
        for entry in backend.optimizer.state.values():  # fused Adam's steps too
            out.update(v.device.type for v in entry.values())
    return out


@pytest.mark.parametrize("device", DEVICES)
async def test_release_and_restore_keep_what_the_experts_compute(device: str) -> None:
    if device == "cuda":  # what tests before this one left (cuBLAS's workspaces too)
        _empty_cache(torch.device("cuda"))
        base = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    runtime = trained_runtime(device)
    x = torch.randn(4, 64)
    before = {uid: runtime.backend(uid).forward([x])[0].cpu() for uid in runtime.uids}
    if device == "cuda":
        assert torch.cuda.memory_allocated() > base[0]

    await release_device(runtime)
    assert places(runtime) == {"cpu"}
    if device == "cuda":  # nothing of the experts is left on the GPU, not even its cache
        assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == base

    await restore_device(runtime)
    assert places(runtime) == {device}
    for uid in runtime.uids:
        backend = runtime.backend(uid)
        torch.testing.assert_close(backend.forward([x])[0].cpu(), before[uid])
        backend.backward([x], [torch.ones(4, 64)])
        backend.step()  # the optimizer still works on the moved state
        assert backend.updates == 2


@pytest.mark.parametrize(("fused", "steps_on"), [(True, "meta"), (False, "cpu")])
def test_adam_step_counts_move_only_where_torch_keeps_them_beside_the_weights(
    fused: bool, steps_on: str
) -> None:
    # "meta" stands in for a GPU: a fused Adam keeps its step counts beside the weights
    # (left behind on a paused GPU they kept cache blocks there), the others on the CPU
    backend = ExpertBackend("ffn.0.0", ExpertsConfig(hidden_dim=16), torch.device("cpu"), 64)
    backend.optimizer = torch.optim.Adam(backend.module.parameters(), fused=fused)
    backend.backward([torch.randn(4, 16)], [torch.ones(4, 16)])
    backend.step()

    backend.move_to(torch.device("meta"))
    state = list(backend.optimizer.state.values())
    assert {entry["exp_avg"].device.type for entry in state} == {"meta"}
    assert {entry["step"].device.type for entry in state} == {steps_on}
