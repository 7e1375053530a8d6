"""Replicas that agree, with nobody training, send each other no weights: a ``params``
request names the version of the replica's last reply (``unless_version``), and a
replica whose weights are still that version answers "unchanged" without tensors.
Before, idle replicas fetched every expert whole every round (33.5 MB an expert at
hidden 1024). Real runtimes and RPC servers on memory links; the averagers are the
production ``ReplicaAverager`` over ``SwarmReplicas``, one on each replica."""

from __future__ import annotations

from typing import Any

import torch

from tests.inprocess.test_params_cap import UID, averager_of, config_of, older_release
from volunteerd.runtime.averaging import ReplicaAverager
from volunteerd.testing.inprocess import InProcessServer, World, open_world
from volunteerd.wire.messages import ParamsReply, ParamsRequest

HIDDEN = 32
ROUNDS_TO_AGREE = 40  # a hang guard: two replicas 1e-3 apart agree after ~12


def params_bytes(server: InProcessServer) -> int:
    return sum(p.numel() * 4 for p in server.runtime.backend(UID).module.parameters())


def sent(*servers: InProcessServer) -> int:
    """What ``servers`` sent over their RPC servers so far (headers and bodies)."""
    total = 0
    for server in servers:
        assert server.rpc_server is not None
        total += server.rpc_server.stats.bytes_out
    return total


async def nudge(server: InProcessServer, scale: float) -> None:
    """Move ``server``'s weights by ``scale`` of noise, as training apart would."""

    def move(b: Any) -> None:
        b.set_parameters(
            {k: v + scale * torch.randn_like(v) for k, v in b.live_parameters().items()}
        )

    await server.runtime.with_expert(UID, move)


async def step(server: InProcessServer) -> None:
    """One optimizer step on ``server``'s expert, as a trainer's backward makes."""

    def apply(b: Any) -> None:
        for p in b.module.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        b.step()

    await server.runtime.with_expert(UID, apply)


def revision(server: InProcessServer) -> int:
    return int(server.runtime.backend(UID).revision)


async def agree(
    a: InProcessServer, b: InProcessServer, avg_a: ReplicaAverager, avg_b: ReplicaAverager
) -> None:
    """Rounds on both sides until a round of each wrote nothing (they agree)."""
    for _ in range(ROUNDS_TO_AGREE):
        before = revision(a) + revision(b)
        assert await avg_a.average(UID) == 1
        assert await avg_b.average(UID) == 1
        if revision(a) + revision(b) == before:
            return
    raise AssertionError(f"no agreement in {ROUNDS_TO_AGREE} rounds")


async def open_pair(world: World, peer: Any) -> tuple[Any, ...]:
    a = await world.add_server(UID)
    b = await world.add_server(UID)
    await nudge(b, 1e-3)
    return a, b, averager_of(world, a, peer), averager_of(world, b, peer)


async def test_idle_replicas_send_each_other_no_weights() -> None:
    """Once two replicas agree, 10 more rounds on each side, nobody training, send a
    few hundred bytes of headers: before, each round sent the whole expert each way
    (10 rounds x 2 x 8.6 KB here; 33.5 MB an expert at hidden 1024)."""
    async with open_world(config_of(HIDDEN)) as world, world.open_peer(ip="10.0.0.1") as peer:
        a, b, avg_a, avg_b = await open_pair(world, peer)
        await agree(a, b, avg_a, avg_b)
        before, revisions = sent(a, b), (revision(a), revision(b))
        for _ in range(10):
            assert await avg_a.average(UID) == 1
            assert await avg_b.average(UID) == 1
        idle = sent(a, b) - before
        assert idle < 20 * 512, f"{idle} bytes in 20 idle fetches of {params_bytes(a)} each"
        assert (revision(a), revision(b)) == revisions  # nothing written either
        assert avg_a.statistics().unchanged >= 10
        assert avg_a.statistics().last_shift[UID] == 0.0


async def test_a_step_on_either_side_fetches_again() -> None:
    """After an optimizer step on the replica, the next round fetches its weights and
    moves ours; after a step on ours, the next round fetches the replica's whole too
    (it is unchanged, but ours are no longer what agreed with it)."""
    async with open_world(config_of(HIDDEN)) as world, world.open_peer(ip="10.0.0.1") as peer:
        a, b, avg_a, avg_b = await open_pair(world, peer)
        await agree(a, b, avg_a, avg_b)
        size = params_bytes(a)

        await step(b)
        before, moved = sent(b), revision(a)
        assert await avg_a.average(UID) == 1
        assert sent(b) - before >= size
        assert revision(a) == moved + 1  # averaged with the stepped weights

        await agree(a, b, avg_a, avg_b)
        await step(a)
        before = sent(b)
        assert await avg_a.average(UID) == 1
        assert sent(b) - before >= size

        # a catch-up's rounds always fetch whole, whatever agreed before
        await agree(a, b, avg_a, avg_b)
        before = sent(b)
        assert len(await avg_a.gather(UID, conditional=False)) == 1
        assert sent(b) - before >= size


async def test_a_replica_older_than_unless_version_is_still_averaged() -> None:
    """A replica of the release before ``unless_version`` (it knows ``max_bytes``)
    refuses the field as malformed: asked again at once without it, averaged with, and
    asked without it in later rounds (whole weights, as before)."""
    async with open_world(config_of(HIDDEN)) as world:
        own = await world.add_server(UID)
        async with (
            older_release(world, knows=("max_bytes",)) as (old, asked),
            world.open_peer(ip="10.0.0.1") as peer,
        ):
            averager = averager_of(world, own, peer)
            for _ in range(3):
                before = sent(old)
                assert await averager.average(UID) == 1
                assert sent(old) - before >= params_bytes(own)
            assert asked == ["max_bytes+unless_version", "max_bytes", "max_bytes", "max_bytes"]
            assert averager.statistics().rejected == {}


async def test_an_unchanged_reply_not_asked_for_is_refused() -> None:
    """A replica that answers "unchanged" to a request that named no version of it (a
    lie: it cannot know what we hold) is refused as a bad reply, not averaged as ours."""
    async with open_world(config_of(HIDDEN)) as world, world.open_peer(ip="10.0.0.1") as peer:
        _, _, avg_a, _ = await open_pair(world, peer)
        real = avg_a.source.fetch

        async def lying(peer_id: str, uid: str, **kwargs: Any) -> Any:
            reply, _ = await real(peer_id, uid, **kwargs)
            return reply.model_copy(
                update={"names": [], "tensors": [], "version": "x.1", "unchanged": True}
            ), []

        avg_a.source.fetch = lying  # type: ignore[method-assign]
        assert await avg_a.average(UID) == 0
        assert avg_a.statistics().rejected == {"names": 1}


def test_the_new_fields_are_left_out_when_absent() -> None:
    """Older releases forbid unknown fields: a request without ``unless_version`` and
    a reply without ``version`` are the bytes they read."""
    request = ParamsRequest(uid=UID, max_bytes=64)
    assert request.model_dump_json() == '{"uid":"ffn.0.0","max_bytes":64}'
    reply = ParamsReply(uid=UID, updates=3, names=[], tensors=[])
    assert (
        reply.model_dump_json()
        == '{"status":"ok","uid":"ffn.0.0","updates":3,"names":[],"tensors":[]}'
    )
    unchanged = ParamsReply(
        uid=UID, updates=3, names=[], tensors=[], version="ab.4", unchanged=True
    )
    assert ParamsReply.model_validate_json(unchanged.model_dump_json()) == unchanged
