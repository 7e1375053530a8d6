"""The request guard through the real RpcServer and server pipeline, in one process:
non-finite and huge inputs and gradients are refused with the typed wire error before
they reach the optimizer, outliers are clipped or refused, and a peer whose step had to
be undone is banned on every expert of the server (tests/integration/test_poisoning.py
does the same against a real daemon over libp2p)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from volunteerd.errors import RemoteError
from volunteerd.experts import from_wire, to_wire
from volunteerd.net import Verb
from volunteerd.testing import local_config
from volunteerd.testing.inprocess import InProcessServer, Peer, open_world
from volunteerd.wire import BackwardRequest, ForwardRequest

HIDDEN = 16


async def forward(peer: Peer, server: InProcessServer, uid: str, x: torch.Tensor) -> torch.Tensor:
    meta, data = to_wire(x)
    header = ForwardRequest(uid=uid, tensors=[meta])
    _, tensors = await peer.rpc.call(server.address, Verb.FORWARD, header, [data])
    return from_wire(tensors[0])


async def backward(
    peer: Peer, server: InProcessServer, uid: str, x: torch.Tensor, grads: torch.Tensor
) -> Any:
    """A stateless backward (inputs and output gradients)."""
    (mx, bx), (mg, bg) = to_wire(x), to_wire(grads)
    header = BackwardRequest(uid=uid, tensors=[mx, mg])
    return await peer.rpc.call(server.address, Verb.BACKWARD, header, [bx, bg])


def one_row(value: float | None = None, at: tuple[int, int] | None = None) -> torch.Tensor:
    t = torch.randn(1, HIDDEN)
    if at is not None:
        t[at] = value
    elif value is not None:
        t.fill_(value)
    return t


# name -> (inputs, output gradients, what the guard counts)
ATTACKS = {
    "one input of 3e38": (one_row(3e38, at=(0, 0)), one_row(), "input_out_of_range"),
    "inputs of 1e20": (one_row(1e20), one_row(), "input_out_of_range"),
    "a NaN input": (one_row(float("nan"), at=(0, 3)), one_row(), "non_finite_input"),
    "gradients of 3e38": (one_row(), one_row(3e38), "gradient_out_of_range"),
    "gradients of 1e30": (one_row(), one_row(1e30), "gradient_out_of_range"),
    "infinite gradients": (one_row(), one_row(float("inf")), "non_finite_gradient"),
}


@contextlib.asynccontextmanager
async def one_expert_two_peers() -> AsyncIterator[tuple[InProcessServer, Peer, Peer]]:
    """A server hosting ``ffn.0.0`` with the default guard, an honest peer and a stranger."""
    async with (
        open_world(local_config(experts={"hidden_dim": HIDDEN})) as world,
        world.open_peer() as honest,
        world.open_peer() as stranger,
    ):
        yield await world.add_server("ffn.0.0"), honest, stranger


async def test_each_single_request_attack_is_refused_and_changes_nothing() -> None:
    probe = torch.randn(8, HIDDEN)
    async with one_expert_two_peers() as (server, honest, stranger):
        before = await forward(honest, server, "ffn.0.0", probe)
        counts = server.runtime.guard.counts
        for name, (x, grads, reason) in ATTACKS.items():
            seen = counts[(stranger.peer_id, reason)]
            with pytest.raises(RemoteError) as refused:
                await backward(stranger, server, "ffn.0.0", x, grads)
            assert refused.value.code == "rejected", name
            assert counts[(stranger.peer_id, reason)] == seen + 1, name
        with pytest.raises(RemoteError, match="above the bound") as refused:
            await forward(stranger, server, "ffn.0.0", one_row(1e20))
        assert refused.value.code == "rejected"
        await server.runtime.settled()
        assert server.runtime.backend("ffn.0.0").updates == 0
        assert torch.equal(await forward(honest, server, "ffn.0.0", probe), before)
        assert server.runtime.guard.by_peer() == {
            stranger.peer_id: {
                "input_out_of_range": 3,
                "non_finite_input": 1,
                "gradient_out_of_range": 2,
                "non_finite_gradient": 1,
            }
        }


async def test_backwards_with_nothing_to_learn_make_no_optimizer_step() -> None:
    """All-zero gradients: Adam would still move the weights by its momentum and count
    an update, so a peer could add steps (and advance the expert's schedule) at its
    request rate. Such backwards are answered and step nothing (an empty batch is
    refused as bad_shape before it gets here)."""
    probe = torch.randn(8, HIDDEN)
    async with one_expert_two_peers() as (server, honest, stranger):
        backend = server.runtime.backend("ffn.0.0")
        await backward(honest, server, "ffn.0.0", torch.randn(8, HIDDEN), torch.randn(8, HIDDEN))
        await server.runtime.settled()
        assert backend.updates == 1  # Adam now has momentum to move the weights with
        before = await forward(honest, server, "ffn.0.0", probe)
        for _ in range(10):
            x = torch.randn(8, HIDDEN)
            await backward(stranger, server, "ffn.0.0", x, torch.zeros(8, HIDDEN))
            await server.runtime.settled()
        assert backend.updates == 1
        assert torch.equal(await forward(honest, server, "ffn.0.0", probe), before)
        await backward(honest, server, "ffn.0.0", torch.randn(8, HIDDEN), torch.randn(8, HIDDEN))
        await server.runtime.settled()
        assert backend.updates == 2


async def test_a_warmed_up_expert_refuses_far_outliers_and_clips_moderate_ones() -> None:
    config = local_config(experts={"hidden_dim": HIDDEN}, guard={"warmup": 8})
    async with open_world(config) as world, world.open_peer() as trainer:
        server = await world.add_server("ffn.0.0")
        backend = server.runtime.backend("ffn.0.0")
        x = torch.randn(8, HIDDEN)

        def ordinary() -> torch.Tensor:
            # Rows of one norm: random rows of 16 values made the first request's few
            # norms the only statistics, and a later warm-up row above all of them was
            # clipped in ~4 % of runs.
            return torch.nn.functional.normalize(torch.randn(8, HIDDEN), dim=1) * 0.04

        for _ in range(4):  # warm up on ordinary gradients
            await backward(trainer, server, "ffn.0.0", x, ordinary())
        await server.runtime.settled()
        weights = [p.detach().clone() for p in backend.module.parameters()]

        with pytest.raises(RemoteError, match="far above") as refused:
            await backward(trainer, server, "ffn.0.0", x, torch.randn(8, HIDDEN) * 1e6)
        assert refused.value.code == "rejected"
        await server.runtime.settled()
        for before, after in zip(weights, backend.module.parameters(), strict=True):
            assert torch.equal(before, after), "refused gradients were not applied"

        grads = ordinary()
        grads[0] *= 50  # a moderate outlier row: clipped to the threshold and applied
        module = copy.deepcopy(backend.module)  # the weights this backward runs on
        _, answered = await backward(trainer, server, "ffn.0.0", x, grads)
        await server.runtime.settled()
        assert server.runtime.guard.by_peer()[trainer.peer_id] == {
            "outlier_gradient": 1,
            "clipped": 1,
        }
        assert backend.updates == 5
        # Clipping guards the expert's weights; the trainer's input gradients are those
        # of the gradients it sent (they were those of the clipped rows, silently).
        wanted = x.clone().requires_grad_()
        module(wanted).backward(grads)
        assert wanted.grad is not None
        got = from_wire(answered[0]).float()
        assert torch.allclose(got, wanted.grad, rtol=1e-4, atol=1e-6)
        # the same through a kept forward
        meta, data = to_wire(x)
        kept, _ = await trainer.rpc.call(
            server.address,
            Verb.FORWARD,
            ForwardRequest(uid="ffn.0.0", tensors=[meta], retain=True),
            [data],
        )
        module = copy.deepcopy(backend.module)
        mg, bg = to_wire(grads)
        header = BackwardRequest(uid="ffn.0.0", tensors=[mg], handle=kept.handle)
        _, answered = await trainer.rpc.call(server.address, Verb.BACKWARD, header, [bg])
        assert server.runtime.guard.by_peer()[trainer.peer_id]["clipped"] == 2
        wanted = x.clone().requires_grad_()
        module(wanted).backward(grads)
        assert wanted.grad is not None
        assert torch.allclose(from_wire(answered[0]).float(), wanted.grad, rtol=1e-4, atol=1e-6)


async def test_a_peer_whose_step_was_undone_is_banned_on_every_expert() -> None:
    """SGD, a guard that has not warmed up, gradients just under the bound: the step
    would move the weights far; it is undone and its sender refused from then on."""
    config = local_config(
        experts={"hidden_dim": HIDDEN, "optimizer": {"name": "sgd", "lr": 0.01}},
        guard={"warmup": 10_000},
    )
    probe = torch.randn(8, HIDDEN)
    async with (
        open_world(config) as world,
        world.open_peer() as honest,
        world.open_peer() as stranger,
    ):
        server = await world.add_server("ffn.0.[0:2]")
        before = await forward(honest, server, "ffn.0.0", probe)
        await backward(stranger, server, "ffn.0.0", one_row(), one_row(9e5))  # "ok"
        await server.runtime.settled()
        assert torch.equal(await forward(honest, server, "ffn.0.0", probe), before), "undone"
        assert server.runtime.guard.undone == {("ffn.0.0", "too_large_step"): 1}
        for uid in ("ffn.0.0", "ffn.0.1"):
            with pytest.raises(RemoteError, match="refused for") as refused:
                await forward(stranger, server, uid, probe)
            assert refused.value.code == "rejected"
        assert server.runtime.guard.by_peer()[stranger.peer_id] == {
            "step_undone": 1,
            "banned": 2,
        }
        await forward(honest, server, "ffn.0.1", probe)  # the honest trainer is served


async def test_identities_at_one_address_count_once_in_the_gradient_statistics() -> None:
    """Two strangers whispering tiny gradients against one honest trainer owned the
    threshold (the median of each peer's 99th percentile was theirs) and every honest
    backward was refused as far above it. Identities cost nothing: both strangers dial
    from one address, and the guard counts them as one peer."""
    torch.manual_seed(2)
    async with (
        open_world(local_config(experts={"hidden_dim": HIDDEN})) as world,
        world.open_peer(ip="198.51.100.1") as honest,
        world.open_peer(ip="203.0.113.7") as first,
        world.open_peer(ip="203.0.113.7") as second,
    ):
        server = await world.add_server("ffn.0.0")
        for _ in range(2):
            x, grads = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN) * 0.1
            await backward(honest, server, "ffn.0.0", x, grads)
        for _ in range(20):
            for stranger in (first, second):
                x = torch.randn(64, HIDDEN)
                await backward(stranger, server, "ffn.0.0", x, torch.full((64, HIDDEN), 1e-7))
        guard = server.runtime.guard
        threshold = guard.threshold("ffn.0.0")
        assert threshold is not None
        assert threshold > 0.1  # honest rows are ~0.4; the strangers' alone gave ~4e-7
        for _ in range(5):  # accepted, at most clipped: never refused
            x, grads = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN) * 0.1
            await backward(honest, server, "ffn.0.0", x, grads)
        assert (honest.peer_id, "outlier_gradient") not in guard.counts
