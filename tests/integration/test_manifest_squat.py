"""A name whose owner slots strangers filled first, on real libp2p (127.0.0.1): the
owner's ``publish`` says so, rather than blaming its clock (audit-join, squat.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from volunteerd.errors import ResourceUnavailable
from volunteerd.identity import Identity
from volunteerd.net import Verb
from volunteerd.net.peers import peer_id_for
from volunteerd.net.records import ManifestStoreRequest, StoreReply
from volunteerd.swarm.manifest import ExperimentManifest, sign_manifest
from volunteerd.swarm.publish import publish_manifest
from volunteerd.testing import local_config, open_peer

EXPERIMENT = """\
name = "exp"
expert_type = "ffn"
hidden_dim = 16
uid_prefix = "ffn"
grid = [1, 2]
"""


async def test_publish_says_the_name_is_full_when_strangers_filled_it_first(
    tmp_path: Path,
) -> None:
    now = time.time()
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT)
    async with open_peer(local_config()) as boot:
        # The attacker leaves once it has stored: only the peer it filled is left to ask.
        async with open_peer(local_config(bootstrap=boot.multiaddrs)) as attacker:
            strangers = [Identity.generate() for _ in range(16)]
            records = [
                sign_manifest(
                    ExperimentManifest(
                        name="exp", grid=(1, 2), hidden_dim=16, owner=str(peer_id_for(s)),
                        issued_at=now, expires_at=now + 3600,
                    ),
                    s,
                )
                for s in strangers
            ]  # fmt: skip
            for start in range(0, 16, 4):
                request = ManifestStoreRequest(records=records[start : start + 4])
                reply, _ = await attacker.rpc.call(boot.address, Verb.MANIFEST_STORE, request)
                assert reply == StoreReply(stored=4)

        with pytest.raises(ResourceUnavailable) as failed:
            await publish_manifest(
                local_config(bootstrap=boot.multiaddrs), Identity.generate(), path
            )
    message = str(failed.value)
    assert "refused it: the name 'exp' already has the most owners a peer keeps (16)" in message
    assert "clock" not in message
