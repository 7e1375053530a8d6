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
    with pytest.raises(ConfigError, match=r"cannot save the limits .* nothing changed"):
        await v.set_limits(upload_mbit=5.0)
    assert v.limits == LimitsConfig()
    assert await v.set_limits(persist=False, upload_mbit=5.0) == v.limits
    assert v.limits.upload_mbit == 5.0
