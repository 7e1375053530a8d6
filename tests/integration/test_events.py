"""Events are posted where things happen: one test per kind changes the thing on a real
daemon and reads ``GET /api/v1/events`` at once (``wait_s=0``: no waiting, no polling):
the event is in the log by the time the change returned."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from volunteerd.config import Config, LimitsConfig
from volunteerd.control.client import ControlClient
from volunteerd.control.models import Event
from volunteerd.daemon import Running
from volunteerd.errors import ConfigError
from volunteerd.experts import to_wire
from volunteerd.net import Node, Verb
from volunteerd.net.connections import slots_in_use
from volunteerd.net.peers import short
from volunteerd.runtime.guard import Sender
from volunteerd.server.pausing import Volunteer
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.testing.clients import open_bare_client
from volunteerd.wire import ForwardRequest

HIDDEN = 16


def daemon_config(**sections: Any) -> Config:
    return local_config(uids="ffn.0.[0:2]", experts={"hidden_dim": HIDDEN}, **sections)


class Events:
    """Reads the daemon's events through its control API, each only once."""

    def __init__(self, client: ControlClient) -> None:
        self._client = client
        self._since = 0

    async def new(self) -> list[Event]:
        """The events posted since the last call, as the API has them now."""
        got = await trio.to_thread.run_sync(lambda: self._client.events(self._since, wait_s=0))
        self._since = got.next
        return got.events

    async def new_of(self, kind: str) -> list[str]:
        return [e.message for e in await self.new() if e.kind == kind]


@asynccontextmanager
async def daemon_with_events(
    data_dir: Path, config: Config | None = None
) -> AsyncIterator[tuple[Running, Events]]:
    async with open_daemon(config or daemon_config(), data_dir) as daemon:
        events = Events(ControlClient.for_data_dir(data_dir))
        yield daemon, events


def volunteer_of(daemon: Running) -> Volunteer:
    assert daemon.volunteer is not None
    return daemon.volunteer


async def test_the_opening_events_say_started_state_and_experts(tmp_path: Path) -> None:
    async with daemon_with_events(tmp_path) as (daemon, events):
        opening = await events.new()
        assert [e.kind for e in opening][:3] == ["started", "state", "experts"]
        assert daemon.node.peer_id in opening[0].message
        assert opening[1].message == "contributing"
        assert opening[2].message == "hosting ffn.0.0, ffn.0.1"


async def test_pause_resume_and_snooze_post_state(tmp_path: Path) -> None:
    async with daemon_with_events(tmp_path) as (daemon, events):
        await events.new()
        volunteer = volunteer_of(daemon)
        await volunteer.pause()
        assert await events.new_of("state") == ["paused by the volunteer"]
        await volunteer.resume()
        assert await events.new_of("state") == ["contributing"]
        await volunteer.snooze(3600)
        (snoozed,) = await events.new_of("state")
        assert snoozed.startswith("snoozed until ")
        await volunteer.resume()
        assert await events.new_of("state") == ["contributing"]
        await volunteer.resume()  # no change: no event
        assert await events.new_of("state") == []


async def test_the_quota_running_out_posts_state(tmp_path: Path) -> None:
    async with daemon_with_events(tmp_path) as (daemon, events):
        await events.new()
        volunteer = volunteer_of(daemon)
        daemon.node.throttle.ledger.add(up=2000)  # traffic counted this month
        await volunteer.set_limits(monthly_quota_gb=1e-6)  # 1000 bytes: used up
        (state,) = await events.new_of("state")
        assert state.startswith("paused: the monthly transfer quota")


async def test_limits_changed_through_the_api_or_reloaded_post_limits(tmp_path: Path) -> None:
    async with daemon_with_events(tmp_path) as (daemon, events):
        await events.new()
        client = ControlClient.for_data_dir(tmp_path)
        await trio.to_thread.run_sync(lambda: client.set_limits(upload_mbit=12.5))
        assert await events.new_of("limits") == ["upload limit set to 12.5 Mbit/s"]

        # what SIGHUP does (the signal itself: tests/e2e/test_limits_reload.py)
        volunteer = volunteer_of(daemon)
        await volunteer.reload_limits(lambda: LimitsConfig(upload_mbit=3, duty_cycle=0.5))
        assert await events.new_of("limits") == [
            "upload limit set to 3 Mbit/s, duty cycle set to 50 % (reloaded from the config file)"
        ]
        await volunteer.reload_limits(lambda: LimitsConfig(upload_mbit=3, duty_cycle=0.5))
        assert await events.new_of("limits") == ["limits reloaded: unchanged"]


async def test_a_reload_that_fails_posts_an_error(tmp_path: Path) -> None:
    async with daemon_with_events(tmp_path) as (daemon, events):
        await events.new()

        def broken_file() -> LimitsConfig:
            raise ConfigError("limits.duty_cycle = 7: Input should be less than or equal to 1")

        await volunteer_of(daemon).reload_limits(broken_file)
        (error,) = await events.new_of("error")
        assert "configuration not reloaded" in error
        assert "duty_cycle = 7" in error
        assert volunteer_of(daemon).limits.duty_cycle == 1


async def test_experts_taken_on_and_dropped_post_experts(tmp_path: Path) -> None:
    async with daemon_with_events(tmp_path) as (daemon, events):
        await events.new()
        runtime = daemon.runtime
        backend = await trio.to_thread.run_sync(
            lambda: runtime.make_backend("ffn.1.1", daemon_config().experts)
        )
        await runtime.add_expert(backend)
        assert await events.new_of("experts") == ["hosting ffn.1.1"]
        await runtime.remove_expert("ffn.0.0")
        assert await events.new_of("experts") == ["dropped ffn.0.0"]


async def test_a_reachability_change_posts_reachability(tmp_path: Path) -> None:
    # No bootstrap peer: nobody to ask, the mode is unknown until a peer dials back.
    async with daemon_with_events(tmp_path) as (daemon, events):
        reachability = daemon.node.reachability
        assert reachability is not None
        assert reachability.mode == "unknown"
        assert await events.new_of("reachability") == []
        async with open_peer(local_config(bootstrap=daemon.node.multiaddrs)):
            assert await reachability.check() == "direct"
            assert await events.new_of("reachability") == ["reachability: direct"]
            await reachability.check()  # the same again: no event
            assert await events.new_of("reachability") == []


async def forward(client: Node, daemon: Running) -> None:
    meta, data = to_wire(torch.randn(2, HIDDEN))
    await client.rpc.call(
        daemon.node.address, Verb.FORWARD, ForwardRequest(uid="ffn.0.0", tensors=[meta]), [data]
    )


async def test_a_trainers_first_request_posts_peers_once(tmp_path: Path) -> None:
    async with (
        daemon_with_events(tmp_path) as (daemon, events),
        open_peer(local_config(bootstrap=daemon.node.multiaddrs)) as trainer,
    ):
        await events.new()
        await forward(trainer, daemon)
        assert await events.new_of("peers") == [f"{short(trainer.peer_id)} sent its first request"]
        await forward(trainer, daemon)  # not one event per request
        assert await events.new_of("peers") == []


@pytest.mark.slow
async def test_trimming_idle_connections_posts_peers(tmp_path: Path) -> None:
    config = daemon_config(network={"max_connections": 32})
    async with daemon_with_events(tmp_path, config) as (daemon, events):
        swarm = daemon.node.host.get_network()
        _, total = slots_in_use(swarm)  # type: ignore[arg-type]
        strangers = total // 2 + 2
        connected = 0
        held = trio.Event()

        async def idle_stranger() -> None:
            nonlocal connected
            async with open_bare_client(config) as client:
                await client.connect(daemon.node.address)
                connected += 1
                await held.wait()

        async with trio.open_nursery() as nursery:
            for _ in range(strangers):
                nursery.start_soon(idle_stranger)
            with trio.fail_after(60):
                while (  # noqa: ASYNC110 - polling state
                    connected < strangers
                    or slots_in_use(swarm)[0] < strangers  # type: ignore[arg-type]
                    or any(c.get_streams() for c in swarm.get_connections())
                ):
                    await trio.sleep(0.05)
            await events.new()
            trimmer = daemon.node.connections
            now = time.monotonic()
            await trimmer.trim_once(now)  # idle from now on
            closed = await trimmer.trim_once(now + config.timeouts.connection_idle_s)
            assert closed > 0
            (trimmed,) = await events.new_of("peers")
            assert trimmed.startswith(f"closed {closed} idle connections to free slots")
            held.set()


async def test_a_ban_posts_bans(tmp_path: Path) -> None:
    async with daemon_with_events(tmp_path) as (daemon, events):
        await events.new()
        peer = "12D3KooWBadTrainerBadTrainerBadTrainerBadTrainer1"
        # what the runtime reports after undoing a step that one trainer's gradients
        # were alone in
        daemon.runtime.guard.step_undone("ffn.0.0", "non_finite_weights", [Sender(peer, 1e9)])
        (ban,) = await events.new_of("bans")
        assert ban.startswith(f"banned {short(peer)} for 600 s: a step of ffn.0.0")
