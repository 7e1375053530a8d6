"""The schedule on a real expert server (a real ``ExpertRuntime`` behind the request
pipeline and its pause gate, on memory links), with fake idle, power and clock sources:
each rule holds serving back exactly like the manual pause (the request in flight
finishes, new ones are refused with the reason, the device is released), serving
resumes by itself when the rule is satisfied again, and the person's pause and the
schedule's hold combine."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from tests.xvfb import XVFB, x_server
from volunteerd.config import Config, LimitsConfig, ScheduleConfig, load_config
from volunteerd.control.events import EventLog
from volunteerd.errors import ConfigError, RemoteError
from volunteerd.experts import to_wire
from volunteerd.identity import Identity
from volunteerd.net import Throttle, Verb
from volunteerd.net.throttle import TransferLedger
from volunteerd.runtime import ExpertRuntime
from volunteerd.schedule import FakeIdle, FakePower, IdleSource, Scheduler, X11Idle
from volunteerd.server.pausing import Volunteer
from volunteerd.server.pipeline import expert_handlers
from volunteerd.server.replicas import WindowedDownloader
from volunteerd.testing.faulty import Faults
from volunteerd.testing.inprocess import InProcessServer, Peer, World, open_world
from volunteerd.wire import ForwardRequest

HIDDEN = 16
UID = "ffn.0.0"


def world_config() -> Config:
    return Config.model_validate(
        {
            "experts": {"uids": UID, "hidden_dim": HIDDEN},
            "runtime": {"device": "cpu", "max_batch_wait_s": 0.001},
            "timeouts": {"shutdown_grace_s": 30},  # the bounded wait for work in flight
        }
    )


@dataclass
class Scheduled:
    """A server whose volunteer follows a scheduler fed by fakes the test sets."""

    server: InProcessServer
    runtime: ExpertRuntime
    volunteer: Volunteer
    scheduler: Scheduler
    events: EventLog
    idle: FakeIdle  # unused when the test gave a real source
    power: FakePower
    clock: list[int]  # [minute of the day]
    peer: Peer

    async def forward(self) -> torch.Tensor:
        meta, data = to_wire(torch.randn(2, HIDDEN))
        _, tensors = await self.peer.rpc.call(
            self.server.address, Verb.FORWARD, ForwardRequest(uid=UID, tensors=[meta]), [data]
        )
        return torch.frombuffer(bytearray(tensors[0].data), dtype=torch.float32)

    async def refusal(self) -> RemoteError:
        with pytest.raises(RemoteError) as refused:
            await self.forward()
        return refused.value

    def state_events(self) -> list[str]:
        return [e.message for e in self.events.after(0) if e.kind == "state"]


@asynccontextmanager
async def scheduled(
    world: World,
    rules: ScheduleConfig,
    *,
    idle_s: float | None = 3600.0,
    on_battery: bool | None = False,
    minute: int = 12 * 60,
    on_gpu: bool = False,
    schedule_file: Path | None = None,
    idle_source: IdleSource | None = None,
) -> AsyncIterator[Scheduled]:
    config = world.config
    runtime = ExpertRuntime(
        [UID], config.experts, config.runtime, config.wire, torch.device("cpu"), guard=config.guard
    )
    events = EventLog()
    volunteer = Volunteer(
        runtime,
        Throttle(config.limits),
        config.limits,
        state_file=None,
        limits_file=None,
        grace_s=config.timeouts.shutdown_grace_s,
        events=events,
    )
    idle, power, clock = FakeIdle(idle_s), FakePower(on_battery), [minute]
    scheduler = Scheduler(
        rules,
        volunteer,
        on_gpu=on_gpu,
        idle=idle_source or idle,
        power=power,
        schedule_file=schedule_file,
        events=events,
        check_every_s=0.05,
        minute_of_day=lambda: clock[0],
    )
    server = InProcessServer(Identity.generate(), runtime, Faults())
    handlers = expert_handlers(runtime, gate=volunteer.gate)
    async with trio.open_nursery() as nursery, world.open_peer() as peer:
        await nursery.start(server.serve, world.network, handlers, config)
        await nursery.start(scheduler.serve)  # before the volunteer serves, as the daemon
        await nursery.start(volunteer.serve)
        yield Scheduled(server, runtime, volunteer, scheduler, events, idle, power, clock, peer)
        nursery.cancel_scope.cancel()


async def eventually(condition: Callable[[], bool], within_s: float = 30.0) -> None:
    with trio.fail_after(within_s):
        while not condition():  # noqa: ASYNC110 - the scheduler's checks, not an event
            await trio.sleep(0.02)


def slowed(runtime: ExpertRuntime, seconds: float) -> Callable[[], None]:
    """Make the expert's forward take ``seconds``; returns how to undo it."""
    backend = runtime.backend(UID)
    fast = backend.forward

    def slow(inputs: Any) -> Any:
        time.sleep(seconds)
        return fast(inputs)

    backend.forward = slow  # type: ignore[method-assign]

    def undo() -> None:
        backend.forward = fast  # type: ignore[method-assign]

    return undo


async def test_the_computer_in_use_drains_like_a_pause_and_idle_resumes() -> None:
    async with (
        open_world(world_config()) as world,
        scheduled(world, ScheduleConfig(run="when_idle", idle_minutes=1)) as s,
    ):
        assert torch.isfinite(await s.forward()).all()
        assert s.volunteer.state.mode == "running"

        # A slow request is in flight when the person touches the mouse: it finishes.
        undo = slowed(s.runtime, 1.0)
        answered: list[torch.Tensor] = []

        async def in_flight() -> None:
            answered.append(await s.forward())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_flight)
            await eventually(lambda: s.volunteer.gate.in_flight == 1)
            s.idle.idle_s = 2.0
            await eventually(lambda: s.volunteer.gate.closed)
        undo()
        assert len(answered) == 1
        assert torch.isfinite(answered[0]).all()
        await eventually(lambda: not s.volunteer.state.serving)

        state = s.volunteer.state
        assert state.mode == "scheduled"
        assert state.reason == ("computer in use: waiting for the computer to be idle for 1 min")
        refused = await s.refusal()
        assert refused.code == "paused"
        assert "computer in use" in str(refused)
        assert s.volunteer.schedule.reason == "computer in use"
        assert s.scheduler.state().observation is not None

        # Nobody touches it for a minute: serving again, by itself.
        s.idle.idle_s = 60.0
        await eventually(lambda: s.volunteer.state.serving)
        assert s.volunteer.state.mode == "running"
        assert torch.isfinite(await s.forward()).all()
        assert s.state_events() == [
            "computer in use: waiting for the computer to be idle for 1 min",
            "contributing",
        ]


async def test_on_battery_holds_back_and_mains_power_resumes() -> None:
    async with (
        open_world(world_config()) as world,
        scheduled(world, ScheduleConfig(), on_battery=True) as s,
    ):
        # started on battery: never served
        assert not s.volunteer.state.serving
        assert s.volunteer.state.reason == "on battery: waiting for mains power"
        assert (await s.refusal()).code == "paused"
        assert s.volunteer.network_allowed  # only computing stops

        s.power.battery = False
        await eventually(lambda: s.volunteer.state.serving)
        assert torch.isfinite(await s.forward()).all()

        await s.scheduler.set_rules(on_battery=True)
        s.power.battery = True
        await trio.sleep(0.3)  # several checks
        assert s.volunteer.state.serving


async def test_compute_and_network_hours_follow_the_clock() -> None:
    rules = ScheduleConfig(compute_hours=["22:00-07:00"], network_hours=["21:00-08:00"])
    async with (
        open_world(world_config()) as world,
        scheduled(world, rules, minute=23 * 60) as s,
    ):
        assert s.volunteer.state.serving
        s.clock[0] = 7 * 60 + 30  # past the compute hours, within the network hours
        await eventually(lambda: not s.volunteer.state.serving)
        assert s.volunteer.state.reason == "outside compute hours 22:00-07:00: waiting until 22:00"
        assert s.volunteer.network_allowed

        s.clock[0] = 12 * 60  # outside both
        await eventually(lambda: not s.volunteer.network_allowed)
        assert s.volunteer.state.reason == "outside network hours 21:00-08:00: waiting until 21:00"

        # a download waits for the network hours instead of failing
        recorder = Recorder()
        async with trio.open_nursery() as nursery:
            result = recorder.start(nursery, s.volunteer)
            await trio.sleep(0.3)
            assert recorder.downloads == []
            s.clock[0] = 0  # midnight: both windows open
            await eventually(lambda: s.volunteer.state.serving)
        assert result == ["state"]
        assert torch.isfinite(await s.forward()).all()


class Recorder:
    """An expert downloader that records what it was asked for, behind the volunteer's
    ``wait_for_network`` (``WindowedDownloader``)."""

    def __init__(self) -> None:
        self.downloads: list[str] = []

    async def download(self, peer: Any, backend: Any) -> Any:
        self.downloads.append(backend)
        return "state"

    async def discard(self, uid: str) -> None:
        pass

    def start(self, nursery: trio.Nursery, volunteer: Volunteer) -> list[Any]:
        """Start one download in ``nursery``; the list its result is put in."""
        windowed = WindowedDownloader(self, volunteer.wait_for_network)
        result: list[Any] = []

        async def download() -> None:
            result.append(await windowed.download(None, "backend"))  # type: ignore[arg-type]

        nursery.start_soon(download)
        return result


async def test_a_pause_holds_bulk_transfers_until_resumed() -> None:
    """Replica averaging and expert downloads went on while the volunteer had paused (an
    outside probe: ~1 MB/s of averaging, a joiner downloading its experts after
    "starting paused")."""
    async with (
        open_world(world_config()) as world,
        scheduled(world, ScheduleConfig()) as s,
    ):
        assert s.volunteer.network_allowed
        await s.volunteer.pause()
        assert not s.volunteer.network_allowed
        recorder = Recorder()
        async with trio.open_nursery() as nursery:
            result = recorder.start(nursery, s.volunteer)
            await trio.sleep(0.3)
            assert recorder.downloads == []
            await s.volunteer.resume()
            await eventually(lambda: result == ["state"], within_s=5.0)
        assert s.volunteer.network_allowed
        await s.volunteer.snooze(3600)
        assert not s.volunteer.network_allowed


async def test_gpu_when_idle_applies_only_to_experts_on_a_gpu() -> None:
    rules = ScheduleConfig(gpu="when_idle", idle_minutes=1)
    async with open_world(world_config()) as world:
        async with scheduled(world, rules, idle_s=1.0, on_gpu=False) as cpu:
            assert cpu.volunteer.state.serving
        async with scheduled(world, rules, idle_s=1.0, on_gpu=True) as gpu:
            assert not gpu.volunteer.state.serving
            assert gpu.volunteer.state.mode == "scheduled"


async def test_resume_does_not_override_the_schedule() -> None:
    async with (
        open_world(world_config()) as world,
        scheduled(world, ScheduleConfig(run="when_idle", idle_minutes=1), idle_s=600.0) as s,
    ):
        await s.volunteer.pause()
        s.idle.idle_s = 0.0
        await trio.sleep(0.3)  # the schedule holds too, behind the person's pause
        assert s.volunteer.state.mode == "paused"  # the person's choice shows first

        await s.volunteer.resume()
        state = s.volunteer.state
        assert state.mode == "scheduled"
        assert not state.serving
        assert "waiting for the computer to be idle" in state.reason
        assert (await s.refusal()).code == "paused"

        # the schedule lets go: serving, although nobody pressed anything
        s.idle.idle_s = 600.0
        await eventually(lambda: s.volunteer.state.serving)

        # the person's pause holds while the schedule allows everything
        await s.volunteer.pause()
        await trio.sleep(0.3)
        assert s.volunteer.state.mode == "paused"
        assert not s.volunteer.state.serving


async def test_changed_rules_apply_at_once_and_are_kept(tmp_path: Path) -> None:
    schedule_file = tmp_path / "schedule.toml"
    async with (
        open_world(world_config()) as world,
        scheduled(world, ScheduleConfig(), idle_s=5.0, schedule_file=schedule_file) as s,
    ):
        assert s.volunteer.state.serving
        await s.scheduler.set_rules(run="when_idle", idle_minutes=2)
        # set_rules returns once the daemon follows the new rules
        assert not s.volunteer.state.serving
        assert "idle for 2 min" in s.volunteer.state.reason
        messages = [e.message for e in s.events.after(0) if e.kind == "schedule"]
        assert messages == ["compute only when the computer is idle, idle time set to 2 min"]

        (tmp_path / "config.toml").write_text("")
        reloaded = load_config(tmp_path / "config.toml", run_time_dir=tmp_path)
        assert reloaded.schedule == ScheduleConfig(run="when_idle", idle_minutes=2)

        # SIGHUP: the files again; not written back
        await s.scheduler.reload(lambda: ScheduleConfig())
        assert s.volunteer.state.serving
        assert "idle_minutes = 2" in schedule_file.read_text()
        messages = [e.message for e in s.events.after(0) if e.kind == "schedule"]
        assert messages[-1] == (
            "compute always, idle time set to 3 min (reloaded from the config file)"
        )

        def broken() -> ScheduleConfig:
            raise ConfigError("schedule.idle_minutes = 0: must be greater than 0")

        await s.scheduler.reload(broken)  # logged; the rules stay
        assert s.scheduler.rules == ScheduleConfig()
        with pytest.raises(ConfigError, match="compute_hours"):
            await s.scheduler.set_rules(compute_hours=["8-9"])
        assert s.scheduler.rules == ScheduleConfig()


async def test_cpu_threads_change_on_the_device_worker() -> None:
    async with (
        open_world(world_config()) as world,
        scheduled(world, ScheduleConfig()) as s,
    ):
        executor = s.runtime.executor
        default = await executor.run(torch.get_num_threads)
        await s.volunteer.set_limits(LimitsConfig(cpu_threads=1))
        assert await executor.run(torch.get_num_threads) == 1
        await s.volunteer.set_limits(cpu_threads=0)  # back to torch's default
        assert await executor.run(torch.get_num_threads) == default
        assert torch.isfinite(await s.forward()).all()


async def test_a_volunteer_without_experts_follows_the_schedule_too() -> None:
    """A daemon that hosts nothing (no project) has a Volunteer without a runtime."""
    config = world_config()
    volunteer = Volunteer(
        None, Throttle(config.limits), config.limits, state_file=None, limits_file=None, grace_s=1
    )
    idle = FakeIdle(0.0)
    scheduler = Scheduler(
        ScheduleConfig(run="when_idle"), volunteer, on_gpu=False, idle=idle, power=FakePower()
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.serve)
        await nursery.start(volunteer.serve)
        assert volunteer.state.mode == "scheduled"
        await volunteer.set_limits(cpu_threads=2, daily_quota_gb=1)  # nothing to apply it to
        idle.idle_s = 3600.0
        await scheduler.check()
        assert volunteer.state.serving
        await volunteer.pause()
        await volunteer.resume()
        assert volunteer.state.mode == "running"
        nursery.cancel_scope.cancel()


XDOTOOL = shutil.which("xdotool")


@pytest.mark.slow
@pytest.mark.skipif(
    XVFB is None or XDOTOOL is None,
    reason="needs Xvfb and xdotool (apt-get install xvfb xdotool libxss1)",
)
async def test_real_x11_input_pauses_computing_and_idle_resumes_it(tmp_path: Path) -> None:
    """The X server's own idle time (MIT-SCREEN-SAVER through libXss): simulated input
    (xdotool) holds computing back while it goes on; idle for ``idle_minutes`` (6 s
    here: a mouse move on a busy machine may take a while) brings it back."""
    assert XDOTOOL is not None
    with x_server(tmp_path) as (display, xvfb):
        source = X11Idle.open(display)
        if source is None:
            pytest.skip("libXss (libxss1) or the MIT-SCREEN-SAVER extension is missing")
        rules = ScheduleConfig(run="when_idle", idle_minutes=0.1)
        env = {**os.environ, "DISPLAY": display}

        def move_mouse(x: int) -> None:
            subprocess.run([XDOTOOL, "mousemove", str(x), "100"], env=env, check=True, timeout=30)

        try:
            async with (
                open_world(world_config()) as world,
                scheduled(world, rules, idle_source=source) as s,
            ):
                # nobody has touched the new X server: computing once 6 s have passed
                await eventually(lambda: s.volunteer.state.serving)
                seen = s.scheduler.state().observation
                assert seen is not None
                assert seen.idle_s is not None
                assert seen.idle_s >= 6.0
                assert torch.isfinite(await s.forward()).all()

                # someone moves the mouse, again and again: computing pauses and stays
                # paused while they do (the idle time never reaches 6 s between moves)
                for step in range(200):
                    await trio.to_thread.run_sync(move_mouse, 100 + step % 2 * 50)
                    if s.volunteer.state.mode == "scheduled":
                        break
                    await trio.sleep(0.2)
                assert s.volunteer.state.mode == "scheduled"
                for step in range(5):
                    await trio.to_thread.run_sync(move_mouse, 300 + step % 2 * 50)
                    await trio.sleep(0.2)
                    assert s.volunteer.state.mode == "scheduled"
                    assert s.volunteer.schedule.reason == "computer in use"
                assert (await s.refusal()).code == "paused"
                seen = s.scheduler.state().observation
                assert seen is not None
                assert seen.idle_s is not None
                assert seen.idle_s < 6.0

                # hands off: computing again by itself
                await eventually(lambda: s.volunteer.state.serving)
                assert torch.isfinite(await s.forward()).all()
                assert s.state_events()[-2:] == [
                    "computer in use: waiting for the computer to be idle for 6 s",
                    "contributing",
                ]

                # the person logs out and the X server stops: Xlib would end the
                # process; here the idle time becomes unknown and computing goes on
                xvfb.terminate()
                await trio.to_thread.run_sync(xvfb.wait, 30)
                await eventually(lambda: source.broken)
                await trio.sleep(0.3)  # more checks on the broken connection
                assert source.idle_seconds() is None
                assert s.volunteer.state.serving
                assert torch.isfinite(await s.forward()).all()
        finally:
            source.close()


async def test_a_used_up_daily_quota_pauses_until_local_midnight() -> None:
    def local(day: int, hour: int, minute: int) -> float:
        return time.mktime((2026, 3, day, hour, minute, 0, 0, 0, -1))

    now = [local(10, 23, 58)]
    throttle = Throttle(LimitsConfig(), TransferLedger(None, clock=lambda: now[0]))
    volunteer = Volunteer(
        None, throttle, LimitsConfig(), state_file=None, limits_file=None, grace_s=1
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(volunteer.serve)
        throttle.ledger.add(up=1_500_000, down=500_000)
        await volunteer.set_limits(daily_quota_gb=0.001)  # 1 MB a day: used up
        state = volunteer.state
        assert state.mode == "quota"
        assert not state.serving
        assert state.reason == "daily transfer quota used (0.001 GB): waiting until midnight"
        assert state.quota == "daily"  # the activity's hint names its flag (--daily-gb)
        assert volunteer.gate.refusal() is not None
        # nor do bulk transfers spend it (replica averaging spent a used-up 10 MB
        # quota 6.5 times over in an outside probe)
        assert not volunteer.network_allowed
        recorder = Recorder()
        result = recorder.start(nursery, volunteer)
        await trio.sleep(0.3)
        assert recorder.downloads == []

        now[0] = local(11, 0, 0)  # midnight: today's count starts from zero
        await eventually(lambda: volunteer.state.serving)
        assert (volunteer.state.mode, volunteer.state.quota) == ("running", None)
        await eventually(lambda: result == ["state"], within_s=5.0)
        nursery.cancel_scope.cancel()


async def test_a_failing_sensor_counts_as_unknown_and_stops_nothing() -> None:
    class Broken:
        name = "broken"

        def idle_seconds(self) -> float | None:
            raise RuntimeError("the sensor fell off")

        def on_battery(self) -> bool | None:
            raise RuntimeError("no power supply class")

    config = world_config()
    volunteer = Volunteer(
        None, Throttle(config.limits), config.limits, state_file=None, limits_file=None, grace_s=1
    )
    scheduler = Scheduler(
        ScheduleConfig(run="when_idle"), volunteer, on_gpu=False, idle=Broken(), power=Broken()
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.serve)
        await nursery.start(volunteer.serve)
        await scheduler.check()
        seen = scheduler.state().observation
        assert seen is not None
        assert (seen.idle_s, seen.on_battery) == (None, None)
        assert volunteer.state.serving
        nursery.cancel_scope.cancel()
