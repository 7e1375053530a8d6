"""The trainer reads the experiment manifest the daemons join, from the DHT, trusted only."""

from __future__ import annotations

import time

import pytest
import trio

from volunteerd.errors import ConfigError, UntrustedManifest
from volunteerd.identity import Identity
from volunteerd.moe import SwarmClient
from volunteerd.net import peer_id_for
from volunteerd.swarm.manifest import ExperimentManifest, sign_manifest
from volunteerd.testing import local_config, open_peer
from volunteerd.train import Experiment
from volunteerd.train.published import apply_manifest, resolve_manifest

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow


def manifest(owner: Identity, **fields: object) -> ExperimentManifest:
    now = time.time()
    return ExperimentManifest.model_validate(
        {
            "name": "chars",
            "hidden_dim": 64,
            "uid_prefix": "mix",
            "layers": 3,
            "grid": (2, 3),
            "compression": "float16",
            "optimizer": {"name": "sgd", "lr": 0.05},
            "owner": str(peer_id_for(owner)),
            "issued_at": now,
            "expires_at": now + 3600,
            **fields,
        }
    )


def experiment(name: str, trusted: list[str]) -> Experiment:
    return Experiment.model_validate(
        {"swarm": {"manifest": name, "trusted_owners": trusted}, "model": {"num_heads": 4}}
    )


async def test_the_trainer_takes_the_experts_settings_from_a_trusted_manifest() -> None:
    owner, stranger = Identity.generate(), Identity.generate()
    async with (
        open_peer(local_config()) as boot,
        open_peer(local_config(bootstrap=boot.multiaddrs)) as publisher,
    ):
        assert await publisher.dht.put_manifest(sign_manifest(manifest(owner), owner)) >= 1
        config = local_config(bootstrap=boot.multiaddrs)
        owner_id, stranger_id = str(peer_id_for(owner)), str(peer_id_for(stranger))

        def run() -> None:
            with SwarmClient(config) as client:
                resolved = resolve_manifest(experiment("chars", [owner_id]), client)
                m = resolved.model
                assert (m.hidden_dim, m.uid_prefix, m.num_blocks, m.grid) == (64, "mix", 3, (2, 3))
                assert m.compression == "float16"
                assert (resolved.experts.name, resolved.experts.lr) == ("sgd", 0.05)
                assert m.layer_name(2) == "mix2"
                with pytest.raises(UntrustedManifest, match=owner_id) as untrusted:
                    resolve_manifest(experiment("chars", []), client)  # nobody trusted yet
                # The hint is the trainer's (its experiment file, --invitation), not the
                # daemon's --set, which ``volunteerd train`` does not take.
                hint = str(untrusted.value)
                assert ("swarm.trusted_owners" in hint, "--invitation" in hint) == (True, True)
                assert ("--set" in hint, "experiments.trusted_owners" in hint) == (False, False)
                # Trusting someone else: the owner's manifest is neither used nor named.
                with pytest.raises(ConfigError, match="trusted owner") as info:
                    resolve_manifest(experiment("chars", [stranger_id]), client, timeout_s=1)
                assert owner_id not in str(info.value)
                with pytest.raises(ConfigError, match="not found"):
                    resolve_manifest(experiment("other", [owner_id]), client, timeout_s=1)
                plain = Experiment()
                assert resolve_manifest(plain, client) is plain

        await trio.to_thread.run_sync(run)


def test_a_manifest_of_one_grid_named_uid_prefix_makes_a_one_block_model() -> None:
    # A swarm started by hand with `serve --experts "mix.[0:2].[0:3]"`, published as is.
    m = apply_manifest(Experiment(), manifest(Identity.generate(), layers=0)).model
    assert (m.num_blocks, m.layer_names, m.layer_name(0)) == (1, ("mix",), "mix")
    assert m.expert_pattern(0) == "mix.0.[0:3],mix.1.[0:3]"


def test_a_manifest_the_model_cannot_use_is_a_clear_error() -> None:
    owner = Identity.generate()
    with pytest.raises(ConfigError, match="ffn experts"):
        apply_manifest(Experiment(), manifest(owner, expert_type="transformer", num_heads=4))
    with pytest.raises(ConfigError, match="does not fit"):
        # 62 is not a multiple of the model's 4 attention heads
        apply_manifest(Experiment(), manifest(owner, hidden_dim=62))
