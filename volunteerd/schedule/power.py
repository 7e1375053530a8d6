"""Whether the computer runs on battery: one interface, one source per platform.

Every source has ``on_battery() -> bool | None`` (None: unknown). Calls may block
briefly (a subprocess): the scheduler makes them in a worker thread.

* ``LinuxPower``: ``/sys/class/power_supply``: any mains or USB supply online means
  not on battery; otherwise on battery only if a system battery is discharging; no
  supply at all (a desktop, a server, a container) means not on battery. Batteries of
  devices (a wireless mouse: ``scope = Device``) do not count.
* ``MacPower``: the first line of ``pmset -g batt`` ("Now drawing from 'Battery Power'").
* ``WindowsPower``: ``GetSystemPowerStatus``'s AC line status.
* ``FakePower``: a value the test sets.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
from pathlib import Path
from typing import Protocol

__all__ = [
    "FakePower",
    "LinuxPower",
    "MacPower",
    "PowerSource",
    "WindowsPower",
    "choose_power_source",
]

logger = logging.getLogger(__name__)

_COMMAND_S = 5.0


class PowerSource(Protocol):
    name: str

    def on_battery(self) -> bool | None:
        """Whether the computer runs on battery now; None when unknown."""
        ...


class FakePower:
    """A value set by the test (None: unknown)."""

    name = "fake"

    def __init__(self, on_battery: bool | None = False) -> None:
        self.battery = on_battery

    def on_battery(self) -> bool | None:
        return self.battery


class LinuxPower:
    """The kernel's power supplies under ``root``."""

    name = "linux"

    def __init__(self, root: Path = Path("/sys/class/power_supply")) -> None:
        self._root = root

    def on_battery(self) -> bool | None:
        try:
            supplies = sorted(self._root.iterdir())
        except FileNotFoundError:
            return False  # no power supply class: nothing runs on battery
        except OSError:
            return None
        discharging = False
        for supply in supplies:
            kind = _read(supply / "type")
            if kind in {"Mains", "USB"} and _read(supply / "online") == "1":
                return False
            if kind == "Battery" and _read(supply / "scope") != "Device":
                discharging |= _read(supply / "status") == "Discharging"
        return discharging


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


class MacPower:
    """``pmset -g batt`` (macOS)."""

    name = "macos"

    def on_battery(self) -> bool | None:
        try:
            done = subprocess.run(
                ["pmset", "-g", "batt"],
                capture_output=True,
                text=True,
                timeout=_COMMAND_S,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        first = done.stdout.splitlines()[0] if done.stdout else ""
        if "Battery Power" in first:
            return True
        if "AC Power" in first:
            return False
        return None


class WindowsPower:
    """``GetSystemPowerStatus`` (Windows)."""

    name = "windows"

    class _Status(ctypes.Structure):
        _fields_ = [
            ("ACLineStatus", ctypes.c_ubyte),
            ("BatteryFlag", ctypes.c_ubyte),
            ("BatteryLifePercent", ctypes.c_ubyte),
            ("SystemStatusFlag", ctypes.c_ubyte),
            ("BatteryLifeTime", ctypes.c_uint32),
            ("BatteryFullLifeTime", ctypes.c_uint32),
        ]

    def on_battery(self) -> bool | None:  # pragma: no cover - Windows
        windll = ctypes.windll  # type: ignore[attr-defined,unused-ignore]
        status = self._Status()
        if not windll.kernel32.GetSystemPowerStatus(ctypes.byref(status)):
            return None
        if status.BatteryFlag == 128:  # no system battery
            return False
        return {0: True, 1: False}.get(status.ACLineStatus)  # 255: unknown


def choose_power_source() -> PowerSource:
    """This platform's source."""
    if sys.platform == "darwin":
        return MacPower()
    if sys.platform == "win32":
        return WindowsPower()
    return LinuxPower()
