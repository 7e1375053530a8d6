"""Where the schedule's observations come from: the kernel's power supplies, logind's
idle hint, macOS's HID idle time, and the chooser that falls back to "unknown"."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from volunteerd.schedule import (
    FakeIdle,
    FakePower,
    LinuxPower,
    LogindIdle,
    MacIdle,
    NoIdle,
    X11Idle,
    choose_idle_source,
)


def supply(root: Path, name: str, **files: str) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    for key, value in files.items():
        (folder / key).write_text(value + "\n")


def test_mains_online_means_not_on_battery(tmp_path: Path) -> None:
    supply(tmp_path, "AC", type="Mains", online="1")
    supply(tmp_path, "BAT0", type="Battery", status="Discharging")  # odd, but mains wins
    assert LinuxPower(tmp_path).on_battery() is False


def test_a_discharging_battery_without_mains_means_on_battery(tmp_path: Path) -> None:
    supply(tmp_path, "AC", type="Mains", online="0")
    supply(tmp_path, "BAT0", type="Battery", status="Discharging")
    assert LinuxPower(tmp_path).on_battery() is True


def test_a_charged_battery_or_usb_power_is_not_on_battery(tmp_path: Path) -> None:
    supply(tmp_path, "BAT0", type="Battery", status="Full")
    assert LinuxPower(tmp_path).on_battery() is False
    supply(tmp_path, "usb", type="USB", online="1")
    supply(tmp_path, "BAT1", type="Battery", status="Discharging")
    assert LinuxPower(tmp_path).on_battery() is False


def test_a_wireless_mouse_battery_does_not_count(tmp_path: Path) -> None:
    supply(tmp_path, "hid-mouse", type="Battery", status="Discharging", scope="Device")
    assert LinuxPower(tmp_path).on_battery() is False


def test_no_power_supply_at_all_is_a_desktop(tmp_path: Path) -> None:
    assert LinuxPower(tmp_path).on_battery() is False  # empty folder
    assert LinuxPower(tmp_path / "absent").on_battery() is False


def fake_loginctl(tmp_path: Path, display: str, properties: str) -> Path:
    """A ``loginctl`` that answers ``show-user -p Display`` with ``display`` and any
    other question with ``properties``, and logs its arguments."""
    script = tmp_path / "loginctl"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path / "calls"}\n'
        'case "$*" in\n'
        f"  *'-p Display'*) echo '{display}' ;;\n"
        f"  *) printf '{properties}' ;;\n"
        "esac\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.mark.skipif(os.name != "posix", reason="a shell script stands in for loginctl")
def test_logind_idle_since_hint_of_the_graphical_session(tmp_path: Path) -> None:
    loginctl = fake_loginctl(tmp_path, "c2", "IdleHint=yes\\nIdleSinceHint=1000000000000\\n")
    source = LogindIdle(str(loginctl), 1000, clock=lambda: 1_000_090.0)
    assert source.idle_seconds() == pytest.approx(90.0)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert any("show-session c2" in call for call in calls)


@pytest.mark.skipif(os.name != "posix", reason="a shell script stands in for loginctl")
def test_logind_busy_and_unknown(tmp_path: Path) -> None:
    busy = fake_loginctl(tmp_path, "", "IdleHint=no\\nIdleSinceHint=0\\n")
    assert LogindIdle(str(busy), 1000).idle_seconds() == 0.0
    calls = (tmp_path / "calls").read_text()
    assert "show-user 1000 -p IdleHint" in calls  # no graphical session: the user's
    (tmp_path / "calls").unlink()
    (tmp_path / "loginctl").unlink()
    broken = fake_loginctl(tmp_path, "", "")
    assert LogindIdle(str(broken), 1000).idle_seconds() is None
    assert LogindIdle(str(tmp_path / "absent"), 1000).idle_seconds() is None


def test_mac_hid_idle_time_is_read_in_nanoseconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ioreg = tmp_path / "ioreg"
    ioreg.write_text(
        "#!/bin/sh\necho '  |   \"HIDIdleTime\" = 2500000000'\necho '  \"Other\" = 1'\n"
    )
    ioreg.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert MacIdle().idle_seconds() == pytest.approx(2.5)


def test_without_any_source_idle_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no loginctl, no ioreg
    source = choose_idle_source()
    if sys.platform in ("darwin", "win32"):
        pytest.skip("this platform has its own source")
    assert isinstance(source, NoIdle)
    assert source.idle_seconds() is None
    assert X11Idle.open() is None  # no DISPLAY


def test_under_wayland_x11_is_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """XWayland sees only X11 windows' input: its idle time would lie."""
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-0")
    monkeypatch.setenv("PATH", "/nonexistent")
    opened: list[str] = []
    monkeypatch.setattr(X11Idle, "open", classmethod(lambda cls: opened.append("x11")))
    choose_idle_source()
    assert opened == []


def test_the_fakes_say_what_the_test_sets() -> None:
    idle, power = FakeIdle(12.0), FakePower(True)
    assert (idle.idle_seconds(), power.on_battery()) == (12.0, True)
    idle.idle_s, power.battery = None, None
    assert (idle.idle_seconds(), power.on_battery()) == (None, None)


def test_schedule_and_pausing_import_no_torch() -> None:
    """A daemon that hosts nothing keeps its schedule and pause controls torch-free."""
    code = (
        "import sys\n"
        "import volunteerd.schedule, volunteerd.server.pausing, volunteerd.server.replicas\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "False"
