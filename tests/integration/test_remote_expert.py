"""RemoteExpert over real libp2p computes exactly what the expert computes locally,
through the kept-graph backward, the stateless one, and the fallback between them."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
import trio

from volunteerd.errors import BadDtype, BadShape
from volunteerd.experts import make_optimizer
from volunteerd.identity import Identity
from volunteerd.moe import RemoteExpert
from volunteerd.net import open_node
from volunteerd.net.background import BackgroundNode
from volunteerd.runtime import ExpertRuntime
from volunteerd.server.pipeline import expert_handlers
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.testing.faulty import Fault, Faults, int64_min, one_row_short, wider

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow

UID = "ffn.0.1"


@pytest.mark.parametrize(
    ("optimizer", "retain_mb", "retain_s", "path"),
    [
        ("adam", 256, 60.0, "kept"),
        ("sgd", 256, 60.0, "kept"),
        ("adam", 0, 60.0, "stateless"),
        ("sgd", 256, 0.3, "fallback"),  # the kept forward expires before the backward
    ],
)
async def test_remote_expert_matches_local_module_and_steps_the_optimizer(
    tmp_path: Path, optimizer: str, retain_mb: int, retain_s: float, path: str
) -> None:
    optim = {"name": optimizer, "lr": 0.05, "momentum": 0.9 if optimizer == "sgd" else 0.0}
    async with open_peer(local_config()) as boot:
        server_config = local_config(
            bootstrap=boot.multiaddrs,
            uids="ffn.0.[0:2]",
            experts={"hidden_dim": 32, "optimizer": optim},
            runtime={"retain_activations_mb": retain_mb, "retain_s": retain_s},
        )
        async with open_daemon(server_config, tmp_path / "server") as server:
            served = server.runtime.backend(UID).module
            before = copy.deepcopy(served)
            client_config = local_config(bootstrap=boot.multiaddrs)

            def train_step() -> torch.nn.Module:
                with BackgroundNode(Identity.generate(), client_config) as node:
                    peers = node.run(node.node.dht.find_expert, UID)
                    assert [p.peer_id for p in peers] == [server.node.peer_id]
                    expert = RemoteExpert(UID, peers[0], node)

                    x = torch.randn(16, 32, requires_grad=True)
                    y = expert(x)
                    x_local = x.detach().clone().requires_grad_()
                    local = copy.deepcopy(before)
                    y_local = local(x_local)
                    torch.testing.assert_close(y, y_local, atol=1e-5, rtol=0)

                    if path == "fallback":
                        time.sleep(retain_s + 0.2)
                    grad = torch.randn_like(y)
                    y.backward(grad)
                    y_local.backward(grad)
                    assert x.grad is not None
                    assert x_local.grad is not None
                    torch.testing.assert_close(x.grad, x_local.grad, atol=1e-5, rtol=0)

                    make_optimizer(list(local.parameters()), server_config.experts.optimizer).step()
                    return local

            local = await trio.to_thread.run_sync(train_step)
            # The server stepped its own optimizer once with these gradients (right after
            # answering the backward).
            await server.runtime.settled()
            assert server.runtime.backend(UID).updates == 1
            for (name, p_server), p_local, p_before in zip(
                served.named_parameters(), local.parameters(), before.parameters(), strict=True
            ):
                assert not torch.equal(p_server, p_before), f"{name} did not change"
                torch.testing.assert_close(p_server, p_local, atol=1e-6, rtol=0)
            kept = server.runtime.retained_statistics()
            expected_hits = {"kept": 1, "stateless": 0, "fallback": 0}[path]
            assert kept.hits == expected_hits
            assert kept.entries == 0, "nothing is left behind"


async def test_no_grad_forward_keeps_nothing_on_the_server(tmp_path: Path) -> None:
    async with (
        open_peer(local_config()) as boot,
        open_daemon(
            local_config(bootstrap=boot.multiaddrs, uids="ffn.0.[0:2]"), tmp_path / "s"
        ) as server,
    ):
        client_config = local_config(bootstrap=boot.multiaddrs)

        def infer() -> None:
            with BackgroundNode(Identity.generate(), client_config) as node:
                expert = RemoteExpert(UID, server.node.address, node)
                with torch.no_grad():
                    assert expert(torch.randn(3, 32)).shape == (3, 32)

        await trio.to_thread.run_sync(infer)
        assert server.runtime.retained_statistics().entries == 0
        assert server.runtime.backend(UID).updates == 0


async def test_compression_halves_the_bytes_both_ways_and_keeps_the_result(
    tmp_path: Path,
) -> None:
    async with (
        open_peer(local_config()) as boot,
        open_daemon(
            local_config(
                bootstrap=boot.multiaddrs,
                uids="ffn.0.[0:2]",
                experts={"hidden_dim": 256},
                runtime={"retain_activations_mb": 0},  # the backward resends the inputs too
            ),
            tmp_path / "s",
        ) as server,
    ):
        stats = server.node.server.stats
        module = server.runtime.backend(UID).module
        x = torch.randn(64, 256)
        with torch.no_grad():
            expected = module(x)
        client_config = local_config(bootstrap=boot.multiaddrs)

        def step(node: BackgroundNode, compression: str) -> tuple[torch.Tensor, int, int]:
            expert = RemoteExpert(UID, server.node.address, node, compression=compression)
            expert.info  # noqa: B018 (fetched before counting)
            before = stats.bytes_in, stats.bytes_out
            inputs = x.clone().requires_grad_()
            out = expert(inputs)
            out.square().mean().backward()
            assert inputs.grad is not None
            assert torch.isfinite(inputs.grad).all()
            assert out.dtype == inputs.grad.dtype == torch.float32
            return out.detach(), stats.bytes_in - before[0], stats.bytes_out - before[1]

        def run() -> dict[str, tuple[torch.Tensor, int, int]]:
            with BackgroundNode(Identity.generate(), client_config) as node:
                with torch.no_grad():
                    # The first forward, against weights no step has moved yet.
                    first = RemoteExpert(UID, server.node.address, node, compression="float16")
                    torch.testing.assert_close(first(x), expected, atol=2e-2, rtol=1e-2)
                return {c: step(node, c) for c in ("none", "float16", "q8")}

        results = await trio.to_thread.run_sync(run)
        _, plain_in, plain_out = results["none"]
        _, half_in, half_out = results["float16"]
        _, q8_in, q8_out = results["q8"]
        # forward: x, then out; backward: x and d out, then d x: 64 x 256 float32 = 64 KiB
        assert plain_in > 3 * 64 * 1024
        assert plain_out > 2 * 64 * 1024
        assert half_in < 0.55 * plain_in
        assert half_out < 0.55 * plain_out
        assert q8_in < 0.3 * plain_in
        assert q8_out < 0.3 * plain_out
        await server.runtime.settled()
        assert server.runtime.backend(UID).updates == 3


@pytest.mark.parametrize(
    "fault",
    [
        Fault(outputs=one_row_short),
        Fault(outputs=wider),
        Fault(gradients=one_row_short),
        Fault(gradients=wider),
        Fault(outputs=int64_min),
        Fault(gradients=int64_min),
    ],
    ids=[
        "short_outputs",
        "wider_outputs",
        "short_gradients",
        "wider_gradients",
        "int64_outputs",
        "int64_gradients",
    ],
)
async def test_an_answer_of_the_wrong_shape_is_a_clear_error(fault: Fault) -> None:
    """A server whose answers do not fit what was sent (a real expert runtime behind
    real libp2p, its answers reshaped on the way out) gets a BadShape naming it, not a
    tensor of the wrong size in the caller's graph."""
    config = local_config(uids=UID, experts={"hidden_dim": 32})
    runtime = ExpertRuntime(
        [UID], config.experts, config.runtime, config.wire, torch.device("cpu"), guard=config.guard
    )
    handlers = Faults(fault).wrap(expert_handlers(runtime))
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)
        async with open_node(Identity.generate(), config, handlers) as server:

            def call() -> None:
                with BackgroundNode(Identity.generate(), local_config()) as node:
                    expert = RemoteExpert(UID, server.address, node)
                    x = torch.randn(8, 32, requires_grad=True)
                    with pytest.raises((BadShape, BadDtype), match=f"{UID} at .* answered a"):
                        expert(x).sum().backward()
                    assert x.grad is None

            await trio.to_thread.run_sync(call)
        nursery.cancel_scope.cancel()
