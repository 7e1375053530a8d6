"""Four trainers of one experiment, each in its own emulated home, average their weights
over the WAN emulator's `home` links (40 ms host to host, 10 Mbit/s up, 0.1 % loss)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_trainers import EXPERIMENT, round_peers
from volunteerd.demo.local_swarm import (
    LocalSwarm,
    start_trainer,
    stop_trainers,
    wait_trainers,
    write_experiment,
)
from volunteerd.demo.wan import open_placements
from volunteerd.testing.wan import wan_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not wan_available(), reason=wan_available().reason or "available"),
]

TRAINERS = 4
STEPS = 60


@pytest.mark.timeout(600)
def test_four_trainers_on_home_links_complete_averaging_rounds(tmp_path: Path) -> None:
    experiment = EXPERIMENT.model_copy(
        update={"training": EXPERIMENT.training.model_copy(update={"steps": STEPS})}
    )
    config = write_experiment(experiment, tmp_path / "experiment.toml")
    with (
        open_placements("home", daemons=2, trainers=TRAINERS) as hosts,
        LocalSwarm.for_experiment(experiment, 2, placements=hosts.swarm) as swarm,
    ):
        placements = [hosts.trainer, *hosts.more_trainers]
        assert len(placements) == TRAINERS
        trainers = [
            start_trainer(f"trainer{i + 1}", config, swarm.bootstrap_addrs[0], steps=STEPS,
                          workdir=tmp_path, placement=placement)
            for i, placement in enumerate(placements)
        ]  # fmt: skip
        try:
            wait_trainers(trainers, timeout_s=480)
        finally:
            stop_trainers(trainers)
        summaries = [t.summary() for t in trainers]
        traffic = hosts.traffic()
    ids = {s["peer_id"] for s in summaries}
    assert len(ids) == TRAINERS
    # each trainer in a host of its own, behind its own emulated link
    assert len({p.listen_host for p in placements}) == TRAINERS
    assert not any(p.listen_host.startswith("127.") for p in placements)
    assert all(p.prefix for p in placements)
    for s in summaries:
        assert s["steps"] == STEPS
        assert s["skipped_steps"] == 0
        assert s["final_val_loss"] < 0.7 * s["initial_val_loss"]
        assert s["averaging_rounds"] >= 1, s["rounds_log"]
        assert round_peers(s) <= ids - {s["peer_id"]}
        assert s["trainers"] >= 2
        assert s["averaging_bytes_received"] > 0
    # every trainer averaged with at least one other, and each was someone's peer
    assert set().union(*(round_peers(s) for s in summaries)) == ids
    # the trainers' hosts sent and received over their emulated links
    for sent, received in traffic[-(TRAINERS - 1) :]:
        assert sent > 0
        assert received > 0
