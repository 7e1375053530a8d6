"""When the daemon computes: the schedule's rules (``policy``), what the computer is
doing (``idle``, ``power``) and the ``Scheduler`` that holds the daemon back. No torch."""

from __future__ import annotations

from volunteerd.schedule.idle import (
    FakeIdle,
    IdleSource,
    LogindIdle,
    MacIdle,
    NoIdle,
    WindowsIdle,
    X11Idle,
    choose_idle_source,
)
from volunteerd.schedule.policy import ALLOWED, Decision, Observation, decide, in_windows
from volunteerd.schedule.power import (
    FakePower,
    LinuxPower,
    MacPower,
    PowerSource,
    WindowsPower,
    choose_power_source,
)
from volunteerd.schedule.service import Scheduler, ScheduleState, ScheduleTarget

__all__ = [
    "ALLOWED",
    "Decision",
    "FakeIdle",
    "FakePower",
    "IdleSource",
    "LinuxPower",
    "LogindIdle",
    "MacIdle",
    "MacPower",
    "NoIdle",
    "Observation",
    "PowerSource",
    "ScheduleState",
    "ScheduleTarget",
    "Scheduler",
    "WindowsIdle",
    "WindowsPower",
    "X11Idle",
    "choose_idle_source",
    "choose_power_source",
    "decide",
    "in_windows",
]
