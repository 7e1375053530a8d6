"""What a replica serves a newcomer over the ``shard`` verb (``shard_snapshot``): the
weights and update count, not the optimizer state the newcomer would throw away (two
thirds of a trained Adam expert's bytes: 403 MB of an expert of width 2048 did not
arrive over a 2 Mbit/s uplink), and the same bytes for the same state, so a download
resumes across a replica's restart."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
import trio

from volunteerd.config import Config
from volunteerd.experts import ExpertBackend
from volunteerd.experts.checkpoint_file import decode_checkpoint
from volunteerd.runtime import ExpertRuntime
from volunteerd.server.pipeline import shard_snapshot

UID = "ffn.0.0"
HIDDEN = 64


@asynccontextmanager
async def trained_runtime() -> AsyncIterator[ExpertRuntime]:
    """A runtime hosting ``UID`` after one Adam step (so it has moments)."""
    config = Config.model_validate(
        {"experts": {"uids": UID, "hidden_dim": HIDDEN}, "runtime": {"device": "cpu"}}
    )
    runtime = ExpertRuntime(
        [UID], config.experts, config.runtime, config.wire, torch.device("cpu"), guard=config.guard
    )

    def step(backend: ExpertBackend) -> None:
        backend.backward([torch.randn(4, HIDDEN)], [torch.randn(4, HIDDEN)])
        backend.step()

    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)
        await runtime.with_expert(UID, step)
        yield runtime
        nursery.cancel_scope.cancel()


def fresh_expert() -> ExpertBackend:
    config = Config.model_validate({"experts": {"hidden_dim": HIDDEN}})
    return ExpertBackend(UID, config.experts, torch.device("cpu"), 64)


@pytest.mark.parametrize("moments", [False, True], ids=["newcomer", "moments_loader"])
async def test_a_replicas_snapshot_holds_the_weights_only_and_loads_into_a_fresh_expert(
    moments: bool,
) -> None:
    """Both loaders take it: a newcomer's (``moments=False``, every version so far) and
    one that would load moments (a state without them is a fresh optimizer)."""
    async with trained_runtime() as runtime:
        data = await shard_snapshot(runtime)(UID)
        live = await runtime.with_expert(UID, lambda backend: backend.state())
    assert live.optimizer_state  # trained: Adam has its moments here
    state = decode_checkpoint(data)
    assert state.optimizer_state == {}
    weights = sum(t.numel() * t.element_size() for t in live.params.values())
    assert weights < len(data) < weights + (64 << 10)  # was ~3x: the two moments too
    expert = fresh_expert()
    expert.load_state(state, moments=moments)
    assert expert.updates == live.updates == 1
    loaded = expert.parameter_copies()
    assert all(torch.equal(loaded[name], value) for name, value in live.params.items())
    expert.backward([torch.randn(4, HIDDEN)], [torch.randn(4, HIDDEN)])
    expert.step()  # its optimizer starts afresh and steps
    assert expert.updates == 2


async def test_two_snapshots_of_the_same_state_are_the_same_bytes() -> None:
    """The header held the time of encoding: a replica restarted from its checkpoint
    served a new SHA-256 for the same state, and a newcomer's partial download (151
    MiB) started over."""
    async with trained_runtime() as runtime:
        snapshot = shard_snapshot(runtime)
        first = await snapshot(UID)
        await trio.sleep(0.01)
        again = await snapshot(UID)
    assert hashlib.sha256(first).hexdigest() == hashlib.sha256(again).hexdigest()
