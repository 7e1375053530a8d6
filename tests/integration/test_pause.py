"""Pause, resume, snooze, the quota and the schedule on real daemons over loopback
libp2p: a paused daemon finishes what it was doing, vanishes from lookups and refuses
new work, trainers route around it, and it comes back (by hand, at a snooze's end,
after a restart, when the schedule allows it again)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from torch import nn

from volunteerd.daemon import Running
from volunteerd.errors import RemoteError
from volunteerd.experts import to_wire
from volunteerd.moe import RemoteMixtureOfExperts, SwarmClient
from volunteerd.net import Node, Verb
from volunteerd.server.pausing import Volunteer
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.wire import ForwardRequest

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow

HIDDEN = 16
GRID = "ffn.[0:2].[0:2]"
SLOW_S = 1.0


def controls(daemon: Running) -> Volunteer:
    assert daemon.volunteer is not None
    return daemon.volunteer


def server_config(boot: Node, **sections: Any) -> Any:
    return local_config(
        bootstrap=boot.multiaddrs,
        uids=GRID,
        experts={"hidden_dim": HIDDEN, "seed": 3},
        timeouts={"shutdown_grace_s": 10},  # the bounded wait for in-flight work
        **sections,
    )


async def forward(client: Node, daemon: Running, uid: str = "ffn.0.0") -> torch.Tensor:
    meta, data = to_wire(torch.randn(4, HIDDEN))
    reply, tensors = await client.rpc.call(
        daemon.node.address, Verb.FORWARD, ForwardRequest(uid=uid, tensors=[meta]), [data]
    )
    assert len(reply.tensors) == 1
    return torch.frombuffer(bytearray(tensors[0].data), dtype=torch.float32)


async def servers_of(client: Node, key: str) -> set[str]:
    return {r.peer_id for r in (await client.dht.get([key]))[key]}


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 8.0) -> None:
    with trio.fail_after(within_s):
        while not await check():  # noqa: ASYNC110 - polling the DHT, not an event
            await trio.sleep(0.1)


def work_done(daemon: Running) -> int:
    return sum(s.forward.requests + s.backward.requests for s in daemon.runtime.statistics())


def train(client: SwarmClient, steps: int) -> None:
    """Steps of a small regression through the swarm; every one must get answers."""
    moe = RemoteMixtureOfExperts(
        HIDDEN, (2, 2), "ffn.", k_best=2, k_min=1, grace_after_k_min_s=1.0,
        forward_timeout_s=5.0, backward_timeout_s=5.0, client=client,
    )  # fmt: skip
    head = nn.Linear(HIDDEN, HIDDEN)
    x = torch.randn(16, HIDDEN)
    for _ in range(steps):
        loss = head(moe(x)).pow(2).mean()
        loss.backward()
        assert torch.isfinite(loss)


async def test_pause_drains_withdraws_and_resume_brings_the_experts_back(
    tmp_path: Path,
) -> None:
    async with open_peer(local_config()) as boot:
        config = server_config(boot)
        async with (
            open_daemon(config, tmp_path / "a") as a,
            open_daemon(config, tmp_path / "b") as b,
        ):
            ids = {a.node.peer_id, b.node.peer_id}
            await eventually(lambda: _equals(servers_of(boot, "ffn.0.0"), ids))

            # A slow request is in flight when the volunteer pauses: it still completes.
            backend = a.runtime.backend("ffn.0.0")
            fast = backend.forward

            def slow(inputs: Any) -> Any:
                time.sleep(SLOW_S)
                return fast(inputs)

            backend.forward = slow  # type: ignore[method-assign]
            answered: list[torch.Tensor] = []

            async def in_flight() -> None:
                answered.append(await forward(boot, a))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(in_flight)
                await eventually(_true_when(lambda: controls(a).gate.in_flight == 1))
                await controls(a).pause()
                # pause() returned only once the request in flight was answered (the
                # answer may still be on its way to the client)
                assert controls(a).gate.in_flight == 0
            # ... and that answer was a success, not a refusal
            assert len(answered) == 1
            backend.forward = fast  # type: ignore[method-assign]
            assert torch.isfinite(answered[0]).all()
            assert controls(a).state.mode == "paused"
            assert not controls(a).state.serving

            # Gone from lookups, refusing new work with a code trainers route around.
            await eventually(lambda: _equals(servers_of(boot, "ffn.0.0"), {b.node.peer_id}))
            await eventually(lambda: _equals(servers_of(boot, "ffn."), {b.node.peer_id}))
            with pytest.raises(RemoteError) as refused:
                await forward(boot, a)
            assert refused.value.code == "paused"
            assert boot.peer_id in {str(p) for p in a.node.host.get_network().connections}

            # A trainer's steps all succeed, and none of its work lands on the paused one.
            done_by_a = work_done(a)
            client_config = local_config(bootstrap=boot.multiaddrs)

            def steps_while_paused() -> None:
                with SwarmClient(client_config, refresh_s=0.5) as client:
                    train(client, steps=4)

            await trio.to_thread.run_sync(steps_while_paused)
            assert work_done(a) == done_by_a
            assert work_done(b) > 0

            # Resume: back in lookups, and trainers' requests reach it again.
            await controls(a).resume()
            assert controls(a).state.mode == "running"
            assert controls(a).state.serving
            await eventually(lambda: _equals(servers_of(boot, "ffn.0.0"), ids))
            done_by_a = work_done(a)

            def steps_after_resume() -> None:
                with SwarmClient(client_config, refresh_s=0.5) as client:
                    for _ in range(20):
                        train(client, steps=1)
                        if work_done(a) > done_by_a:
                            return

            await trio.to_thread.run_sync(steps_after_resume)
            assert work_done(a) > done_by_a


async def test_snooze_resumes_by_itself(tmp_path: Path) -> None:
    async with (
        open_peer(local_config()) as boot,
        open_daemon(server_config(boot), tmp_path / "a") as a,
    ):
        me = {a.node.peer_id}
        await eventually(lambda: _equals(servers_of(boot, "ffn.1.1"), me))
        await controls(a).snooze(3.0)
        state = controls(a).state
        assert state.mode == "snoozed"
        assert state.until is not None
        await eventually(lambda: _equals(servers_of(boot, "ffn.1.1"), set()), within_s=2.5)
        await eventually(_true_when(lambda: controls(a).state.mode == "running"))
        await eventually(lambda: _equals(servers_of(boot, "ffn.1.1"), me))
        assert torch.isfinite(await forward(boot, a, "ffn.1.1")).all()


async def test_a_restarted_daemon_comes_back_paused(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        config = server_config(boot)
        async with open_daemon(config, tmp_path / "a") as a:
            await controls(a).pause()
        assert (tmp_path / "a" / "state.json").exists()

        async with open_daemon(config, tmp_path / "a") as again:
            assert controls(again).state.mode == "paused"
            with pytest.raises(RemoteError) as refused:
                await forward(boot, again)
            assert refused.value.code == "paused"
            await trio.sleep(2 * config.dht.announce_period_s)  # it never announced
            assert await servers_of(boot, "ffn.0.0") == set()
            await controls(again).resume()
            await eventually(lambda: _equals(servers_of(boot, "ffn.0.0"), {again.node.peer_id}))

        async with open_daemon(config, tmp_path / "a") as third:  # resumed is kept too
            assert controls(third).state.mode == "running"


async def test_a_used_up_quota_pauses_serving_until_it_is_raised(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        config = server_config(boot)
        async with open_daemon(config, tmp_path / "a") as a:
            me = {a.node.peer_id}
            await eventually(lambda: _equals(servers_of(boot, "ffn.0.1"), me))
            assert a.node.throttle.ledger.total > 1000  # announcing is traffic too
            await controls(a).set_limits(monthly_quota_gb=1e-6)  # 1000 bytes: used up
            assert controls(a).state.mode == "quota"
            assert not controls(a).state.serving
            assert "quota" in controls(a).state.reason
            await eventually(lambda: _equals(servers_of(boot, "ffn.0.1"), set()))
            with pytest.raises(RemoteError, match="quota"):
                await forward(boot, a, "ffn.0.1")

            await controls(a).set_limits(monthly_quota_gb=10)
            assert controls(a).state.mode == "running"
            await eventually(lambda: _equals(servers_of(boot, "ffn.0.1"), me))
        # Changed limits are kept next to the config file; bytes in the data folder.
        overlay = (tmp_path / "a" / "limits.toml").read_text()
        assert "monthly_quota_gb = 10" in overlay
        assert (tmp_path / "a" / "transfer.json").exists()


async def test_the_schedule_withdraws_like_a_pause_and_resume_waits_for_it(
    tmp_path: Path,
) -> None:
    async with (
        open_peer(local_config()) as boot,
        open_daemon(server_config(boot), tmp_path / "a") as a,
    ):
        me = {a.node.peer_id}
        scheduler = a.scheduler
        assert scheduler is not None
        await eventually(lambda: _equals(servers_of(boot, "ffn.1.0"), me))

        # compute only in an hour that is not now: withdrawn, refusing, with the reason
        hour = time.localtime().tm_hour
        window = f"{(hour + 2) % 24:02d}:00-{(hour + 3) % 24:02d}:00"
        await scheduler.set_rules(compute_hours=[window])
        state = controls(a).state
        assert (state.mode, state.serving) == ("scheduled", False)
        assert state.reason.startswith(f"outside compute hours {window}")
        await eventually(lambda: _equals(servers_of(boot, "ffn.1.0"), set()))
        with pytest.raises(RemoteError) as refused:
            await forward(boot, a, "ffn.1.0")
        assert refused.value.code == "paused"
        assert "outside compute hours" in str(refused.value)

        await controls(a).resume()  # the person's resume does not override it
        assert controls(a).state.mode == "scheduled"
        assert (tmp_path / "a" / "schedule.toml").exists()

        await scheduler.set_rules(compute_hours=[])  # any time: back by itself
        assert controls(a).state.mode == "running"
        await eventually(lambda: _equals(servers_of(boot, "ffn.1.0"), me))
        assert torch.isfinite(await forward(boot, a, "ffn.1.0")).all()


async def _equals(found: Awaitable[set[str]], expected: set[str]) -> bool:
    return await found == expected


def _true_when(condition: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return condition()

    return check
