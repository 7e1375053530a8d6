"""Trainers averaging over real libp2p on 127.0.0.1 (train/averaging.py on
swarm/trainers.py): they find each other under the experiment's rendezvous key, a
round averages honest weights and clips a liar's to the bound, and a trainer started
late begins from the state of the peer with the most updates."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import trio

from tests.unit.test_trainer_averaging import Tiny
from volunteerd.experts.clipping import clip_bound
from volunteerd.moe import SwarmClient
from volunteerd.testing import local_config, open_peer
from volunteerd.train import Experiment, TrainerAverager, start_averaging

# Real libp2p nodes on loopback, in wall-clock time.
pytestmark = pytest.mark.slow

DEADLINE_S = 90  # generous: the tests run beside CPU-heavy processes


def trained(steps: int, start: Tiny | None = None) -> tuple[Tiny, torch.optim.Adam]:
    torch.manual_seed(0)
    model = Tiny()
    if start is not None:
        model.load_state_dict(start.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for i in range(steps):
        optimizer.zero_grad()
        model.loss(i + steps).backward()
        optimizer.step()
    return model, optimizer


def wait_for_peers(client: SwarmClient, averager: TrainerAverager, n: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while len(client.run(averager.network.peers)) < n:
        assert time.monotonic() < deadline, f"fewer than {n} other trainers found"
        time.sleep(0.5)


@pytest.mark.timeout(240)
async def test_trainers_average_clip_a_liar_and_a_late_one_starts_from_a_peer(
    tmp_path: Path,
) -> None:
    experiment = Experiment.model_validate(
        {
            "name": "averaging-itest",
            # rounds are run by hand here
            "averaging": {"every_s": 3600, "timeout_s": 30, "group_size": 3},
        }
    )
    async with open_peer(local_config()) as boot:
        config = local_config(bootstrap=boot.multiaddrs)

        def run() -> None:
            with SwarmClient(config) as a, SwarmClient(config) as b, SwarmClient(config) as liar:
                averagers = {c: start_averaging(c, experiment) for c in (a, b, liar)}
                model_a, opt_a = trained(3)
                model_b, opt_b = trained(7)
                model_liar, opt_liar = trained(1)
                with torch.no_grad():
                    for p in model_liar.parameters():
                        p.mul_(1000).add_(1000)
                for client, (model, opt, version) in {
                    a: (model_a, opt_a, 3),
                    b: (model_b, opt_b, 7),
                    liar: (model_liar, opt_liar, 1),
                }.items():
                    averagers[client].publish(
                        dict(model.named_parameters()), opt, version, 0, 0.0, force=True
                    )
                av_a = averagers[a]
                wait_for_peers(a, av_a, 2)

                own = {k: v.detach().clone() for k, v in model_a.named_parameters()}
                honest = {k: v.detach().clone() for k, v in model_b.named_parameters()}
                peers = a.run(av_a.run_round)
                assert set(peers) == {b.node.node.peer_id, liar.node.node.peer_id}
                assert av_a.apply_pending(dict(model_a.named_parameters()))
                for name, p in model_a.named_parameters():
                    x = own[name]
                    # b's pull is taken whole (it is close); the liar's is clipped to tau/3
                    expected = x + (honest[name] - x) / 3
                    bound = clip_bound(x, experiment.averaging.clip_ratio) / 3
                    assert float((p.detach() - expected).norm()) <= bound * (1 + 1e-4), name
                stats = av_a.statistics()
                assert stats.rounds == 1
                assert stats.clipped == len(own)  # the liar's every tensor
                assert stats.bytes_received > 0
                assert stats.trainers == 3

                with SwarmClient(config) as late:
                    av_late = start_averaging(late, experiment)
                    wait_for_peers(late, av_late, 3)
                    model_late, opt_late = trained(0)
                    who, version = av_late.join(
                        dict(model_late.named_parameters()), opt_late, tmp_path
                    )
                    # b has the most updates
                    assert (who, version) == (b.node.node.peer_id, 7)
                    for p, q in zip(model_late.parameters(), model_b.parameters(), strict=True):
                        assert torch.equal(p, q)
                    # Adam's moments did not come along (nothing vouches for them): the
                    # next step is a fresh Adam's first step from b's weights
                    assert opt_late.state_dict()["state"] == {}
                    fresh, opt_fresh = trained(0, start=model_b)
                    for model, opt in ((model_late, opt_late), (fresh, opt_fresh)):
                        opt.zero_grad()
                        model.loss(1234).backward()
                        opt.step()
                    for p, q in zip(model_late.parameters(), fresh.parameters(), strict=True):
                        assert torch.equal(p, q)

        await trio.to_thread.run_sync(run)
