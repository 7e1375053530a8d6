"""A newcomer at a seed whose transfer quota's share for bulk replies is used up fills
its room from the other joiners, at once: it neither waits out the busy rounds (5 min
each) nor seeds the experts only the seed holds, and says what it waits for.

An outside re-check: 8 joiners at a seed of 32 experts of 2.1 MB with a 0.1 GB daily
quota held 2-5 of their 6 experts for ~30 min, then seeded the rest."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import trio

from volunteerd.config import Config
from volunteerd.daemon import Running
from volunteerd.experts import ExpertBackend
from volunteerd.experts.checkpoint_file import encode_checkpoint
from volunteerd.identity import Identity
from volunteerd.net.peers import peer_id_for
from volunteerd.swarm.manifest import ExperimentManifest, sign_manifest
from volunteerd.testing import local_config, open_daemon, open_peer

# Real libp2p nodes on loopback, in wall-clock time.
pytestmark = pytest.mark.slow

NAME = "spent-seed"
HIDDEN = 256  # experts of ~2.1 MB, as in the re-check


def make_manifest(owner: Identity) -> ExperimentManifest:
    now = time.time()
    return ExperimentManifest(
        name=NAME,
        hidden_dim=HIDDEN,
        uid_prefix="ffn",
        grid=(1, 4),
        replication=2,
        seed=7,
        owner=str(peer_id_for(owner)),
        issued_at=now,
        expires_at=now + 3600,
    )


def config_for(bootstrap: list[str], owner: str, room: int, daily_quota_gb: float = 0.0) -> Config:
    return local_config(
        bootstrap=bootstrap,
        experiments={
            "join": NAME,
            "trusted_owners": [owner],
            "max_experts": room,
            "rebalance_every_s": 2.0,
            "min_stay_s": 0.0,
            "join_timeout_s": 10.0,
        },
        limits={"daily_quota_gb": daily_quota_gb},
        replicas={"enabled": False},  # no averaging: only the joiners' downloads are bulk
        dht={"announce_period_s": 2.0, "record_ttl_s": 10.0},
    )


def snapshot_bytes(manifest: ExperimentManifest) -> int:
    """What one expert's shard download sends (a freshly seeded one's)."""
    backend = ExpertBackend("ffn.0.0", manifest.experts_config(), torch.device("cpu"), 16)
    return sum(len(bytes(part)) for part in encode_checkpoint(backend.state(), saved_at=0.0))


def hosted(running: Running) -> set[str]:
    (joiner,) = running.joiners
    return set(joiner.hosted)


async def test_a_newcomer_at_a_spent_seed_fills_its_room_from_another_joiner(
    tmp_path: Path,
) -> None:
    owner = Identity.generate()
    manifest = make_manifest(owner)
    uids = set(manifest.uids())
    # The seed's bulk half (half the daily quota) is one and a half experts: the first
    # joiner's download fits, the next is refused until midnight. The rest of the quota
    # is far more than the DHT's traffic in a minute, so serving is never paused.
    whole = snapshot_bytes(manifest)
    quota_gb = 3 * whole / 1e9
    async with open_peer(local_config()) as boot:
        assert await boot.dht.put_manifest(sign_manifest(manifest, owner)) >= 1
        bootstrap = boot.multiaddrs

        async with (
            open_daemon(config_for(bootstrap, manifest.owner, 4, quota_gb), tmp_path / "s") as seed,
            open_daemon(config_for(bootstrap, manifest.owner, 1), tmp_path / "a") as first,
        ):
            assert hosted(seed) == uids
            (held,) = hosted(first)
            assert first.joiners[0].sources[held] == f"replica {seed.node.peer_id}"
            # Wait until a third party's lookup finds the first joiner's replica.
            with trio.fail_after(30):
                while True:
                    found = await boot.dht.get([held])
                    if first.node.peer_id in {r.peer_id for r in found[held]}:
                        break
                    await trio.sleep(0.5)

            started = trio.current_time()
            with trio.fail_after(90):  # the busy wait alone was 300 s
                async with open_daemon(
                    config_for(bootstrap, manifest.owner, 3), tmp_path / "b"
                ) as second:
                    joined_s = trio.current_time() - started
                    joiner = second.joiners[0]
                    print(f"joined in {joined_s:.1f} s; sources {joiner.sources}")
                    print(f"waiting: {joiner.waiting}")
                    # All the first joiner holds, from it; nothing seeded.
                    assert hosted(second) == {held}
                    assert joiner.sources == {held: f"replica {first.node.peer_id}"}
                    waiting = joiner.waiting
                    assert waiting is not None
                    assert waiting.startswith(
                        "2 experts wait for replicas whose daily transfer quota is used up"
                    ), waiting
                    # Later rounds ask the spent seed nothing, and seed nothing.
                    await trio.sleep(5.0)
                    assert set(joiner.sources.values()) == {f"replica {first.node.peer_id}"}
                    assert joiner._spent.keys() == {seed.node.peer_id}
