"""Sybil floods of the DHT (issue 12, item 4), over real libp2p on 127.0.0.1.

A thousand fresh Ed25519 identities announce records under the prefixes honest servers
use; fat records try to pin memory on every storing node; strangers' manifests try to
push a trusted owner's manifest out. The attackers store their signed records with the
real ``dht-store`` and ``manifest-store`` verbs from a few attacker hosts (one
connection carries many identities, as a cheap attacker would do it).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from volunteerd.identity import Identity
from volunteerd.moe import RemoteMixtureOfExperts, SwarmClient
from volunteerd.net import Node, PeerAddress, Verb
from volunteerd.net.peers import peer_id_for
from volunteerd.net.records import (
    ExpertRecord,
    ManifestRecord,
    ManifestStoreRequest,
    StoreReply,
    StoreRequest,
    sign_record,
)
from volunteerd.swarm.manifest import (
    ExperimentManifest,
    choose_trusted,
    lookup_manifests,
    sign_manifest,
)
from volunteerd.testing import local_config, open_daemon, open_peer

pytestmark = pytest.mark.slow

HIDDEN = 16
ATTACKERS = 1000
# Nothing listens on the discard port: half the fake records point there, the other
# half at an attacker host (whose Noise handshake then proves another identity).
CLOSED_ADDR = "/ip4/127.0.0.1/tcp/9"


def sybil_records(
    identities: Sequence[Identity], keys: Sequence[str], addrs: Sequence[str], **kw: object
) -> list[ExpertRecord]:
    records = []
    for i, identity in enumerate(identities):
        where = [CLOSED_ADDR] if i % 2 else list(addrs)
        for key in keys:
            records.append(
                sign_record(
                    identity,
                    str(peer_id_for(identity)),
                    key=key,
                    addrs=where,
                    children=kw.get("children", [0, 1]),  # type: ignore[arg-type]
                    ttl_s=600,  # the longest any node accepts
                )
            )
    return records


async def flood(
    attacker: Node, targets: Sequence[PeerAddress], records: list[ExpertRecord], batch: int
) -> tuple[int, int]:
    """Store ``records`` on every target through ``attacker``'s connection; returns
    (stored, rejected) summed over the targets."""
    stored = rejected = 0
    for target in targets:
        for start in range(0, len(records), batch):
            reply, _ = await attacker.rpc.call(
                target, Verb.DHT_STORE, StoreRequest(records=records[start : start + batch])
            )
            assert isinstance(reply, StoreReply)
            stored += reply.stored
            rejected += reply.rejected
    return stored, rejected


async def test_trainer_routes_to_honest_experts_through_a_flood_of_1000_identities(
    tmp_path: Path,
) -> None:
    async with open_peer(local_config()) as boot:
        # All nodes share this process: verifying the flood's signatures starves the
        # honest servers' event loop for a while, so their records live long enough.
        server = local_config(
            bootstrap=boot.multiaddrs,
            uids="ffn.[0:2].[0:2]",
            experts={"hidden_dim": HIDDEN},
            dht={"announce_period_s": 2.0, "record_ttl_s": 30.0},
        )
        async with (
            open_daemon(server, tmp_path / "a") as a,
            open_daemon(server, tmp_path / "b") as b,
            open_daemon(server, tmp_path / "c") as c,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as attacker_1,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as attacker_2,
        ):
            honest = {d.node.peer_id for d in (a, b, c)}
            storing = [boot.address, a.node.address, b.node.address, c.node.address]
            identities = [Identity.generate() for _ in range(ATTACKERS)]
            keys = ["ffn.", "ffn.0.", "ffn.1."]
            half = ATTACKERS // 2
            async with trio.open_nursery() as nursery:
                for attacker, group in (
                    (attacker_1, identities[:half]),
                    (attacker_2, identities[half:]),
                ):
                    records = sybil_records(group, keys, attacker.addrs)
                    nursery.start_soon(flood, attacker, storing, records, 100)

            # Each storing node kept the servers it knew before the flood, and their
            # refreshes still reach it (the issue: "reached no peer").
            for running in (a, b, c):
                outcome = await running.announcer.announce_now()
                assert outcome.min_acks >= 1
            stats = boot.dht.statistics().records
            assert stats.refused.get("key_full", 0) > 0
            # three flooded prefixes at the per-key cap, and 4 uid keys of 3 servers each
            assert stats.records <= 3 * server.dht.max_records_per_key + 4 * 3
            found = await boot.dht.get(["ffn.0."])
            assert {r.peer_id for r in found["ffn.0."][:3]} == honest

            client_config = local_config(bootstrap=boot.multiaddrs)

            def train() -> tuple[Counter[str], set[str]]:
                """Six training steps; returns the calls made to each peer, and the bans."""
                torch.manual_seed(0)
                calls: Counter[str] = Counter()
                with SwarmClient(client_config) as client:
                    layer = RemoteMixtureOfExperts(
                        HIDDEN, (2, 2), "ffn.", k_best=2, k_min=1, client=client,
                        grace_after_k_min_s=2.0,
                    )  # fmt: skip
                    run_calls = layer._run_calls

                    def counting(verb: Verb, batch: list[Any], *args: Any) -> Any:
                        calls.update(call.peer.peer_id for call in batch)
                        return run_calls(verb, batch, *args)

                    layer._run_calls = counting  # type: ignore[method-assign,assignment]
                    for _ in range(6):
                        x = torch.randn(16, HIDDEN, requires_grad=True)
                        layer(x).pow(2).mean().backward()
                    assert layer.stats.forward_ok > 0
                    return calls, set(client.directory.banned)

            calls, banned = await trio.to_thread.run_sync(train)
            to_honest = sum(n for peer, n in calls.items() if peer in honest)
            assert to_honest >= 0.95 * sum(calls.values()), calls
            assert banned <= honest, "no call went to a fake server and failed"


async def test_a_flood_of_fat_records_stays_within_the_storing_nodes_budget(
    tmp_path: Path,
) -> None:
    budget_mb = 1.0
    async with open_peer(local_config(dht={"store_budget_mb": budget_mb})) as boot:
        server = local_config(bootstrap=boot.multiaddrs, uids="ffn.0.[0:2]")
        async with (
            open_daemon(server, tmp_path / "a") as honest,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as attacker,
        ):
            # The records: 4,096 children each. Refused before any signature.
            fat = sybil_records(
                [Identity.generate() for _ in range(30)], ["ffn."], attacker.addrs,
                children=list(range(4096)),
            )  # fmt: skip
            assert await flood(attacker, [boot.address], fat, 2) == (0, 30)
            # The largest records a node accepts (256 children), from 1,500 identities.
            largest = sybil_records(
                [Identity.generate() for _ in range(1500)], ["ffn."], attacker.addrs,
                children=list(range(256)),
            )  # fmt: skip
            stored, rejected = await flood(attacker, [boot.address], largest, 30)
            stats = boot.dht.statistics().records
            assert stats.bytes <= stats.budget_bytes == int(budget_mb * (1 << 20) * 3 / 4)
            assert stored < 1500
            assert rejected == 1500 - stored
            assert stats.refused["too_large"] == 30
            assert stats.refused.get("peer_quota", 0) + stats.refused.get("budget", 0) > 0
            # The honest server, there before the flood, is still found.
            hosts = await attacker.dht.find_expert("ffn.0.1")
            assert [p.peer_id for p in hosts] == [honest.node.peer_id]


def manifest(owner: Identity, name: str, now: float, days: float) -> ExperimentManifest:
    return ExperimentManifest(
        name=name, grid=(2, 2), hidden_dim=16, owner=str(peer_id_for(owner)),
        issued_at=now, expires_at=now + days * 86400,
    )  # fmt: skip


async def test_strangers_manifests_neither_evict_nor_crowd_out_a_trusted_owner() -> None:
    owner = Identity.generate()
    owner_id = str(peer_id_for(owner))
    now = time.time()
    async with (
        open_peer(local_config()) as boot,
        open_peer(local_config(bootstrap=boot.multiaddrs)) as attacker,
    ):
        async with open_peer(local_config(bootstrap=boot.multiaddrs)) as publisher:
            first = sign_manifest(manifest(owner, "exp", now, 7), owner)
            assert await publisher.dht.put_manifest(first) >= 1

        async def store(records: list[ManifestRecord]) -> int:
            stored = 0
            for start in range(0, len(records), 4):
                request = ManifestStoreRequest(records=records[start : start + 4])
                reply, _ = await attacker.rpc.call(boot.address, Verb.MANIFEST_STORE, request)
                assert isinstance(reply, StoreReply)
                stored += reply.stored
            return stored

        # 16 fresh owner keys, 30-day manifests under the same name.
        strangers = [Identity.generate() for _ in range(16)]
        await store([sign_manifest(manifest(s, "exp", now, 30), s) for s in strangers])
        found = await attacker.dht.get_manifests("exp", owner_id)
        assert [r.owner for r in found] == [owner_id]
        records = await lookup_manifests(attacker.dht, "exp", [owner_id])
        chosen = choose_trusted("exp", records, [owner_id])
        assert chosen is not None
        assert chosen.owner == owner_id

        # One key, 1,023 junk names: the owner's new experiment is still stored.
        junk = Identity.generate()
        stored = await store(
            [sign_manifest(manifest(junk, f"junk-{i}", now, 30), junk) for i in range(1023)]
        )
        assert stored == boot.dht.manifests.limits.max_per_writer
        async with open_peer(local_config(bootstrap=boot.multiaddrs)) as publisher:
            new = sign_manifest(manifest(owner, "new-exp", now, 7), owner)
            assert await publisher.dht.put_manifest(new) >= 1
        assert boot.dht.manifests.get("new-exp") == [new]
