"""Over libp2p: a daemon started from checkpoints written long ago (a PC that was off
overnight, a backup put back) refuses its replicated expert with ``paused`` until it
has averaged with the replica that kept training, its own weights left out; one
started from a fresh checkpoint, or whose expert has no replica, serves at once. The
same when a project's joiner takes experts back from its own old checkpoints."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
import trio

from volunteerd.checkpoint_folders import FORMAT_VERSION
from volunteerd.errors import RemoteError
from volunteerd.experts.checkpoint_file import (
    CheckpointStore,
    ExpertState,
    encode_checkpoint,
    read_checkpoint,
)
from volunteerd.identity import Identity
from volunteerd.net import Node
from volunteerd.net.peers import peer_id_for
from volunteerd.paths import Paths
from volunteerd.runtime.averaging import FROZEN_S
from volunteerd.server.replicas import SwarmReplicas
from volunteerd.swarm.manifest import ExperimentManifest, sign_manifest
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.testing.clients import call_forward

pytestmark = pytest.mark.slow

UID = "ffn.0.0"
HIDDEN = 32


async def forward(client: Node, address, uid: str = UID) -> None:  # type: ignore[no-untyped-def]
    await call_forward(client.rpc, address, uid, HIDDEN)


def put_checkpoint(data_dir: Path, state: ExpertState, age_s: float) -> None:
    """A checkpoint of ``state`` in ``data_dir`` whose header says it was written
    ``age_s`` ago (the file itself is new, as after `cp -r`)."""
    paths = Paths(config_file=data_dir / "c.toml", data_dir=data_dir, cache_dir=data_dir)
    store = CheckpointStore(paths.checkpoints_dir)
    path = store.save(state)
    pieces = encode_checkpoint(state, saved_at=time.time() - age_s, version=FORMAT_VERSION)
    path.write_bytes(b"".join(pieces))


async def test_a_daemon_started_from_old_checkpoints_serves_only_once_caught_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs,
            uids=UID,
            experts={"hidden_dim": HIDDEN},
            replicas={"average_every_s": 3600.0},  # no round but the catch-up
        )
        async with open_daemon(config, tmp_path / "a") as a:
            state = await a.runtime.with_expert(UID, lambda e: e.state())
            put_checkpoint(tmp_path / "b", state, age_s=10 * FROZEN_S)  # b's, long ago
            trained = {k: v * 1.01 for k, v in state.params.items()}  # a trained on since
            await a.runtime.with_expert(UID, lambda e: e.set_parameters(trained))

            # b's fetches wait for the test: it must be held until they answer
            fetch, asked, answering = SwarmReplicas.fetch, trio.Event(), trio.Event()

            async def held_fetch(self, peer_id: str, uid: str, **kwargs):  # type: ignore[no-untyped-def]
                asked.set()
                await answering.wait()
                return await fetch(self, peer_id, uid, **kwargs)

            monkeypatch.setattr(SwarmReplicas, "fetch", held_fetch)
            with trio.fail_after(15):
                while {r.peer_id for r in (await boot.dht.get([UID]))[UID]} != {a.node.peer_id}:  # noqa: ASYNC110
                    await trio.sleep(0.2)  # a's record is out: b's first lookup finds it
            async with open_daemon(config, tmp_path / "b") as b:
                assert b.volunteer.gate.held == {UID}  # from its start, before announcing
                with trio.fail_after(30):
                    await asked.wait()  # it found a's record and asks for a's weights
                assert b.volunteer.gate.held == {UID}
                with pytest.raises(RemoteError) as refused:
                    await forward(boot, b.node.address)
                assert refused.value.code == "paused"
                await forward(boot, a.node.address)  # the replica serves on

                answering.set()
                with trio.fail_after(30):
                    while b.volunteer.gate.held:  # noqa: ASYNC110
                        await trio.sleep(0.1)
                caught_up = await b.runtime.with_expert(UID, lambda e: e.parameter_copies())
                for k, v in trained.items():  # the replica's weights, not halfway to them
                    torch.testing.assert_close(caught_up[k], v)
                await forward(boot, b.node.address)


async def test_a_fresh_checkpoint_or_an_expert_without_replicas_serves_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_fetch(self, peer_id: str, uid: str, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("nothing to catch up with: no fetch")

    monkeypatch.setattr(SwarmReplicas, "fetch", no_fetch)
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs,
            uids=UID,
            experts={"hidden_dim": HIDDEN},
            replicas={"average_every_s": 3600.0},
        )
        # An old checkpoint, no replica anywhere: served once its lookup found none.
        async with open_daemon(config, tmp_path / "a") as a:
            state = await a.runtime.with_expert(UID, lambda e: e.state())
        (tmp_path / "a" / "checkpoints" / "stopped.json").unlink(
            missing_ok=True
        )  # none: nothing saved
        put_checkpoint(tmp_path / "a", state, age_s=10 * FROZEN_S)
        async with open_daemon(config, tmp_path / "a") as a:
            with trio.fail_after(config.timeouts.dht_lookup_s + 5):
                while a.volunteer.gate.held:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            await forward(boot, a.node.address)
        # A fresh checkpoint beside a replica: never held.
        put_checkpoint(tmp_path / "b", state, age_s=1.0)
        async with open_daemon(config, tmp_path / "b") as b:
            assert not b.volunteer.gate.held
            await forward(boot, b.node.address)
            # A restart in place of an expert nobody trained: its checkpoint is as old
            # as before, and held its weights until the stop. Never held either.
            async with open_daemon(config, tmp_path / "a") as a:
                assert not a.volunteer.gate.held
                await forward(boot, a.node.address)
                await trio.sleep(1.0)
                assert not a.volunteer.gate.held
            assert not b.volunteer.gate.held


async def test_a_joiner_taking_experts_from_old_checkpoints_holds_them_until_looked_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    owner, me = Identity.generate(), Identity.generate()
    now = time.time()
    manifest = ExperimentManifest(
        name="restore-test", hidden_dim=HIDDEN, uid_prefix="ffn", grid=(1, 2), replication=1,
        seed=7, owner=str(peer_id_for(owner)), issued_at=now, expires_at=now + 3600,
    )  # fmt: skip
    async with open_peer(local_config()) as boot:
        assert await boot.dht.put_manifest(sign_manifest(manifest, owner)) >= 1
        config = local_config(
            bootstrap=boot.multiaddrs,
            uids="",
            experts={"hidden_dim": HIDDEN},
            experiments={
                "join": manifest.name,
                "trusted_owners": [manifest.owner],
                "max_experts": 2,
                "join_timeout_s": 10.0,
            },
            replicas={"average_every_s": 3600.0},
        )
        async with open_daemon(config, tmp_path / "d", identity=me) as first:
            uids = set(first.joiners[0].hosted)
            for uid in uids:  # trained: its checkpoint is saved at the stop
                await first.runtime.with_expert(uid, lambda b: b.set_parameters(
                    {k: v * 1.01 for k, v in b.parameter_copies().items()}
                ))  # fmt: skip
        checkpoints = tmp_path / "d" / "checkpoints"
        (checkpoints / "stopped.json").unlink()  # the computer was off overnight since
        for uid in uids:
            path = CheckpointStore(checkpoints).files(uid)[0]
            state = read_checkpoint(path)
            old = encode_checkpoint(state, saved_at=time.time() - 8 * 3600, version=FORMAT_VERSION)
            path.write_bytes(b"".join(old))
        with caplog.at_level(logging.INFO, logger="volunteerd.runtime.averaging"):
            async with open_daemon(config, tmp_path / "d", identity=me) as again:
                assert set(again.joiners[0].sources.values()) == {"checkpoint"}
                with trio.fail_after(config.timeouts.dht_lookup_s + 5):
                    while again.volunteer.gate.held:  # noqa: ASYNC110
                        await trio.sleep(0.05)  # no replica: served once looked up
                for uid in uids:
                    await forward(boot, again.node.address, uid)
        assert "loaded checkpoints up to 8.0 h old; no replica of them" in caplog.text
