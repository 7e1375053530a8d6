"""No peer's behaviour ends a serving daemon (issue 12, item 2).

Strangers that connect and leave make py-libp2p forget them while Kademlia's routing
table still names them; a DHT lookup that met such a peer raised PeerStoreError out of
the replica averager and the daemon exited 1. These run real daemons on loopback.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import pytest
import torch
import trio
from libp2p.peer.peerstore import PeerStoreError

from volunteerd.config import Config
from volunteerd.experts import to_wire
from volunteerd.net import Node, Verb
from volunteerd.net.records import FindRequest
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.testing.clients import open_bare_client
from volunteerd.wire import ForwardRequest

pytestmark = pytest.mark.slow

UID = "ffn.0.0"
STRANGERS = 24
CONCURRENT = 4


async def stranger(config: Config, node: Node) -> None:
    async with open_bare_client(config) as client:
        with trio.fail_after(30):
            await client.call(node.address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))


async def forward_status(boot: Node, node: Node) -> str:
    """A trainer's forward to ``node``: the reply's status."""
    meta, data = to_wire(torch.randn(2, 32))
    async with open_peer(local_config(bootstrap=boot.multiaddrs)) as client:
        reply, _ = await client.rpc.call(
            node.address, Verb.FORWARD, ForwardRequest(uid=UID, tensors=[meta]), [data]
        )
    return str(reply.status)


async def test_strangers_that_come_and_go_do_not_end_a_serving_daemon(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs, uids=UID, replicas={"average_every_s": 0.2}
        )
        async with (
            open_daemon(config, tmp_path / "a") as a,
            open_daemon(config, tmp_path / "b"),
        ):
            before = a.averager.statistics().rounds

            async def chain() -> None:
                for _ in range(STRANGERS // CONCURRENT):
                    await stranger(config, a.node)

            async with trio.open_nursery() as nursery:
                for _ in range(CONCURRENT):
                    nursery.start_soon(chain)
            # A DHT peer that joined through the daemon, and that py-libp2p's peerstore
            # dropped (it does at expiry and at its size limit) while the routing table
            # still names it to every lookup.
            async with open_peer(local_config(bootstrap=a.node.multiaddrs)) as forgotten:
                forgotten_id = forgotten.host.get_id()
                with trio.fail_after(10):
                    while not a.node.dht._kad.routing_table.peer_in_table(forgotten_id):  # noqa: ASYNC110 - polling state
                        await trio.sleep(0.05)
                a.node.host.get_peerstore().clear_peerdata(forgotten_id)
                rounds = a.averager.statistics().rounds
                with trio.fail_after(30):
                    while a.averager.statistics().rounds < rounds + 3:  # noqa: ASYNC110 - polling state
                        await trio.sleep(0.05)
            during = a.averager.statistics().rounds
            assert during > before
            with trio.fail_after(30):
                while a.averager.statistics().rounds < during + 3:  # noqa: ASYNC110 - polling state
                    await trio.sleep(0.1)
            assert await forward_status(boot, a.node) == "ok"


async def test_library_errors_from_every_dht_call_do_not_end_a_daemon(tmp_path: Path) -> None:
    """Fault injection: every DHT store and lookup raises py-libp2p's own exception. The
    announcer's and the averager's rounds fail and are retried; the daemon serves on."""
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs, uids=UID, replicas={"average_every_s": 0.2}
        )
        async with open_daemon(config, tmp_path / "a") as a:
            calls = {"get": 0, "put": 0}

            async def broken_get(*args: object, **kwargs: object) -> NoReturn:
                calls["get"] += 1
                raise PeerStoreError("peer ID not found")

            async def broken_put(*args: object, **kwargs: object) -> NoReturn:
                calls["put"] += 1
                raise PeerStoreError("peer ID not found")

            dht = a.node.dht
            dht.get = broken_get  # type: ignore[method-assign]
            dht.put = broken_put  # type: ignore[method-assign]
            with trio.fail_after(30):
                while calls["get"] < 3 or calls["put"] < 2:  # noqa: ASYNC110 - polling state
                    await trio.sleep(0.05)
            assert await forward_status(boot, a.node) == "ok"


async def test_strangers_that_come_and_go_leave_no_note_behind() -> None:
    """py-libp2p's swarm noted every peer that ever disconnected (for a back-off of an
    auto-connector this node never runs, whose rounds alone pruned it): one entry per
    stranger, for as long as the node ran."""
    async with open_peer(local_config()) as node:
        for _ in range(STRANGERS):
            await stranger(local_config(), node)
        network = node.host.get_network()
        with trio.fail_after(30):
            while network.connections:  # noqa: ASYNC110 - the strangers hang up
                await trio.sleep(0.05)
        assert not network.auto_connector._recent_disconnects  # type: ignore[attr-defined]
