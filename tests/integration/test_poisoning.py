"""One request must not wreck an expert for everyone (issue 12, item 3).

A real serving daemon on 127.0.0.1 and, over the real wire, a stranger (a fresh
identity) that sends one stateless backward of one sample: an input holding one finite
float32 3e38, inputs of 1e20, output gradients of 3e38 as the first request on a fresh
expert, gradients of 1e30. Before the fix each was answered ``ok`` and left NaN weights
(or an infinite Adam second moment) that the checkpointer then saved. Now each is refused
before it reaches the optimizer, and a request that passes the bounds but would still
wreck a step (SGD, gradients just under the bound) has its step undone and its sender
banned, while an honest trainer's requests go on training the expert.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from volunteerd.daemon import Running
from volunteerd.errors import RemoteError
from volunteerd.experts import ExpertBackend, to_wire
from volunteerd.net import Node, Verb
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.wire import BackwardRequest, ForwardRequest, WireTensor

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow

HIDDEN = 32
UIDS = "ffn.0.[0:5]"

# (uid attacked, inputs, output gradients, what the guard counts); each is the first
# request its expert ever gets.
ATTACKS: dict[str, tuple[str, str, str, str]] = {
    "one input of 3e38": ("ffn.0.0", "3e38 at [0, 0]", "randn", "input_out_of_range"),
    "inputs of 1e20": ("ffn.0.1", "all 1e20", "randn", "input_out_of_range"),
    "gradients of 3e38, first request": ("ffn.0.2", "randn", "all 3e38", "gradient_out_of_range"),
    "gradients of 1e30": ("ffn.0.3", "randn", "all 1e30", "gradient_out_of_range"),
}


def tensor(kind: str, generator: torch.Generator) -> torch.Tensor:
    t = torch.randn(1, HIDDEN, generator=generator)
    if kind == "3e38 at [0, 0]":
        t[0, 0] = 3e38  # finite in float32
    elif kind.startswith("all "):
        t.fill_(float(kind.removeprefix("all ")))
    return t


def decoded(tensors: list[WireTensor], shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(tensors[0].data), dtype=torch.float32).view(shape)


async def forward(client: Node, server: Running, uid: str, x: torch.Tensor) -> torch.Tensor:
    meta, data = to_wire(x)
    header = ForwardRequest(uid=uid, tensors=[meta])
    _, tensors = await client.rpc.call(server.node.address, Verb.FORWARD, header, [data])
    return decoded(tensors, tuple(x.shape))


async def backward(
    client: Node, server: Running, uid: str, x: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    """A stateless backward (inputs and output gradients); returns the input gradient."""
    (mx, bx), (mg, bg) = to_wire(x), to_wire(g)
    header = BackwardRequest(uid=uid, tensors=[mx, mg])
    _, tensors = await client.rpc.call(server.node.address, Verb.BACKWARD, header, [bx, bg])
    return decoded(tensors, tuple(x.shape))


def optimizer_state_is_finite(backend: ExpertBackend) -> bool:
    return all(
        bool(torch.isfinite(value).all())
        for entry in backend.optimizer.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    )


def weights(backend: ExpertBackend) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in backend.module.parameters()])


@asynccontextmanager
async def serving(
    tmp_path: Path, guard: dict[str, Any] | None = None, **experts: Any
) -> AsyncIterator[tuple[Running, Node, Node]]:
    """A daemon, an honest trainer and a stranger, all on 127.0.0.1."""
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs,
            uids=UIDS,
            experts={"hidden_dim": HIDDEN, **experts},
            guard=guard or {},
        )
        async with (
            open_daemon(config, tmp_path / "d") as server,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as honest,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as stranger,
        ):
            yield server, honest, stranger


async def train(
    client: Node, server: Running, uid: str, x: torch.Tensor, target: torch.Tensor, steps: int
) -> list[float]:
    """An honest trainer: mean squared error to ``target``, one backward per step."""
    losses = []
    for _ in range(steps):
        y = await forward(client, server, uid, x)
        losses.append(float(((y - target) ** 2).mean()))
        await backward(client, server, uid, x, 2 * (y - target) / y.numel())
        await server.runtime.settled()  # the step runs right after the reply
    return losses


async def test_each_single_request_attack_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(8, HIDDEN, generator=generator)
    async with serving(tmp_path) as (server, honest, stranger):
        runtime = server.runtime
        before = {uid: await forward(honest, server, uid, probe) for uid in runtime.uids}
        for name, (uid, inputs, grads, reason) in ATTACKS.items():
            x, g = tensor(inputs, generator), tensor(grads, generator)
            with pytest.raises(RemoteError, match="above the bound") as refused:
                await backward(stranger, server, uid, x, g)
            assert refused.value.code == "rejected", name
            assert runtime.guard.counts[(stranger.peer_id, reason)] >= 1, name
            await runtime.settled()
            after = await forward(honest, server, uid, probe)
            assert torch.isfinite(after).all(), name
            assert torch.equal(after, before[uid]), f"{name} changed {uid}"
            backend = runtime.backend(uid)
            assert backend.updates == 0, name
            assert optimizer_state_is_finite(backend), name
        # The same through a kept forward: the gradients are judged the same way.
        meta, data = to_wire(probe[:1])
        reply, _ = await stranger.rpc.call(
            server.node.address,
            Verb.FORWARD,
            ForwardRequest(uid="ffn.0.4", tensors=[meta], retain=True),
            [data],
        )
        gm, gd = to_wire(torch.full((1, HIDDEN), 3e38))
        with pytest.raises(RemoteError, match="above the bound"):
            await stranger.rpc.call(
                server.node.address,
                Verb.BACKWARD,
                BackwardRequest(uid="ffn.0.4", tensors=[gm], handle=reply.handle),
                [gd],
            )
        await runtime.settled()
        assert torch.equal(await forward(honest, server, "ffn.0.4", probe), before["ffn.0.4"])

        counts = runtime.guard.by_peer()[stranger.peer_id]
        assert counts == {"input_out_of_range": 2, "gradient_out_of_range": 3}
        assert runtime.step_check is not None
        assert runtime.step_check.undone == 0  # nothing got as far as a step

        # An honest trainer's requests still train every expert it uses.
        target = torch.tanh(probe)
        for uid in ("ffn.0.0", "ffn.0.2"):
            start = weights(runtime.backend(uid))
            losses = await train(honest, server, uid, probe, target, steps=6)
            assert runtime.backend(uid).updates == 6
            assert not torch.equal(weights(runtime.backend(uid)), start)
            assert losses[-1] < losses[0], losses
        # Each expert's first step came before its guard knew 16 gradient rows and got
        # the full check; the other ten were applied on their bounds, copying nothing.
        assert (runtime.step_check.full, runtime.step_check.predicted) == (2, 10)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
async def test_a_request_under_the_bounds_cannot_move_the_weights_far(
    tmp_path: Path, optimizer: str
) -> None:
    """Gradients just under the bound (9e5, where honest ones are ~0.01) from a stranger,
    to an expert whose guard has not warmed up (a warmed-up guard refuses them as far
    above what the expert gets): the worst case, only the absolute bounds stand. With
    SGD the step would move the weights thousands of times their norm: it is undone
    exactly and the stranger is banned. Adam divides by the gradients' RMS: the step
    moves each weight by at most ~3 learning rates, and is kept."""
    uid, lr = "ffn.0.0", 0.01
    generator = torch.Generator().manual_seed(1)
    probe = torch.randn(8, HIDDEN, generator=generator)
    target = torch.tanh(probe)
    cold = {"warmup": 10_000}
    async with serving(tmp_path, cold, optimizer={"name": optimizer, "lr": lr}) as (
        server,
        honest,
        stranger,
    ):
        runtime = server.runtime
        backend = runtime.backend(uid)
        losses = await train(honest, server, uid, probe, target, steps=2)
        before = await forward(honest, server, uid, probe)
        weights_before = weights(backend)
        state_before = backend.state()

        x = torch.randn(1, HIDDEN, generator=generator)
        await backward(stranger, server, uid, x, torch.full((1, HIDDEN), 9e5))  # "ok"
        await runtime.settled()
        after = await forward(honest, server, uid, probe)
        assert torch.isfinite(after).all()
        assert optimizer_state_is_finite(backend)

        if optimizer == "sgd":
            assert torch.equal(after, before), "the step was undone exactly"
            assert backend.updates == 2
            state = backend.state()
            for index, entry in state_before.optimizer_state.items():
                for key, value in entry.items():
                    assert torch.equal(state.optimizer_state[index][key], value)
            assert runtime.guard.undone == {(uid, "too_large_step"): 1}
            # Banned: every later request of the stranger is refused, on every expert.
            for other in (uid, "ffn.0.1"):
                with pytest.raises(RemoteError, match="refused for") as refused:
                    await forward(stranger, server, other, probe)
                assert refused.value.code == "rejected"
            assert runtime.guard.by_peer()[stranger.peer_id] == {"step_undone": 1, "banned": 2}
        else:
            assert backend.updates == 3
            moved = float((weights(backend) - weights_before).norm())
            assert 0 < moved <= 4 * lr * math.sqrt(weights_before.numel())
            assert runtime.guard.undone == {}
        assert honest.peer_id not in runtime.guard.banned()

        # The honest trainer goes on training the expert.
        start = weights(backend)
        losses += await train(honest, server, uid, probe, target, steps=8)
        assert not torch.equal(weights(backend), start)
        assert losses[-1] < losses[0], losses
