"""A ``params`` request says the most bytes its requester takes (``max_bytes``, its own
expert's size): a replica whose parameters are larger refuses ``too_large`` before it
copies and encodes them, and a replica of a release older than the field (which
refuses it as malformed) is asked again without it. Real runtimes and RPC servers on
memory links; the averager is the production ``ReplicaAverager`` over
``SwarmReplicas``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import trio

from volunteerd.config import Config, ReplicasConfig
from volunteerd.errors import MalformedFrame, ReplyTooLarge
from volunteerd.identity import Identity
from volunteerd.net import Handler, Reply, Request, Verb
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.averaging import ReplicaAverager
from volunteerd.server.pipeline import expert_handlers
from volunteerd.server.replicas import OLDER_RECHECK_S, SwarmReplicas
from volunteerd.testing.faulty import Faults
from volunteerd.testing.inprocess import InProcessServer, World, open_world
from volunteerd.wire import encode_frame
from volunteerd.wire.messages import ParamsRequest

UID = "ffn.0.0"


def config_of(hidden: int) -> Config:
    return Config.model_validate(
        {
            "experts": {"uids": UID, "hidden_dim": hidden},
            "runtime": {"device": "cpu", "max_batch_wait_s": 0.001},
        }
    )


def test_a_request_without_a_cap_is_the_same_bytes_as_before() -> None:
    """Older releases forbid unknown fields: a request without ``max_bytes`` must be
    what they read; one with it round-trips within its bounds."""
    assert encode_frame(ParamsRequest(uid=UID)) == (
        b'VD\x01\x00\x11\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00{"uid":"ffn.0.0"}'
    )
    capped = ParamsRequest(uid=UID, max_bytes=33_570_816)
    assert ParamsRequest.model_validate_json(capped.model_dump_json()) == capped
    for bad in ("-1", "1e300", '"all"'):
        with pytest.raises(ValueError):
            ParamsRequest.model_validate_json(f'{{"uid":"{UID}","max_bytes":{bad}}}')


def count_reads(server: InProcessServer) -> list[int]:
    """How many times ``server``'s runtime is asked to read an expert (a ``params``
    reply's copy and encoding), one entry a read."""
    runtime = server.runtime
    reads: list[int] = []
    with_expert = runtime.with_expert

    async def counted(uid: str, fn: Callable[[Any], Any]) -> Any:
        reads.append(1)
        return await with_expert(uid, fn)

    runtime.with_expert = counted  # type: ignore[method-assign]
    return reads


def averager_of(world: World, own: InProcessServer, peer: Any) -> ReplicaAverager:
    """``own``'s averager, finding its replicas in the world's table and calling them
    with ``peer``'s client."""
    node = SimpleNamespace(dht=world.lookup, rpc=peer.rpc, peer_id=own.peer_id)
    replicas = SwarmReplicas(cast(Any, node), lookup_s=5.0)
    return ReplicaAverager(own.runtime, replicas, ReplicasConfig())


async def test_a_replica_larger_than_the_cap_refuses_before_building_its_reply() -> None:
    """Three replicas of ``UID``: ours (hidden 32), one of the same width, one of width
    64 (another project's settings under the same uid). The wide one refuses our
    request from its ``max_bytes`` and never reads its expert; it is rejected as
    ``too_large`` as before, and we average with the other. Before, it copied and
    encoded its 4x larger parameters every round for a reply refused from its prefix."""
    async with open_world(config_of(32)) as world:
        own = await world.add_server(UID)
        same = await world.add_server(UID)
        wide = await world.add_server(UID, config=config_of(64))
        same_reads, wide_reads = count_reads(same), count_reads(wide)
        async with world.open_peer(ip="10.0.0.1") as peer:
            averager = averager_of(world, own, peer)
            assert await averager.average(UID) == 1
            stats = averager.statistics()
            assert stats.rejected == {"too_large": 1}
            assert (same_reads, wide_reads) == ([1], [])
            assert wide.rpc_server is not None
            assert wide.rpc_server.stats.errors == {"too_large": 1}
            assert wide.rpc_server.stats.bytes_out < 1024  # the refusal alone

            # asked directly with a tiny cap: the same, and the reply's cap still holds
            replicas = cast(SwarmReplicas, averager.source)
            with pytest.raises(ReplyTooLarge):
                await replicas.fetch(same.peer_id, UID, max_bytes=16)
            assert same_reads == [1]


NEW_FIELDS = ("max_bytes", "unless_version")


@asynccontextmanager
async def older_release(
    world: World, knows: tuple[str, ...] = ()
) -> AsyncIterator[tuple[InProcessServer, list[str]]]:
    """A replica of ``UID`` that answers as a release older than the ``params``
    request's fields not in ``knows`` does: a request carrying one is refused
    ``malformed`` (its model forbids unknown fields: "max_bytes: Extra inputs are not
    permitted"). Yields it and, per request, the new fields it carried ("+"-joined)."""
    config = world.config
    runtime = ExpertRuntime(
        [UID], config.experts, config.runtime, config.wire, torch.device("cpu"), guard=config.guard
    )
    handlers = expert_handlers(runtime)
    asked: list[str] = []

    async def params(request: Request) -> Reply:
        sent = [name for name in NEW_FIELDS if getattr(request.header, name) is not None]
        asked.append("+".join(sent))
        unknown = [name for name in sent if name not in knows]
        if unknown:
            raise MalformedFrame(
                f"bad ParamsRequest header: {unknown[0]}: Extra inputs are not permitted"
            )
        return await handlers[Verb.PARAMS](request)

    served: dict[Verb, Handler] = {**handlers, Verb.PARAMS: params}
    server = InProcessServer(Identity.generate(), runtime, Faults())
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, world.network, served, config)
        world.lookup.announce(server.identity, server.peer_id, [UID])
        yield server, asked
        nursery.cancel_scope.cancel()


async def test_a_replica_older_than_the_cap_is_asked_again_without_it() -> None:
    """An older replica refuses a request with ``max_bytes`` as malformed: asked again
    at once without it, it is averaged with, and later rounds ask it without the field
    (one request a round) until ``OLDER_RECHECK_S`` has passed, when it is tried with
    it again (it may have been upgraded). Sent to it unconditionally, the field would
    have made every older replica "unreachable" every round."""
    async with open_world(config_of(32)) as world:
        own = await world.add_server(UID)
        async with older_release(world) as (old, asked), world.open_peer(ip="10.0.0.1") as peer:
            averager = averager_of(world, own, peer)
            # both fields refused, one after the other (the newest first)
            assert await averager.average(UID) == 1
            assert asked == ["max_bytes+unless_version", "max_bytes", ""]
            assert await averager.average(UID) == 1
            assert asked[3:] == [""]
            # an hour later (the runtimes' worker threads rule out a virtual clock)
            replicas = cast(SwarmReplicas, averager.source)
            replicas._older[old.peer_id] -= OLDER_RECHECK_S
            assert await averager.average(UID) == 1
            assert asked[4:] == ["max_bytes", ""]
            assert averager.statistics().rejected == {}
