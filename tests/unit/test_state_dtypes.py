"""A state (a checkpoint, a replica's download) is taken only in its expert's own dtypes:
a float64 1e300 is finite, passed every check, and became an infinity in the float32
weight it was copied into (a newcomer then served NaN for good, and its checkpointer
refused to save it). An update count is bounded when it is decoded."""

from __future__ import annotations

import hashlib
import json
import random
import types

import pytest
import torch

from volunteerd.config import ExperimentsConfig, ExpertsConfig
from volunteerd.experts import ExpertBackend, checkpoint_file
from volunteerd.experts.checkpoint_file import (
    MAX_UPDATES,
    CheckpointError,
    ExpertState,
    decode_checkpoint,
    encode_checkpoint,
)
from volunteerd.net import PeerAddress
from volunteerd.swarm.joiner import Joiner

UID = "ffn.0.0"
HIDDEN = 16


def make(dtype: str = "float32", optimizer: str = "adam") -> ExpertBackend:
    config = ExpertsConfig(
        hidden_dim=HIDDEN, dtype=dtype, optimizer={"name": optimizer, "lr": 0.01}
    )
    return ExpertBackend(UID, config, torch.device("cpu"), 1024)


def trained(dtype: str = "float32", optimizer: str = "adam") -> ExpertBackend:
    b = make(dtype, optimizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4, HIDDEN, generator=generator)
        g = torch.randn(4, HIDDEN, generator=generator)
        b.backward([x], [g])
        b.step()
    return b


def through_the_wire(state: ExpertState) -> ExpertState:
    """What a replica's bytes (or a file's) decode to."""
    return decode_checkpoint(b"".join(bytes(p) for p in encode_checkpoint(state)))


def all_finite(b: ExpertBackend) -> bool:
    tensors = [p.detach() for p in b.module.parameters()]
    tensors += [
        v
        for entry in b.optimizer.state_dict()["state"].values()
        for v in entry.values()
        if isinstance(v, torch.Tensor)
    ]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _huge_float64_weights(state: ExpertState) -> None:
    state.params = {
        k: torch.full_like(v, 1e300, dtype=torch.float64) for k, v in state.params.items()
    }


def _one_float64_weight(state: ExpertState) -> None:
    name = next(iter(state.params))
    state.params[name] = state.params[name].double()


def _bfloat16_weights(state: ExpertState) -> None:
    state.params = {k: v.bfloat16() for k, v in state.params.items()}


def _huge_float64_moments(state: ExpertState) -> None:
    for entry in state.optimizer_state.values():
        entry["exp_avg"] = entry["exp_avg"].double()
        entry["exp_avg_sq"] = torch.full_like(entry["exp_avg_sq"], 1e300, dtype=torch.float64)


def _float16_moment(state: ExpertState) -> None:
    entry = state.optimizer_state[0]
    entry["exp_avg"] = entry["exp_avg"].half()


def _huge_step(state: ExpertState) -> None:
    state.optimizer_state[0]["step"] = torch.tensor(1e300, dtype=torch.float64)


def _step_of_bfloat16(state: ExpertState) -> None:
    state.optimizer_state[0]["step"] = torch.tensor(2.0, dtype=torch.bfloat16)


LIES = {
    "huge_float64_weights": _huge_float64_weights,
    "one_float64_weight": _one_float64_weight,
    "bfloat16_weights": _bfloat16_weights,
    "huge_float64_moments": _huge_float64_moments,
    "float16_moment": _float16_moment,
    "huge_step": _huge_step,
    "step_of_bfloat16": _step_of_bfloat16,
}


@pytest.mark.parametrize("lie", sorted(LIES))
@pytest.mark.parametrize("moments", [True, False])
def test_a_state_not_in_the_experts_own_dtypes_is_refused_and_changes_nothing(
    lie: str, moments: bool
) -> None:
    state = trained().state()
    LIES[lie](state)
    state = through_the_wire(state)
    b = make()
    before = b.state()
    with pytest.raises(CheckpointError):
        b.check_state(state)
    with pytest.raises(CheckpointError):
        b.load_state(state, moments=moments)
    assert all_finite(b)
    assert b.updates == 0
    assert b.revision == 0
    for name, value in b.state().params.items():
        assert torch.equal(value, before.params[name]), name


@pytest.mark.parametrize("wire", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_every_honest_state_is_in_its_experts_dtypes_and_is_taken(
    wire: str, optimizer: str
) -> None:
    """The wire dtype (experts.dtype) is that of activations only: the weights and the
    moments a replica or a checkpoint carries are the expert's own, and are taken."""
    source = trained(wire, optimizer)
    state = through_the_wire(source.state())
    own = dict(source.module.named_parameters())
    assert all(t.dtype == own[n].dtype for n, t in state.params.items())
    for moments in (True, False):
        b = make(wire, optimizer)
        b.load_state(state, moments=moments)
        assert b.updates == 2
        assert all(torch.equal(p, state.params[n]) for n, p in b.parameter_copies().items())
        b.backward([torch.randn(4, HIDDEN)], [torch.randn(4, HIDDEN)])
        b.step()
        assert all_finite(b)


async def test_a_joiner_refused_a_replicas_state_tries_the_next_then_seeds() -> None:
    """The state of a hostile replica (float64 1e300 weights, well formed) is refused
    on load: the newcomer downloads from the next replica, or seeds when none is left;
    it never hosts an infinity."""
    honest = trained()
    asked: list[str] = []

    class Downloads:
        async def download(self, peer: PeerAddress, backend: ExpertBackend) -> ExpertState:
            asked.append(peer.peer_id)
            state = honest.state()
            if peer.peer_id.startswith("hostile"):
                _huge_float64_weights(state)
            return through_the_wire(state)

        async def discard(self, uid: str) -> None:
            pass

    async def run(fn: object) -> object:
        return fn()  # type: ignore[operator]

    joiner = Joiner(
        None,  # type: ignore[arg-type]  # not looked up: the replicas are given
        types.SimpleNamespace(executor=types.SimpleNamespace(run=run)),  # type: ignore[arg-type]
        lambda: None,
        None,
        Downloads(),
        ExperimentsConfig(),
        lambda experts: 1,
        rng=random.Random(5),
    )
    address = ["/ip4/127.0.0.1/tcp/1"]
    replicas = [PeerAddress(p, address) for p in ("hostile1", "hostile2", "honest")]
    newcomer = make()
    assert await joiner._initial_state(newcomer, replicas) == "replica honest"
    assert asked[-1] == "honest"
    assert all(p.startswith("hostile") for p in asked[:-1])
    assert all(
        torch.equal(p, honest.parameter_copies()[n]) for n, p in newcomer.parameter_copies().items()
    )
    assert all_finite(newcomer)

    asked.clear()
    seeded = make()
    source = await joiner._initial_state(seeded, replicas[:2])
    assert source == "seed"
    assert sorted(asked) == ["hostile1", "hostile2"]
    assert all(
        torch.equal(p, make().parameter_copies()[n]) for n, p in seeded.parameter_copies().items()
    )
    assert all_finite(seeded)


def _with_updates(updates: int) -> bytes:
    pieces = encode_checkpoint(trained().state())
    header = json.loads(bytes(pieces[1]))
    header["updates"] = updates
    raw = json.dumps(header).encode()
    magic = bytes(pieces[0])[:8]  # the format the state was encoded in
    prefix = checkpoint_file._PREFIX.pack(magic, len(raw), hashlib.sha256(raw).digest())
    return b"".join([prefix, raw, *(bytes(p) for p in pieces[2:])])


@pytest.mark.parametrize("updates", [MAX_UPDATES + 1, 10**40])
def test_an_update_count_beyond_any_expert_is_refused_when_decoded(updates: int) -> None:
    """Not only the joiner's check: no reader of a file or a replica's bytes gets a
    count it could not publish (JSON and floats are exact up to 2**53)."""
    with pytest.raises(CheckpointError, match="updates"):
        decode_checkpoint(_with_updates(updates))
    assert decode_checkpoint(_with_updates(MAX_UPDATES)).updates == MAX_UPDATES
    state = trained().state()
    state.updates = updates
    with pytest.raises(CheckpointError, match="updates"):
        encode_checkpoint(state)  # nor is one written
