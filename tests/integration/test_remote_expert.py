"""RemoteExpert over real libp2p computes exactly what the expert computes locally."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import trio

from volunteerd.experts import make_optimizer
from volunteerd.identity import Identity
from volunteerd.moe import RemoteExpert
from volunteerd.net.background import BackgroundNode
from volunteerd.testing import local_config, open_daemon, open_peer


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
async def test_remote_expert_matches_local_module_and_steps_the_optimizer(
    tmp_path: Path, optimizer: str
) -> None:
    uid = "ffn.0.1"
    optim = {"name": optimizer, "lr": 0.05, "momentum": 0.9 if optimizer == "sgd" else 0.0}
    async with open_peer(local_config()) as boot:
        server_config = local_config(
            bootstrap=boot.multiaddrs,
            uids="ffn.0.[0:2]",
            experts={"hidden_dim": 32, "optimizer": optim},
        )
        async with open_daemon(server_config, tmp_path / "server") as server:
            served = server.runtime.backend(uid).module
            before = copy.deepcopy(served)
            client_config = local_config(bootstrap=boot.multiaddrs)

            def train_step() -> None:
                with BackgroundNode(Identity.generate(), client_config) as node:
                    peers = node.run(node.node.dht.find_expert, uid)
                    assert [p.peer_id for p in peers] == [server.node.peer_id]
                    expert = RemoteExpert(uid, peers[0], node)

                    x = torch.randn(16, 32, requires_grad=True)
                    y = expert(x)
                    x_local = x.detach().clone().requires_grad_()
                    local = copy.deepcopy(before)
                    y_local = local(x_local)
                    torch.testing.assert_close(y, y_local, atol=1e-5, rtol=0)

                    grad = torch.randn_like(y)
                    y.backward(grad)
                    y_local.backward(grad)
                    assert x.grad is not None
                    assert x_local.grad is not None
                    torch.testing.assert_close(x.grad, x_local.grad, atol=1e-5, rtol=0)

                    # The server stepped its own optimizer once with these gradients.
                    make_optimizer(list(local.parameters()), server_config.experts.optimizer).step()
                    for (name, p_server), p_local, p_before in zip(
                        served.named_parameters(),
                        local.parameters(),
                        before.parameters(),
                        strict=True,
                    ):
                        assert not torch.equal(p_server, p_before), f"{name} did not change"
                        torch.testing.assert_close(p_server, p_local, atol=1e-6, rtol=0)

            await trio.to_thread.run_sync(train_step)
            assert server.runtime.backend(uid).updates == 1
