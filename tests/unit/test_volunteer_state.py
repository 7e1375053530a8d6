"""The volunteer's choices kept on disk (``server.pausing.Volunteer``): a damaged pause
state starts the daemon unpaused, and limit changes made at the same moment all hold."""

from __future__ import annotations

import json
import time
import tomllib
from pathlib import Path

import pytest
import trio

from volunteerd.config import LimitsConfig
from volunteerd.errors import ConfigError
from volunteerd.net import Throttle
from volunteerd.server.pausing import Volunteer


def volunteer(tmp_path: Path) -> Volunteer:
    return Volunteer(
        None,
        Throttle(LimitsConfig()),
        LimitsConfig(),
        state_file=tmp_path / "state.json",
        limits_file=tmp_path / "limits.toml",
        grace_s=0,
    )


@pytest.mark.parametrize(
    "state",
    [
        {"paused": True, "until": 1e300},
        {"paused": True, "until": float("inf")},
        {"paused": True, "until": float("nan")},
        {"paused": "no"},
        {"paused": 1},
    ],
    ids=["1e300", "inf", "nan", "paused-no", "paused-1"],
)
def test_a_state_the_daemon_never_writes_starts_it_unpaused(
    tmp_path: Path, state: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    """A deadline of 1e300 or NaN made every start fail (describing the snooze), and
    "paused": "no" read as paused."""
    (tmp_path / "state.json").write_text(json.dumps(state))
    v = volunteer(tmp_path)
    v.restore()
    assert not v.gate.closed
    assert "starting unpaused" in caplog.text
    # moved aside for a look, not written over by the next save
    assert not (tmp_path / "state.json").exists()
    assert json.loads((tmp_path / "state.json.damaged").read_text()).keys() == state.keys()


def test_a_week_long_snooze_is_restored(tmp_path: Path) -> None:
    until = time.time() + 6 * 86400
    (tmp_path / "state.json").write_text(json.dumps({"paused": True, "until": until}))
    v = volunteer(tmp_path)
    v.restore()
    assert v.gate.closed


async def test_limit_changes_at_the_same_moment_all_hold(tmp_path: Path) -> None:
    """Applying CPU threads waits for the device; a change made meanwhile used to be
    built on the old limits and then overwritten by the first one's result."""
    v = volunteer(tmp_path)

    async def device_busy(threads: int) -> None:
        await trio.sleep(0.05)

    v._apply_threads = device_busy  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: v.set_limits(cpu_threads=2))
        await trio.sleep(0.01)
        nursery.start_soon(lambda: v.set_limits(upload_mbit=5.0))
    assert (v.limits.cpu_threads, v.limits.upload_mbit) == (2, 5.0)
    saved = tomllib.loads((tmp_path / "limits.toml").read_text())["limits"]
    assert (saved["cpu_threads"], saved["upload_mbit"]) == (2, 5.0)


async def test_a_limit_change_that_cannot_be_saved_is_refused_whole(tmp_path: Path) -> None:
    """A change that could not be written (a full disk, a read-only folder) was answered
    as done, applied, and lost at the next start."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    v = Volunteer(
        None,
        Throttle(LimitsConfig()),
        LimitsConfig(),
        state_file=None,
        limits_file=not_a_folder / "limits.toml",
        grace_s=0,
    )
    with pytest.raises(ConfigError, match=r"cannot save the limits.* nothing changed"):
        await v.set_limits(upload_mbit=5.0)
    assert v.limits == LimitsConfig()
    assert await v.set_limits(persist=False, upload_mbit=5.0) == v.limits
    assert v.limits.upload_mbit == 5.0


async def test_a_limit_change_keeps_only_what_was_changed_at_run_time(tmp_path: Path) -> None:
    """The daemon runs with a limit of the environment or a flag (``--set
    limits.upload_mbit=3`` for one run); changing another limit wrote all of them to
    ``limits.toml``, the temporary one with them, for good."""
    from volunteerd.config import load_config

    (tmp_path / "limits.toml").write_text("[limits]\ndaily_quota_gb = 4.0\n")
    started = load_config(
        None,
        env={"VOLUNTEERD_LIMITS__MONTHLY_QUOTA_GB": "7"},
        overrides=["limits.upload_mbit=3"],
        run_time_dir=tmp_path,
    ).limits
    v = Volunteer(
        None,
        Throttle(started),
        started,
        state_file=None,
        limits_file=tmp_path / "limits.toml",
        grace_s=0,
    )
    await v.set_limits(download_mbit=10.0)
    saved = tomllib.loads((tmp_path / "limits.toml").read_text())
    assert saved == {"limits": {"daily_quota_gb": 4.0, "download_mbit": 10.0}}
    # named again at its current value: kept (the volunteer chose it)
    await v.set_limits(upload_mbit=3.0)
    saved = tomllib.loads((tmp_path / "limits.toml").read_text())
    assert saved["limits"] == {"daily_quota_gb": 4.0, "download_mbit": 10.0, "upload_mbit": 3.0}
    # a whole new set of limits keeps what differs from the current ones
    await v.set_limits(v.limits.model_copy(update={"cpu_threads": 2}))
    saved = tomllib.loads((tmp_path / "limits.toml").read_text())
    assert saved["limits"]["cpu_threads"] == 2
    assert "monthly_quota_gb" not in saved["limits"]
    # the next start without the environment variable: the config's monthly quota
    assert load_config(None, env={}, run_time_dir=tmp_path).limits.monthly_quota_gb == 0


async def test_a_limits_file_damaged_since_the_start_is_not_written_over(tmp_path: Path) -> None:
    v = volunteer(tmp_path)
    (tmp_path / "limits.toml").write_text("[network]\nport = 1\n")
    with pytest.raises(ConfigError, match=r"may hold only a \[limits\] section"):
        await v.set_limits(upload_mbit=5.0)
    assert (tmp_path / "limits.toml").read_text() == "[network]\nport = 1\n"
    assert v.limits == LimitsConfig()


async def test_a_pause_that_cannot_be_saved_pauses_and_says_a_restart_forgets_it(
    tmp_path: Path,
) -> None:
    """A full disk or a read-only folder: the pause answered 200 and was lost at the
    next start. It still pauses (at once: a pause must pause), and the caller gets the
    error (the control API's 500) saying that a restart forgets it."""
    folder = tmp_path / "data"
    folder.write_text("a file where the data folder should be: nothing can be written")
    v = volunteer(folder)
    with pytest.raises(OSError, match="a restart forgets it"):
        await v.pause()
    assert v.gate.closed
    with pytest.raises(OSError, match="running, but"):
        await v.resume()
    assert not v.gate.closed


@pytest.mark.parametrize("wall_step_s", [65 * 60, -3600])
async def test_a_snooze_lasts_the_time_asked_whatever_the_wall_clock_does(
    tmp_path: Path, wall_step_s: float
) -> None:
    """The snooze's end was compared with the wall clock: set right by NTP (+65 min) a
    one-hour snooze ended at once; set back an hour, a 20 s snooze lasted an hour more
    (an outside probe). The wall time is what is saved and shown; the monotonic clock
    decides."""
    wall, ticking = [1_700_000_000.0], [500.0]
    v = volunteer(tmp_path)
    v._clock = lambda: wall[0]
    v._ticking = lambda: ticking[0]
    await v.snooze(3600)
    wall[0] += wall_step_s
    ticking[0] += 60
    assert not v._snooze_over()
    ticking[0] += 3600 - 60
    assert v._snooze_over()
    # restored after a restart: what was left of it, on the new process's clock
    restarted = volunteer(tmp_path)
    restarted._clock = lambda: 1_700_000_000.0 + 1800
    restarted._ticking = lambda: 7.0
    restarted.restore()
    assert restarted.gate.closed
    assert restarted._choice.ends == pytest.approx(7.0 + 1800)
