"""The schedule's rules applied to what was observed: a pure function, no I/O.

``decide(rules, observation)`` says whether the daemon may compute (serve its experts)
and whether it may use the network (serve, download experts, average replicas), and
why not, in words. The first rule that holds the daemon back gives the reason:

1. outside ``network_hours``: no serving and no bulk transfers;
2. outside ``compute_hours``: no serving (bulk transfers go on);
3. on battery while ``on_battery`` is false;
4. the computer in use (input within ``idle_minutes``) while ``run = "when_idle"``, or
   while ``gpu = "when_idle"`` and the experts are on a GPU.

An observation that is unknown (no idle source on this machine, no power supply
information) holds nothing back: a rule that cannot be checked does not stop a
volunteer from contributing, and the status shows the value as unknown.

Windows are "HH:MM-HH:MM" of local time, the start included and the end excluded; a
window whose end comes before its start wraps midnight ("22:00-07:00").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from volunteerd.config import ScheduleConfig

__all__ = ["ALLOWED", "Decision", "Observation", "decide", "in_windows", "parse_window"]

_DAY_MIN = 24 * 60


@dataclass(frozen=True, slots=True)
class Observation:
    """What the scheduler saw at one check."""

    minute_of_day: int  # local time, 0..1439
    idle_s: float | None  # seconds since the last keyboard or mouse input; None: unknown
    on_battery: bool | None  # None: unknown
    on_gpu: bool  # the experts compute on a GPU


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether to compute and to use the network; ``reason`` (for people) says what
    holds the daemon back, ``waiting`` what it waits for (both None when nothing does)."""

    compute: bool
    network: bool
    reason: str | None = None
    waiting: str | None = None

    @property
    def serving(self) -> bool:
        """Serving experts needs both."""
        return self.compute and self.network


ALLOWED = Decision(compute=True, network=True)


def parse_window(window: str) -> tuple[int, int]:
    """``"22:00-07:00"`` -> ``(1320, 420)``, minutes of the day (validated by the config)."""
    start, end = window.split("-")
    return _minutes(start), _minutes(end)


def _minutes(hh_mm: str) -> int:
    hours, minutes = hh_mm.split(":")
    return int(hours) * 60 + int(minutes)


def in_windows(windows: Sequence[str], minute_of_day: int) -> bool:
    """Whether ``minute_of_day`` falls in one of ``windows`` (none at all: any time)."""
    if not windows:
        return True
    for window in windows:
        start, end = parse_window(window)
        if start < end:
            if start <= minute_of_day < end:
                return True
        elif minute_of_day >= start or minute_of_day < end:  # wraps midnight
            return True
    return False


def _next_start(windows: Sequence[str], minute_of_day: int) -> str:
    """The start of the window that opens next, as written ("22:00")."""
    return min(
        (w.split("-")[0] for w in windows),
        key=lambda start: (_minutes(start) - minute_of_day) % _DAY_MIN,
    )


def decide(rules: ScheduleConfig, seen: Observation) -> Decision:
    """Apply ``rules`` to ``seen`` (see the module's docstring for the order)."""
    minute = seen.minute_of_day
    if not in_windows(rules.network_hours, minute):
        return Decision(
            compute=False,
            network=False,
            reason=f"outside network hours {', '.join(rules.network_hours)}",
            waiting=f"until {_next_start(rules.network_hours, minute)}",
        )
    if not in_windows(rules.compute_hours, minute):
        return Decision(
            compute=False,
            network=True,
            reason=f"outside compute hours {', '.join(rules.compute_hours)}",
            waiting=f"until {_next_start(rules.compute_hours, minute)}",
        )
    if seen.on_battery and not rules.on_battery:
        return Decision(compute=False, network=True, reason="on battery", waiting="for mains power")
    wants_idle = rules.run == "when_idle" or (rules.gpu == "when_idle" and seen.on_gpu)
    if wants_idle and seen.idle_s is not None and seen.idle_s < rules.idle_minutes * 60:
        return Decision(
            compute=False,
            network=True,
            reason="computer in use",
            waiting=f"for the computer to be idle for {_duration(rules.idle_minutes * 60)}",
        )
    return ALLOWED


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:g} min"
