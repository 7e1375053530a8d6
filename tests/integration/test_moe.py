"""RemoteMixtureOfExperts over a real local swarm matches the same mixture run locally.

Routing, k_min and grace, failover and backtracking are tested in more cases in process
on memory links (tests/inprocess/test_trainer.py); here the real stack end to end."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import trio

from volunteerd.moe import (
    LocalMixtureOfExperts,
    NoExpertsAvailable,
    RemoteMixtureOfExperts,
    SwarmClient,
)
from volunteerd.testing import local_config, open_daemon, open_peer

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow

HIDDEN = 16


@pytest.mark.parametrize(("k_best", "k_min"), [(2, 1)])
async def test_remote_mixture_matches_local_mixture(
    tmp_path: Path, k_best: int, k_min: int
) -> None:
    async with open_peer(local_config()) as boot:

        def server(uids: str) -> object:
            return local_config(
                bootstrap=boot.multiaddrs, uids=uids, experts={"hidden_dim": HIDDEN}
            )

        async with (
            open_daemon(server("ffn.[0:2].[0:4]"), tmp_path / "a") as a,
            open_daemon(server("ffn.[2:4].[0:4]"), tmp_path / "b") as b,
        ):
            modules = {
                uid: copy.deepcopy(d.runtime.backend(uid).module)
                for d in (a, b)
                for uid in d.runtime.uids
            }
            client_config = local_config(bootstrap=boot.multiaddrs)

            def compare() -> None:
                torch.manual_seed(0)
                with SwarmClient(client_config) as client:
                    remote = RemoteMixtureOfExperts(
                        HIDDEN, (4, 4), "ffn.", k_best=k_best, k_min=k_min,
                        grace_after_k_min_s=60.0, forward_timeout_s=60.0,
                        backward_timeout_s=60.0, client=client,
                    )  # fmt: skip
                    local = LocalMixtureOfExperts(HIDDEN, (4, 4), "ffn.", k_best, modules)
                    local.gate.load_state_dict(remote.gate.state_dict())

                    x = torch.randn(24, HIDDEN, requires_grad=True)
                    x_local = x.detach().clone().requires_grad_()
                    y = remote(x)
                    y_local = local(x_local)
                    torch.testing.assert_close(y, y_local, atol=1e-5, rtol=0)

                    grad = torch.randn_like(y)
                    y.backward(grad)
                    y_local.backward(grad)
                    torch.testing.assert_close(x.grad, x_local.grad, atol=1e-5, rtol=0)
                    torch.testing.assert_close(
                        remote.gate.weight.grad, local.gate.weight.grad, atol=1e-5, rtol=0
                    )
                    stats = remote.stats
                    assert stats.forward_failed == stats.backward_failed == 0
                    # One request per expert, not per token: at most 16 of each.
                    assert stats.forward_ok <= 16
                    assert stats.backward_ok == stats.forward_ok
                    assert sum(v[2] for v in stats.by_uid.values()) == 24 * k_best

            await trio.to_thread.run_sync(compare)


async def test_leading_dimensions_and_bfloat16_activations(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs, uids="ffn.[0:2].[0:2]", experts={"hidden_dim": HIDDEN}
        )
        async with open_daemon(config, tmp_path / "a"):
            client_config = local_config(bootstrap=boot.multiaddrs)

            def run() -> None:
                with SwarmClient(client_config) as client:
                    for compression in ("none", "float16"):
                        layer = RemoteMixtureOfExperts(
                            HIDDEN, (2, 2), "ffn.", 2, client=client, compression=compression
                        ).to(torch.bfloat16)
                        x = torch.randn(3, 5, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
                        y = layer(x)
                        assert y.shape == x.shape
                        assert y.dtype == torch.bfloat16
                        y.float().sum().backward()
                        assert x.grad is not None
                        assert x.grad.dtype == torch.bfloat16
                        assert torch.isfinite(x.grad.float()).all()
                        assert layer.stats.backward_ok > 0

            await trio.to_thread.run_sync(run)


async def test_no_alive_experts_is_a_clear_error(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        client_config = local_config(bootstrap=boot.multiaddrs)

        def run() -> None:
            with SwarmClient(client_config) as client:
                layer = RemoteMixtureOfExperts(HIDDEN, (2, 2), "ffn.", 2, client=client)
                with pytest.raises(NoExpertsAvailable, match="no alive experts under ffn"):
                    layer(torch.randn(4, HIDDEN))

        await trio.to_thread.run_sync(run)
