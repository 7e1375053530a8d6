"""Expert discovery over real libp2p: signed, expiring records on the closest peers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from volunteerd.identity import Identity
from volunteerd.net import Verb
from volunteerd.net.peers import peer_id_for
from volunteerd.net.records import StoreReply, StoreRequest, sign_record
from volunteerd.testing import local_config, open_daemon, open_peer

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow


async def test_servers_sharing_a_prefix_are_all_found(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        a_config = local_config(bootstrap=boot.multiaddrs, uids="ffn.0.[0:2]")
        b_config = local_config(bootstrap=boot.multiaddrs, uids="ffn.[0:2].1")
        async with (
            open_daemon(a_config, tmp_path / "a") as a,
            open_daemon(b_config, tmp_path / "b") as b,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as client,
        ):
            a_id, b_id = a.node.peer_id, b.node.peer_id
            first = await client.dht.children("ffn.")
            assert {k: {p.peer_id for p in v} for k, v in first.items()} == {
                0: {a_id, b_id},
                1: {b_id},
            }
            second = await client.dht.children("ffn.0.")
            assert {k: {p.peer_id for p in v} for k, v in second.items()} == {
                0: {a_id},
                1: {a_id, b_id},
            }
            hosts = await client.dht.find_expert("ffn.0.1")
            assert {p.peer_id for p in hosts} == {a_id, b_id}
            assert all(p.addrs for p in hosts), "records carry dialable addresses"
            assert await client.dht.find_expert("ffn.1.0") == []


async def test_announcements_outlive_their_ttl_because_they_are_refreshed(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(bootstrap=boot.multiaddrs, uids="ffn.0.0")
        async with (
            open_daemon(config, tmp_path / "a") as a,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as client,
        ):
            for _ in range(3):
                await trio.sleep(config.dht.record_ttl_s)
                found = await client.dht.find_expert("ffn.0.0")
                assert [p.peer_id for p in found] == [a.node.peer_id]


async def test_a_cleanly_stopped_server_vanishes_at_once(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        # Records that would live a minute: only the withdrawal can remove them now.
        config = local_config(
            bootstrap=boot.multiaddrs, uids="ffn.0.[0:2]", dht={"record_ttl_s": 60.0}
        )
        async with open_peer(local_config(bootstrap=boot.multiaddrs)) as client:
            async with open_daemon(config, tmp_path / "a"):
                assert len(await client.dht.find_expert("ffn.0.1")) == 1
            assert await client.dht.find_expert("ffn.0.1") == []
            assert await client.dht.children("ffn.") == {}


async def test_a_record_signed_by_another_key_is_rejected(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(bootstrap=boot.multiaddrs, uids="ffn.0.0")
        async with (
            open_daemon(config, tmp_path / "a") as honest,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as attacker,
        ):
            forger = Identity.generate()
            # Claim that the honest server hosts ffn.7.7 (and point at the attacker).
            forged = sign_record(
                forger,
                honest.node.peer_id,
                key="ffn.7.7",
                addrs=attacker.addrs,
                ttl_s=10,
            )
            reply, _ = await attacker.rpc.call(
                boot.address, Verb.DHT_STORE, StoreRequest(records=[forged])
            )
            assert isinstance(reply, StoreReply)
            assert (reply.stored, reply.rejected) == (0, 1)
            assert await attacker.dht.find_expert("ffn.7.7") == []

            # The same record signed with the attacker's own key is accepted: it only
            # speaks for the attacker.
            own = sign_record(
                forger,
                str(peer_id_for(forger)),
                key="ffn.7.7",
                addrs=attacker.addrs,
                ttl_s=10,
            )
            reply, _ = await attacker.rpc.call(
                boot.address, Verb.DHT_STORE, StoreRequest(records=[own])
            )
            assert reply.stored == 1


async def test_records_are_stored_on_the_replication_closest_peers(tmp_path: Path) -> None:
    replication = 3
    async with open_peer(local_config()) as boot:
        cfg = local_config(bootstrap=boot.multiaddrs, dht={"replication": replication})
        async with (
            open_peer(cfg) as p1,
            open_peer(cfg) as p2,
            open_peer(cfg) as p3,
            open_daemon(
                local_config(
                    bootstrap=boot.multiaddrs, uids="ffn.0.0", dht={"replication": replication}
                ),
                tmp_path / "a",
            ) as server,
        ):
            outcome = await server.announcer.announce_now()
            assert set(outcome.acks) == {"ffn.", "ffn.0.", "ffn.0.0"}
            assert outcome.min_acks == replication
            holders = [n for n in (boot, p1, p2, p3, server.node) if n.dht.records.get("ffn.0.0")]
            assert len(holders) == replication


async def test_joining_peers_enter_the_bootstrap_peers_routing_table_and_find_each_other() -> None:
    # A node asks its bootstrap peer for its neighbourhood as soon as it is connected,
    # which is usually before the bootstrap peer's identify has learnt its addresses:
    # it must still be added (once identify ends), or later joiners never hear of it.
    async with open_peer(local_config()) as boot:
        cfg = local_config(bootstrap=boot.multiaddrs)
        async with open_peer(cfg), open_peer(cfg):
            with trio.fail_after(10):
                while boot.dht.routing_table_size() < 2:  # noqa: ASYNC110 - polling
                    await trio.sleep(0.05)
            async with open_peer(cfg) as third:  # learns of both through boot
                with trio.fail_after(10):
                    while third.dht.routing_table_size() < 3:  # noqa: ASYNC110 - polling
                        await trio.sleep(0.05)


async def test_a_server_whose_clock_is_hours_off_is_found_on_the_swarms_time(
    tmp_path: Path,
) -> None:
    """A home PC two hours ahead (a dual boot keeping local time in the hardware clock):
    every record it signed was refused as issued in the future, and it refused its
    peers' as expired, so no trainer ever found it (an outside probe). Its peers'
    records outvote its clock (net/swarm_clock.py) and it is found."""
    async with open_peer(local_config()) as boot:
        config = local_config(bootstrap=boot.multiaddrs, uids="ffn.0.0")
        async with (
            open_daemon(config, tmp_path / "a"),
            open_daemon(config, tmp_path / "b"),
            open_daemon(
                local_config(bootstrap=boot.multiaddrs, uids="ffn.0.1"), tmp_path / "off"
            ) as off,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as client,
        ):
            off.node.dht.clock._wall = lambda: time.time() + 7200
            # what it announced before its clock went wrong has expired by then
            await trio.sleep(config.dht.record_ttl_s + config.dht.announce_period_s)
            with trio.fail_after(30):
                while not await client.dht.find_expert("ffn.0.1"):  # noqa: ASYNC110 - a lookup
                    await trio.sleep(0.5)
            assert off.node.dht.clock.offset == pytest.approx(-7200, abs=30)
