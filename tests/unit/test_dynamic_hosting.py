"""Experts added to and removed from a running ExpertRuntime: a removed expert finishes
the requests it had queued, refuses new ones, and keeps its weights for a last save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from volunteerd.config import CheckpointConfig, ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.errors import ShuttingDown, UnknownExpert
from volunteerd.experts import to_wire
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.checkpointer import Checkpointer
from volunteerd.wire import WireTensor

HIDDEN = 16
EXPERTS = ExpertsConfig(hidden_dim=HIDDEN)


def runtime() -> ExpertRuntime:
    config = RuntimeConfig(device="cpu", max_batch_wait_s=0.05)
    return ExpertRuntime([], EXPERTS, config, WireLimits(), torch.device("cpu"))


def inputs(rows: int = 2) -> list[WireTensor]:
    meta, data = to_wire(torch.randn(rows, HIDDEN))
    return [WireTensor(meta.dtype, meta.shape, memoryview(bytearray(data)))]


async def test_added_expert_serves_and_removed_one_drains_then_refuses() -> None:
    rt = runtime()
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        assert rt.uids == []
        await rt.add_expert(rt.make_backend("ffn.0.0", EXPERTS))
        await rt.add_expert(rt.make_backend("ffn.0.1", EXPERTS))
        with pytest.raises(ValueError, match="hosted already"):
            await rt.add_expert(rt.make_backend("ffn.0.0", EXPERTS))
        reply, _ = await rt.forward("ffn.0.0", inputs())
        assert reply.tensors[0].shape == (2, HIDDEN)

        answered: list[int] = []

        async def call(i: int) -> None:
            await rt.forward("ffn.0.0", inputs())
            answered.append(i)

        async with trio.open_nursery() as calls:
            for i in range(8):
                calls.start_soon(call, i)
            await trio.sleep(0.01)  # queued, waiting for their batch
            backend = await rt.remove_expert("ffn.0.0")
            # Everything queued before the removal was answered by the time it returned.
            assert sorted(answered) == list(range(8))
        assert backend.uid == "ffn.0.0"
        assert rt.uids == ["ffn.0.1"]
        with pytest.raises(UnknownExpert):
            await rt.forward("ffn.0.0", inputs())
        with pytest.raises(UnknownExpert):
            await rt.remove_expert("ffn.0.0")
        await rt.forward("ffn.0.1", inputs())  # the other expert is untouched
        rt.close()
        with pytest.raises(ShuttingDown):
            await rt.add_expert(rt.make_backend("ffn.0.2", EXPERTS))
    await rt.drained()


async def test_removed_expert_is_saved_and_restored_when_it_returns(tmp_path: Path) -> None:
    rt = runtime()
    saver = Checkpointer(rt, tmp_path, CheckpointConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        backend = rt.make_backend("ffn.1.1", EXPERTS)
        assert await saver.restore_into(backend) is None
        await rt.add_expert(backend)
        await rt.with_expert("ffn.1.1", lambda b: b.set_parameters(
            {k: v + 1 for k, v in b.parameter_copies().items()}
        ))  # fmt: skip
        weights = await rt.with_expert("ffn.1.1", lambda b: b.parameter_copies())
        await saver.save(await rt.remove_expert("ffn.1.1"))
        assert saver.has_checkpoint("ffn.1.1")

        again = rt.make_backend("ffn.1.1", EXPERTS)
        assert await saver.restore_into(again) is not None
        for name, value in again.parameter_copies().items():
            assert torch.equal(value, weights[name])
        rt.close()
