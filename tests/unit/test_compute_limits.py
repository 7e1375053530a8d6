"""The volunteer's compute limits: the device rests per the duty cycle, the batch cap
holds, both change while the executor runs; and the limits overlay next to the config
file takes the place of its [limits] section."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import trio

from volunteerd.config import LimitsConfig, RuntimeConfig, limits_overlay_toml, load_config
from volunteerd.config.loading import check_limits_overlay
from volunteerd.errors import ConfigError
from volunteerd.runtime import DeviceBatcher, DeviceExecutor

JOB_S = 0.02


def job() -> None:
    time.sleep(JOB_S)  # real time: the duty cycle measures what the device really took


async def test_duty_cycle_rests_before_the_next_job(autojump_clock: trio.abc.Clock) -> None:
    executor = DeviceExecutor(torch.device("cpu"))
    executor.duty_cycle = 0.25  # busy a quarter of the time: rest 3x each job
    await executor.run(job)
    start = trio.current_time()
    await executor.run(job)
    # The fake clock moves only through the rest (a job's thread time is not counted).
    assert trio.current_time() - start >= 3 * JOB_S


async def test_full_duty_cycle_never_rests(autojump_clock: trio.abc.Clock) -> None:
    executor = DeviceExecutor(torch.device("cpu"))
    start = trio.current_time()
    for _ in range(3):
        await executor.run(job)
    assert trio.current_time() == start


async def test_duty_cycle_changes_at_run_time(autojump_clock: trio.abc.Clock) -> None:
    executor = DeviceExecutor(torch.device("cpu"))
    executor.duty_cycle = 0.5
    await executor.run(job)
    executor.duty_cycle = 1.0
    await executor.run(job)  # still waits out the rest the previous job earned
    start = trio.current_time()
    await executor.run(job)
    assert trio.current_time() == start


async def test_batch_cap_splits_batches(autojump_clock: trio.abc.Clock) -> None:
    executor = DeviceExecutor(torch.device("cpu"))
    batches: list[int] = []

    def compute(items: list[torch.Tensor]) -> list[torch.Tensor]:
        batches.append(sum(len(x) for x in items))
        return items

    config = RuntimeConfig(max_batch_size=100, max_batch_wait_s=0.05)
    device = DeviceBatcher(executor, config)
    queue = device.lane("e", compute)

    async def round_of(n: int) -> None:
        async with trio.open_nursery() as clients:
            for _ in range(n):
                clients.start_soon(lambda: queue.submit(torch.zeros(4, 2), samples=4))

    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        await round_of(6)
        assert batches == [24]
        executor.max_batch_size = 8  # the volunteer's cap, applied to the next batch
        batches.clear()
        await round_of(6)
        assert batches == [8, 8, 8]
        device.close()


def test_limits_overlay_takes_the_place_of_the_config_files_limits(tmp_path: Path) -> None:
    config_file = tmp_path / "config.toml"
    config_file.write_text("# my comments\n[limits]\nupload_mbit = 5.0\nduty_cycle = 0.5\n")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    assert load_config(config_file, run_time_dir=data_dir).limits.upload_mbit == 5.0
    overlay = data_dir / "limits.toml"
    overlay.write_text(limits_overlay_toml(LimitsConfig(upload_mbit=10, max_batch_size=64)))
    limits = load_config(config_file, run_time_dir=data_dir).limits
    assert (limits.upload_mbit, limits.max_batch_size, limits.duty_cycle) == (10, 64, 1.0)
    # flags still win
    changed = load_config(config_file, overrides=["limits.upload_mbit=2"], run_time_dir=data_dir)
    assert changed.limits.upload_mbit == 2
    # the overlay applies with no config file, too
    config_file.unlink()
    assert load_config(config_file, run_time_dir=data_dir).limits.upload_mbit == 10
    # and belongs to its data folder: another daemon's does not read it
    assert load_config(config_file, run_time_dir=tmp_path / "other").limits.upload_mbit == 0


def test_a_bad_limits_overlay_is_named(tmp_path: Path) -> None:
    (tmp_path / "limits.toml").write_text("[network]\nport = 1\n")
    with pytest.raises(ConfigError, match=r"limits\.toml: may hold only a \[limits\] section"):
        load_config(tmp_path / "config.toml", run_time_dir=tmp_path)
    (tmp_path / "limits.toml").write_text("[limits]\nduty_cycle = 2\n")
    with pytest.raises(ConfigError, match=r"limits\.duty_cycle = 2.*limits\.toml"):
        load_config(tmp_path / "config.toml", run_time_dir=tmp_path)


@pytest.mark.parametrize("text", ["", "\n", "# nothing set here\n"])
@pytest.mark.parametrize("name", ["limits.toml", "schedule.toml"])
def test_an_empty_overlay_sets_nothing(tmp_path: Path, name: str, text: str) -> None:
    """An empty ``limits.toml`` or ``schedule.toml`` stopped the start: it "may hold only
    a [limits] section" (an outside probe). It is valid TOML that sets nothing."""
    (tmp_path / name).write_text(text)
    assert load_config(tmp_path / "config.toml", run_time_dir=tmp_path) == load_config(
        tmp_path / "config.toml", run_time_dir=tmp_path / "other"
    )
    if name == "limits.toml":  # but one beside a config file is not taken along as ours
        with pytest.raises(ConfigError, match=r"holds no \[limits\] section"):
            check_limits_overlay(tmp_path / name)
