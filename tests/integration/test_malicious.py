"""Bad actors among the volunteers: the trainer detects, counts and excludes them, and
training goes on; an expert refuses wrecking gradients from a bad trainer.

The malicious daemon is a real daemon on loopback whose experts' compute is replaced by
an attack after it starts; everything else (libp2p, the DHT, the wire) is real. The
same behaviours, and the expert's own guard against bad gradients, are tested in
process on memory links in tests/inprocess/ (test_trainer.py, test_guard.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from torch import nn

from volunteerd.daemon import Running
from volunteerd.experts import ExpertBackend
from volunteerd.moe import OutputChecks, RemoteMixtureOfExperts, SwarmClient
from volunteerd.testing import local_config, open_daemon, open_peer

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow

HIDDEN = 16
GRID = "ffn.[0:2].[0:2]"

Outputs = list[torch.Tensor]


def _nan(out: Outputs) -> Outputs:
    return [torch.full_like(out[0], float("nan"))]


def _noise(out: Outputs) -> Outputs:
    return [torch.randn_like(out[0]) * out[0].float().std().clamp_min(1e-3)]


ATTACKS = {"nan": _nan, "noise": _noise}


def corrupt_forward(backend: ExpertBackend, attack: Callable[[Outputs], Outputs]) -> None:
    plain, kept = backend.forward, backend.forward_retained_many

    def forward(inputs: Any) -> Outputs:
        return attack(plain(inputs))

    def forward_retained_many(items: Any) -> Any:
        return [(attack(out), retained) for out, retained in kept(items)]

    backend.forward = forward  # type: ignore[method-assign]
    backend.forward_retained_many = forward_retained_many  # type: ignore[method-assign]


def wait_for_replicas(client: SwarmClient, replicas: int, timeout_s: float = 30.0) -> None:
    """Until the trainer's directory lists ``replicas`` servers for every expert (on a
    loaded machine an announcement round can be late)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = client.children(["ffn.0.", "ffn.1."])
        counts = [len(peers) for children in found.values() for peers in children.values()]
        if len(counts) == 4 and min(counts) >= replicas:
            return
        assert time.monotonic() < deadline, f"replicas seen: {found}"
        time.sleep(0.5)


def train(client: SwarmClient, checks: OutputChecks, steps: int) -> tuple[list[float], Any]:
    """A small regression through the swarm's mixture; returns the losses and the layer."""
    torch.manual_seed(0)
    moe = RemoteMixtureOfExperts(
        HIDDEN, (2, 2), "ffn.", k_best=2, k_min=1, grace_after_k_min_s=1.0,
        forward_timeout_s=5.0, backward_timeout_s=5.0, client=client, checks=checks,
    )  # fmt: skip
    head = nn.Linear(HIDDEN, HIDDEN)
    optimizer = torch.optim.Adam([*moe.parameters(), *head.parameters()], lr=1e-2)
    x = torch.randn(32, HIDDEN)
    target = torch.tanh(x @ torch.randn(HIDDEN, HIDDEN))
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(head(moe(x)), target)
        optimizer.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in head.parameters() if p.grad is not None)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, moe


# Scaled answers and huge input gradients, and every attack's details, are tested
# in-process on memory links (tests/inprocess/test_trainer.py); these two stay real.
@pytest.mark.parametrize(("attack", "reason"), [("nan", "non_finite"), ("noise", "disagreed")])
async def test_a_malicious_expert_is_detected_counted_and_excluded(
    tmp_path: Path, attack: str, reason: str
) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs, uids=GRID, experts={"hidden_dim": HIDDEN, "seed": 7}
        )
        async with (
            open_daemon(config, tmp_path / "honest1"),
            open_daemon(config, tmp_path / "honest2"),
            open_daemon(config, tmp_path / "bad") as bad,
        ):
            for uid in bad.runtime.uids:
                corrupt_forward(bad.runtime.backend(uid), ATTACKS[attack])
            checks = OutputChecks(spot_check=1.0 if attack == "noise" else 0.0)

            def run() -> None:
                with SwarmClient(local_config(bootstrap=boot.multiaddrs)) as client:
                    wait_for_replicas(client, 3)
                    losses, moe = train(client, checks, steps=30)
                    assert all(loss == loss for loss in losses), "no NaN reached training"
                    assert losses[-1] < 0.7 * losses[0], losses
                    assert moe.stats.rejected[reason] >= 1, moe.stats
                    assert bad.node.peer_id in client.directory.banned
                    assert client.directory.ban_reasons[reason] == 1
                    # Once banned, the bad daemon is not called again.
                    calls_after_ban = moe.stats.calls
                    before = bad_requests(bad)
                    train_more(client, moe)
                    assert moe.stats.calls > calls_after_ban
                    assert bad_requests(bad) == before

            await trio.to_thread.run_sync(run)


def bad_requests(daemon: Running) -> int:
    return sum(s.forward.requests + s.backward.requests for s in daemon.runtime.statistics())


def train_more(client: SwarmClient, moe: RemoteMixtureOfExperts) -> None:
    x = torch.randn(32, HIDDEN)
    for _ in range(3):
        moe(x).sum().backward()


async def test_a_replica_takes_over_within_the_step(tmp_path: Path) -> None:
    """Two daemons host the same experts; one dies: the step is served by the other,
    without backtracking to other experts."""
    async with open_peer(local_config()) as boot:
        config = local_config(bootstrap=boot.multiaddrs, uids=GRID, experts={"hidden_dim": HIDDEN})
        async with open_daemon(config, tmp_path / "a"), open_daemon(config, tmp_path / "b") as b:

            def run() -> None:
                with SwarmClient(local_config(bootstrap=boot.multiaddrs)) as client:
                    wait_for_replicas(client, 2)
                    _, moe = train(client, OutputChecks(), steps=2)
                    # Make every call of the next step fail on b.
                    for uid in b.runtime.uids:
                        corrupt_forward(b.runtime.backend(uid), _nan)
                    x = torch.randn(32, HIDDEN)
                    for _ in range(4):
                        moe(x).sum().backward()
                    assert moe.stats.unanswered_tokens == 0
                    assert moe.stats.backtracked == 0
                    assert moe.stats.failovers >= 1
                    assert b.node.peer_id in client.directory.banned

            await trio.to_thread.run_sync(run)
