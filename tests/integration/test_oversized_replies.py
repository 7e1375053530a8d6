"""A hostile replica answering with far more than was asked for, over libp2p on
127.0.0.1: the honest node refuses the reply from its prefix, without reading its body
(wire.max_body_bytes, 256 MiB, bounds only what a call cannot size), and treats the
peer as failed.

Found with four hostile identities answering ``params`` for a 33 KB expert with 255 MiB
each: the honest daemon went from 367 MiB to 1.5 GiB of memory, every averaging round.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
import trio

from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.config.models import ReplicasConfig
from volunteerd.errors import ShardError
from volunteerd.identity import Identity
from volunteerd.net import Node, Verb, open_node
from volunteerd.net.records import sign_record
from volunteerd.net.rpc import Reply, Request
from volunteerd.net.shard import fetch_shard
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.averaging import ReplicaAverager
from volunteerd.server.replicas import SwarmReplicas
from volunteerd.testing import local_config, open_peer
from volunteerd.wire import ShardReply, TensorMeta
from volunteerd.wire.messages import ParamsReply

# Real libp2p nodes on loopback, in wall-clock time.
pytestmark = pytest.mark.slow

UID = "ffn.0.0"
HUGE = 16 << 20  # each hostile reply's body; the expert's parameters are ~33 KB
# What the honest node may read while refusing one: the reply's 16-byte prefix, and the
# DHT lookup that found the replica. Far below one hostile body.
READ_AT_MOST = 256 << 10
DHT = {"record_ttl_s": 60.0}


class Hostile:
    """Handlers that answer ``params`` and ``shard`` with HUGE bytes, whatever was asked."""

    def __init__(self) -> None:
        self.asked: dict[Verb, int] = {Verb.PARAMS: 0, Verb.SHARD: 0}
        self.body = bytes(HUGE)

    async def params(self, request: Request) -> Reply:
        self.asked[Verb.PARAMS] += 1
        meta = TensorMeta(dtype="float32", shape=(HUGE // 4,))
        header = ParamsReply(uid=request.header.uid, updates=0, names=["up.weight"], tensors=[meta])
        return Reply(header, [self.body])

    async def shard(self, request: Request) -> Reply:
        self.asked[Verb.SHARD] += 1
        asked = request.header
        # The header claims the length asked for; the frame carries HUGE bytes.
        header = ShardReply(
            uid=asked.uid, sha256="0" * 64, total=HUGE, offset=asked.offset, length=asked.length
        )
        return Reply(header, [self.body])


@asynccontextmanager
async def honest_and_hostile() -> AsyncIterator[tuple[Node, Node, Hostile]]:
    """An honest node, and a hostile one announcing UID in the DHT they share."""
    hostile = Hostile()
    async with open_peer(local_config(dht=DHT)) as boot:
        config = local_config(bootstrap=boot.multiaddrs, dht=DHT)
        handlers = {Verb.PARAMS: hostile.params, Verb.SHARD: hostile.shard}
        async with (
            open_peer(config) as honest,
            open_node(Identity.generate(), config, handlers=handlers) as evil,
        ):
            record = sign_record(evil.identity, evil.peer_id, key=UID, addrs=evil.addrs, ttl_s=60)
            with trio.fail_after(30):
                while not (await evil.dht.put([record])).acks[UID]:  # noqa: ASYNC110 - polling
                    await trio.sleep(0.2)  # the swarm is still forming
            yield honest, evil, hostile


def runtime_of(uid: str) -> ExpertRuntime:
    return ExpertRuntime(
        [uid], ExpertsConfig(hidden_dim=32), RuntimeConfig(device="cpu"), WireLimits(),
        torch.device("cpu"),
    )  # fmt: skip


async def test_params_reply_over_the_experts_size_is_refused_unread_and_counted() -> None:
    async with honest_and_hostile() as (honest, evil, hostile):
        runtime = runtime_of(UID)
        own = runtime.backend(UID).parameter_copies()
        assert sum(v.numel() * 4 for v in own.values()) < 64 << 10
        source = SwarmReplicas(honest, lookup_s=5.0)
        with trio.fail_after(30):
            while await source.replicas(UID) != [evil.peer_id]:  # noqa: ASYNC110 - polling
                await trio.sleep(0.2)  # the record still spreading
        averager = ReplicaAverager(runtime, source, ReplicasConfig(average_every_s=60.0))

        before = honest.throttle.bytes_down
        assert await averager.average(UID) == 0
        assert honest.throttle.bytes_down - before < READ_AT_MOST
        assert hostile.asked[Verb.PARAMS] == 1
        stats = averager.statistics()
        assert stats.rejected == {"too_large": 1}
        assert stats.rejected_by_peer == {evil.peer_id: 1}
        after = runtime.backend(UID).parameter_copies()
        assert all(torch.equal(after[k], own[k]) for k in own)

        # Backing off: the next round does not ask it again.
        assert await averager.average(UID) == 0
        assert hostile.asked[Verb.PARAMS] == 1


async def test_shard_chunk_longer_than_asked_for_is_refused_unread_and_not_retried() -> None:
    async with honest_and_hostile() as (honest, evil, hostile):
        before = honest.throttle.bytes_down
        with pytest.raises(ShardError, match=r"reply refused.*cap of 65536"):
            await fetch_shard(
                honest.rpc, evil.address, UID, max_bytes=1 << 20, chunk_bytes=64 << 10
            )
        assert honest.throttle.bytes_down - before < READ_AT_MOST
        assert hostile.asked[Verb.SHARD] == 1
