"""Bulk replies (``params``, ``shard``) and a transfer quota, on a real expert server
whose streams pass a throttle as a daemon's do: a stranger's tiny requests get at most
its party's share of the day's quota, and the volunteer goes on serving expert calls
instead of pausing until midnight; an honest replica and joiner still get theirs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import torch
import trio

from volunteerd.config import Config
from volunteerd.errors import RemoteError
from volunteerd.experts import to_wire
from volunteerd.identity import Identity
from volunteerd.net import PeerAddress, Throttle, Verb
from volunteerd.net.shard import fetch_shard
from volunteerd.net.throttle import TransferLedger
from volunteerd.runtime import ExpertRuntime
from volunteerd.server.pausing import Volunteer
from volunteerd.server.pipeline import expert_handlers
from volunteerd.server.transfers import TransferBudget
from volunteerd.testing.faulty import Faults
from volunteerd.testing.inprocess import InProcessServer, Peer, World, open_world
from volunteerd.wire import ForwardRequest
from volunteerd.wire.messages import ParamsRequest

HIDDEN = 32  # a params reply of ~33 KB, a shard of ~100 KB
UID = "ffn.0.0"
NOON = 1_700_000_000.0 - 1_700_000_000.0 % 86400 + 12 * 3600  # some day's noon, UTC
DAY_S = 86400.0


def world_config() -> Config:
    return Config.model_validate(
        {
            "experts": {"uids": UID, "hidden_dim": HIDDEN},
            "runtime": {"device": "cpu", "max_batch_wait_s": 0.001},
            # 500 KB a day: fifteen params replies would use it up; a party's share (5%)
            # is less than one reply
            "limits": {"daily_quota_gb": 0.0005},
        }
    )


@dataclass
class Quota:
    server: InProcessServer
    throttle: Throttle
    volunteer: Volunteer
    now: list[float]  # the ledger's clock


@asynccontextmanager
async def quota_server(world: World) -> AsyncIterator[Quota]:
    config = world.config
    runtime = ExpertRuntime(
        [UID], config.experts, config.runtime, config.wire, torch.device("cpu"), guard=config.guard
    )
    now = [NOON]
    throttle = Throttle(config.limits, TransferLedger(None, clock=lambda: now[0]))
    volunteer = Volunteer(
        runtime, throttle, config.limits, state_file=None, limits_file=None, grace_s=5
    )
    handlers = expert_handlers(runtime, gate=volunteer.gate, budget=TransferBudget(throttle))
    server = InProcessServer(Identity.generate(), runtime, Faults())
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: server.serve(
                world.network, handlers, config, throttle=throttle, task_status=task_status
            )
        )
        await nursery.start(volunteer.serve)
        yield Quota(server, throttle, volunteer, now)
        nursery.cancel_scope.cancel()


async def params(peer: Peer, server: PeerAddress) -> int:
    _, tensors = await peer.rpc.call(server, Verb.PARAMS, ParamsRequest(uid=UID))
    return sum(len(t.data) for t in tensors)


async def forward(peer: Peer, server: PeerAddress) -> None:
    meta, data = to_wire(torch.randn(2, HIDDEN))
    await peer.rpc.call(server, Verb.FORWARD, ForwardRequest(uid=UID, tensors=[meta]), [data])


async def test_a_strangers_params_requests_stop_at_its_share_and_serving_goes_on() -> None:
    async with open_world(world_config()) as world, quota_server(world) as q:
        server = q.server.address
        allowance = q.throttle.daily_quota_bytes
        async with (
            world.open_peer(ip="10.0.0.66") as stranger,
            world.open_peer(ip="10.0.0.66") as its_other_identity,
            world.open_peer(ip="10.0.0.2") as replica,
            world.open_peer(ip="10.0.0.3") as joiner,
            world.open_peer(ip="10.0.0.4") as trainer,
        ):
            answered: list[int] = []
            refused: RemoteError | None = None
            for _ in range(40):  # 1.3 MB of replies: the whole quota, and more
                try:
                    answered.append(await params(stranger, server))
                except RemoteError as exc:
                    refused = exc
                    break
            assert refused is not None
            assert refused.code == "rate_limited"
            assert answered  # one whole transfer, larger than the share
            assert sum(answered) <= max(allowance // 20, max(answered))
            # another identity of the same machine shares its budget
            with pytest.raises(RemoteError) as refused_too:
                await params(its_other_identity, server)
            assert refused_too.value.code == "rate_limited"

            # honest peers still get their first transfers: a replica's parameters and
            # a joiner's whole shard
            assert await params(replica, server) > 0
            state = await fetch_shard(joiner.rpc, server, UID, max_bytes=1 << 20)
            assert len(state) > allowance // 20  # more than the share: one whole transfer

            # the quota is not used up, and expert calls are served
            assert not q.throttle.quota_exhausted
            await forward(trainer, server)
            assert q.volunteer.state.mode == "running"
            assert q.throttle.ledger.today < allowance * 3 // 4

            # a new day: a new budget
            q.now[0] += DAY_S
            assert await params(stranger, server) > 0
