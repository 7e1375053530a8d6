"""Over libp2p: a daemon that did not run for minutes (its suspended-time clock jumped)
refuses and withdraws its replicated expert until it has averaged with the replica
that kept training, then serves the replica's weights again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from volunteerd.awake import awake_time
from volunteerd.errors import RemoteError
from volunteerd.net import Node
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.testing.clients import call_forward

pytestmark = pytest.mark.slow

UID = "ffn.0.0"
HIDDEN = 32


async def forward(client: Node, address, uid: str = UID) -> None:  # type: ignore[no-untyped-def]
    await call_forward(client.rpc, address, uid, HIDDEN)


async def servers_of(client: Node) -> set[str]:
    return {r.peer_id for r in (await client.dht.get([UID]))[UID]}


async def test_a_frozen_daemon_serves_its_replicated_expert_only_once_caught_up(
    tmp_path: Path,
) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs,
            uids=UID,
            experts={"hidden_dim": HIDDEN},
            replicas={"average_every_s": 3600.0},  # no round but the test's
        )
        async with (
            open_daemon(config, tmp_path / "a") as a,
            open_daemon(config, tmp_path / "b") as b,
        ):
            with trio.fail_after(15):
                while await b.averager.source.replicas(UID) != [a.node.peer_id]:  # noqa: ASYNC110
                    await trio.sleep(0.2)  # announcements still spreading
            await b.averager.run_round()  # b knows UID has a replica
            trained = await a.runtime.with_expert(UID, lambda e: e.parameter_copies())
            trained = {k: v * 1.01 for k, v in trained.items()}  # a trained on meanwhile
            await a.runtime.with_expert(UID, lambda e: e.set_parameters(trained))

            fetch = b.averager.source.fetch
            answering = trio.Event()

            async def held_fetch(peer_id: str, uid: str, **kwargs):  # type: ignore[no-untyped-def]
                await answering.wait()
                return await fetch(peer_id, uid, **kwargs)

            b.averager.source.fetch = held_fetch  # type: ignore[method-assign]
            b.averager._awake_clock = lambda: awake_time() + 300  # b was stopped 5 minutes

            with trio.fail_after(15):
                while b.volunteer.gate.held != {UID}:  # noqa: ASYNC110
                    await trio.sleep(0.1)
            with pytest.raises(RemoteError) as refused:
                await forward(boot, b.node.address)
            assert refused.value.code == "paused"
            await forward(boot, a.node.address)  # the replica serves on
            with trio.fail_after(15):
                while await servers_of(boot) != {a.node.peer_id}:  # noqa: ASYNC110
                    await trio.sleep(0.2)  # b's record withdrawn

            b.averager._awake_clock = awake_time  # type: ignore[method-assign]
            answering.set()
            with trio.fail_after(30):
                while b.volunteer.gate.held:  # noqa: ASYNC110
                    await trio.sleep(0.1)
            caught_up = await b.runtime.with_expert(UID, lambda e: e.parameter_copies())
            for k, v in trained.items():  # the replica's weights, not halfway to them
                torch.testing.assert_close(caught_up[k], v)
            await forward(boot, b.node.address)
            with trio.fail_after(15):
                while await servers_of(boot) != {a.node.peer_id, b.node.peer_id}:  # noqa: ASYNC110
                    await trio.sleep(0.2)  # announced again
