"""Sybil floods of the DHT: does a trainer still reach honest experts, and what does
a storing node spend on others' records?

What it measures
    ``--honest`` daemons (one process, real libp2p on 127.0.0.1, tiny experts) each host
    the 2x2 grid ``ffn.[0:2].[0:2]`` and announce it. Then ``--attackers`` fresh Ed25519
    identities (for each count in the list) announce records for ``ffn.``, ``ffn.0.``
    and ``ffn.1.`` with the longest accepted lifetime, half pointing at an attacker
    host, half at a closed port, stored with the real ``dht-store`` verb on every
    storing node through two attacker connections. A trainer then runs ``--steps``
    forward+backward steps of a ``RemoteMixtureOfExperts`` (k_best=2, k_min=1, batch
    16): the share of its expert calls answered by an honest server is the first
    result. Last, ``--fat`` identities store one record each with 4,096 children (the
    issue's records): what the bootstrap node then holds for others is the second.

    ``--mode off`` runs the same with the defences off: storing nodes without caps or
    quotas (16,384 records a key, 4,096 children, budget and quotas of 4 GiB) and a
    trainer that offers every announced server without asking it first. ``on`` is the
    default configuration. The table has a row per (mode, attackers).

Run::

    .venv/bin/python benchmarks/sybil.py
    .venv/bin/python benchmarks/sybil.py --honest 4 --attackers 40,1000 --mode on,off
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import trio

from volunteerd.identity import Identity
from volunteerd.logs import configure_logging
from volunteerd.moe import NoExpertsAvailable, RemoteMixtureOfExperts, SwarmClient
from volunteerd.net import Node, PeerAddress, Verb
from volunteerd.net.peers import peer_id_for
from volunteerd.net.records import ExpertRecord, StoreRequest, sign_record
from volunteerd.testing import local_config, open_daemon, open_peer

HIDDEN = 16
CLOSED_ADDR = "/ip4/127.0.0.1/tcp/9"
OFF = {
    "max_records_per_key": 16384,
    "max_children_per_record": 4096,
    "max_records_per_writer": 100_000,
    "store_budget_mb": 4096.0,
    "peer_quota_mb": 4096.0,
    "ip_prefix_quota_mb": 4096.0,
}


@dataclass
class Result:
    mode: str
    attackers: int
    calls: int = 0
    honest_calls: int = 0
    skipped_steps: int = 0
    records: int = 0
    store_mib: float = 0.0
    fat_stored: int = 0
    fat_mib: float = 0.0
    seconds: float = 0.0


def records_for(
    identities: Sequence[Identity], keys: Sequence[str], addrs: Sequence[str], children: list[int]
) -> list[ExpertRecord]:
    return [
        sign_record(
            identity,
            str(peer_id_for(identity)),
            key=key,
            addrs=[CLOSED_ADDR] if i % 2 else list(addrs),
            children=children,
            ttl_s=600,
        )
        for i, identity in enumerate(identities)
        for key in keys
    ]


async def flood(
    attacker: Node, targets: Sequence[PeerAddress], records: list[ExpertRecord], batch: int
) -> int:
    stored = 0
    for target in targets:
        for start in range(0, len(records), batch):
            try:
                reply, _ = await attacker.rpc.call(
                    target, Verb.DHT_STORE, StoreRequest(records=records[start : start + batch])
                )
            except Exception:  # a request that failed stored nothing
                continue
            stored += reply.stored
    return stored


async def scenario(args: argparse.Namespace, mode: str, attackers: int, tmp: Path) -> Result:
    result = Result(mode, attackers)
    started = time.monotonic()
    store: dict[str, Any] = {} if mode == "on" else dict(OFF)
    dht = {"announce_period_s": 2.0, "record_ttl_s": 30.0, **store}
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_peer(local_config(dht=dht)))
        server = local_config(
            bootstrap=boot.multiaddrs, uids="ffn.[0:2].[0:2]", experts={"hidden_dim": HIDDEN},
            dht=dht,
        )  # fmt: skip
        daemons = [
            await stack.enter_async_context(open_daemon(server, tmp / f"{mode}-{attackers}-{i}"))
            for i in range(args.honest)
        ]
        honest = {d.node.peer_id for d in daemons}
        hosts = [
            await stack.enter_async_context(open_peer(local_config(bootstrap=boot.multiaddrs)))
            for _ in range(2)
        ]
        storing = [boot.address, *(d.node.address for d in daemons)]
        identities = [Identity.generate() for _ in range(attackers)]
        keys = ["ffn.", "ffn.0.", "ffn.1."]
        async with trio.open_nursery() as nursery:
            for h, host in enumerate(hosts):
                group = identities[h::2]
                records = records_for(group, keys, host.addrs, [0, 1])
                nursery.start_soon(flood, host, storing, records, 100)
        for d in daemons:
            await d.announcer.announce_now()

        client_config = local_config(bootstrap=boot.multiaddrs, dht=dht)
        verify = mode == "on"

        def train() -> None:
            torch.manual_seed(0)
            with SwarmClient(client_config, verify_servers=verify) as client:
                layer = RemoteMixtureOfExperts(
                    HIDDEN, (2, 2), "ffn.", k_best=2, k_min=1, client=client,
                    grace_after_k_min_s=1.0, forward_timeout_s=10.0, backward_timeout_s=10.0,
                )  # fmt: skip
                calls: dict[str, int] = {}
                original = layer._run_calls

                def counting(verb, call_list, *rest):  # type: ignore[no-untyped-def]
                    for call in call_list:
                        calls[call.peer.peer_id] = calls.get(call.peer.peer_id, 0) + 1
                    return original(verb, call_list, *rest)

                layer._run_calls = counting  # type: ignore[method-assign]
                for _ in range(args.steps):
                    x = torch.randn(16, HIDDEN, requires_grad=True)
                    try:
                        layer(x).pow(2).mean().backward()
                    except NoExpertsAvailable:
                        result.skipped_steps += 1
                result.calls = sum(calls.values())
                result.honest_calls = sum(n for p, n in calls.items() if p in honest)

        await trio.to_thread.run_sync(train)
        stats = boot.dht.statistics().records
        result.records, result.store_mib = stats.records, stats.bytes / (1 << 20)

        fat = records_for(
            [Identity.generate() for _ in range(args.fat)], ["ffn."], hosts[0].addrs,
            list(range(4096)),
        )  # fmt: skip
        before = boot.dht.statistics().records.bytes
        result.fat_stored = await flood(hosts[0], [boot.address], fat, 2)
        result.fat_mib = max(0, boot.dht.statistics().records.bytes - before) / (1 << 20)
    result.seconds = time.monotonic() - started
    return result


async def main(args: argparse.Namespace) -> None:
    configure_logging("ERROR")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.mode.split(","):
            for attackers in (int(a) for a in args.attackers.split(",")):
                results.append(await scenario(args, mode, attackers, Path(tmp)))
                r = results[-1]
                print(f"  {mode} {attackers}: done in {r.seconds:.0f} s")
    print(
        f"\n{args.honest} honest servers (2x2 grid each), attackers flood ffn., ffn.0., "
        f"ffn.1. on every storing node; trainer {args.steps} steps, k_best 2; "
        f"then {args.fat} records of 4,096 children"
    )
    print(
        f"{'defences':9} {'attackers':>9} {'calls':>6} {'honest':>7} {'share':>7} "
        f"{'skipped':>8} {'records':>8} {'store MiB':>10} {'fat kept':>9} {'fat MiB':>8}"
    )
    for r in results:
        share = r.honest_calls / r.calls if r.calls else 0.0
        print(
            f"{r.mode:9} {r.attackers:9d} {r.calls:6d} {r.honest_calls:7d} {share:7.1%} "
            f"{r.skipped_steps:8d} {r.records:8d} {r.store_mib:10.2f} {r.fat_stored:9d} "
            f"{r.fat_mib:8.2f}"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Sybil flood of the DHT: honest share and memory")
    p.add_argument("--honest", type=int, default=4)
    p.add_argument("--attackers", default="40,1000", help="comma-separated counts")
    p.add_argument("--mode", default="off,on", help="on (defences), off, or both")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fat", type=int, default=300)
    trio.run(main, p.parse_args())
