"""A real daemon answering a trainer's forward and backward with q8 (blockwise 8-bit)
activations and gradients on the wire, close to the same mixture run locally."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import trio

from volunteerd.moe import LocalMixtureOfExperts, RemoteMixtureOfExperts, SwarmClient
from volunteerd.testing import local_config, open_daemon, open_peer

# Real libp2p nodes on loopback, in wall-clock time.
pytestmark = pytest.mark.slow

HIDDEN = 64  # one q8 block per row


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().norm() / want.detach().norm())


async def test_q8_forward_and_backward_through_a_real_daemon_stay_close_to_local(
    tmp_path: Path,
) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs, uids="ffn.[0:2].[0:2]", experts={"hidden_dim": HIDDEN}
        )
        async with open_daemon(config, tmp_path / "a") as daemon:
            modules = {
                uid: copy.deepcopy(daemon.runtime.backend(uid).module)
                for uid in daemon.runtime.uids
            }
            client_config = local_config(bootstrap=boot.multiaddrs)

            def compare() -> None:
                torch.manual_seed(0)
                with SwarmClient(client_config) as client:
                    remote = RemoteMixtureOfExperts(
                        HIDDEN, (2, 2), "ffn.", k_best=2, k_min=2, grace_after_k_min_s=60.0,
                        forward_timeout_s=60.0, backward_timeout_s=60.0,
                        client=client, compression="q8",
                    )  # fmt: skip
                    local = LocalMixtureOfExperts(HIDDEN, (2, 2), "ffn.", 2, modules)
                    local.gate.load_state_dict(remote.gate.state_dict())

                    x = torch.randn(16, HIDDEN, requires_grad=True)
                    x_local = x.detach().clone().requires_grad_()
                    y = remote(x)
                    y_local = local(x_local)
                    assert y.dtype == torch.float32
                    assert relative_error(y, y_local) < 0.02

                    grad = torch.randn_like(y)
                    y.backward(grad)
                    y_local.backward(grad)
                    assert x.grad is not None
                    assert x_local.grad is not None
                    assert relative_error(x.grad, x_local.grad) < 0.02
                    stats = remote.stats
                    assert stats.forward_failed == stats.backward_failed == 0
                    assert stats.backward_ok > 0

            await trio.to_thread.run_sync(compare)
