"""The tray's menu as data: what the icon and the menu show for what the tray knows
about the daemon (a ``Seen``), and which client call each item makes.

Pure: no pystray, no display, no I/O. ``app`` renders a ``View`` with pystray, the
unit tests read it directly, and ``scripts/screenshot_tray.py`` draws it.

The menu, connected and contributing::

    Contributing · 1,234 samples today      (a label)
    ─────────
    Pause                                   (Resume while paused or snoozed)
    Snooze for 1 hour
    Bandwidth ▸   Upload                    (a label)
                  ◉ Unlimited  ○ 1 Mbit/s  ○ 5 Mbit/s  ○ 10 Mbit/s  ○ 50 Mbit/s
                  ─────────
                  Download                  (a label)
                  ◉ Unlimited  ○ 5 Mbit/s  ○ 10 Mbit/s  ○ 50 Mbit/s  ○ 100 Mbit/s
    ─────────
    Open dashboard                          (the default: a click on the icon)
    ─────────
    Quit
    Quit and stop volunteerd

Bandwidth: the presets set one direction each and are radio-checked from the daemon's
limits (``Status.limits``). Upload is what a home link has least of, so its presets
start at 1 Mbit/s; download presets sit one step higher (home links download several
times faster than they upload, and an expert's weights arrive by download). A limit
set elsewhere (config file, dashboard) that is no preset shows as an extra checked,
disabled item, so the menu never claims a limit the daemon does not have.

While the daemon does not answer, every item that needs it is disabled; "Start
volunteerd" appears (and is the click action) when nothing is starting it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from volunteerd.control.models import LimitsView, Status

__all__ = [
    "DOWNLOAD_PRESETS_MBIT",
    "ICON_STATES",
    "SEPARATOR",
    "SNOOZE_S",
    "UPLOAD_PRESETS_MBIT",
    "Action",
    "ActionName",
    "Controller",
    "IconState",
    "Item",
    "Link",
    "Seen",
    "View",
    "describe",
    "find",
    "icon_state",
    "perform",
    "status_line",
    "view",
]

IconState = Literal["contributing", "paused", "error", "disconnected"]
ICON_STATES: tuple[IconState, ...] = ("contributing", "paused", "error", "disconnected")

# connected: the daemon answered the last poll (``Seen.status`` is its reply)
# starting:  nothing answers yet; the tray started a daemon and waits for it
# absent:    nothing answers (not running, stopped, or gone away)
# failed:    the daemon the tray started exited before it answered (``Seen.error``)
# error:     the daemon answers but refuses the tray (e.g. a wrong token; ``Seen.error``)
Link = Literal["connected", "starting", "absent", "failed", "error"]

ActionName = Literal[
    "pause",
    "resume",
    "snooze",
    "upload",  # value: Mbit/s, 0 = unlimited
    "download",  # value: Mbit/s, 0 = unlimited
    "dashboard",
    "start",
    "quit",
    "quit_and_stop",
]

SNOOZE_S = 3600.0
UPLOAD_PRESETS_MBIT: tuple[float, ...] = (0.0, 1.0, 5.0, 10.0, 50.0)
DOWNLOAD_PRESETS_MBIT: tuple[float, ...] = (0.0, 5.0, 10.0, 50.0, 100.0)

_MAX_LINE = 64  # characters of an error in a menu line


@dataclass(frozen=True, slots=True)
class Seen:
    """What the tray knows about the daemon."""

    link: Link
    status: Status | None = None  # the daemon's last reply, only while connected
    error: str = ""  # why the link is "failed" or "error"
    notice: str = ""  # the last action that failed, shown for a while


@dataclass(frozen=True, slots=True)
class Action:
    name: ActionName
    value: float | None = None


@dataclass(frozen=True, slots=True)
class Item:
    """One menu entry. A label has no action; a separator has ``separator`` set."""

    text: str
    action: Action | None = None
    enabled: bool = True
    checked: bool | None = None  # None: not checkable
    radio: bool = False
    default: bool = False  # the action of a click on the icon
    submenu: tuple[Item, ...] = ()
    separator: bool = False


SEPARATOR = Item("", enabled=False, separator=True)


@dataclass(frozen=True, slots=True)
class View:
    state: IconState
    title: str  # the icon's tooltip
    status_line: str
    items: tuple[Item, ...] = field(default=())


# -- what the tray shows ----------------------------------------------------------------


def icon_state(seen: Seen) -> IconState:
    if seen.link == "connected" and seen.status is not None:
        return "contributing" if seen.status.state == "running" else "paused"
    if seen.link in ("failed", "error"):
        return "error"
    return "disconnected"


def status_line(seen: Seen, *, now: float | None = None) -> str:
    """One line for people: what the daemon does now, or why the tray cannot tell."""
    status = seen.status
    if seen.link == "connected" and status is not None:
        if status.state == "running":
            if not status.serving:
                return "Starting to contribute…"
            samples = status.today.samples
            return f"Contributing · {samples:,} sample{'' if samples == 1 else 's'} today"
        if status.state == "paused":
            return "Paused"
        if status.state == "snoozed":
            if status.snoozed_until is None:
                return "Snoozed"
            now = time.time() if now is None else now
            return "Snoozed until " + _clock(status.snoozed_until, now)
        return "Paused · monthly quota used up"
    if seen.link == "starting":
        return "Not connected — starting volunteerd…"
    if seen.link == "absent":
        return "Not connected — volunteerd is not running"
    return "Error: " + _shorten(seen.error or "unknown")


def view(seen: Seen, *, now: float | None = None) -> View:
    """The icon state, tooltip and menu for ``seen``; ``now`` (Unix seconds) for tests."""
    line = status_line(seen, now=now)
    return View(
        state=icon_state(seen),
        title=f"volunteerd — {line}",
        status_line=line,
        items=_items(seen, line),
    )


def _items(seen: Seen, line: str) -> tuple[Item, ...]:
    status = seen.status if seen.link == "connected" else None
    up = status is not None
    items = [Item(line, enabled=False)]
    if seen.notice:
        items.append(Item(_shorten(seen.notice), enabled=False))
    items.append(SEPARATOR)
    if status is not None and status.state in ("paused", "snoozed"):
        items.append(Item("Resume", Action("resume")))
    else:
        items.append(Item("Pause", Action("pause"), enabled=up))
    items.append(Item("Snooze for 1 hour", Action("snooze", SNOOZE_S), enabled=up))
    items.append(
        Item("Bandwidth", enabled=up, submenu=_bandwidth(status.limits if status else None))
    )
    items.append(SEPARATOR)
    can_start = seen.link in ("absent", "failed")
    items.append(Item("Open dashboard", Action("dashboard"), enabled=up, default=up))
    if can_start:
        items.append(Item("Start volunteerd", Action("start"), default=True))
    items.append(SEPARATOR)
    items.append(Item("Quit", Action("quit")))
    items.append(Item("Quit and stop volunteerd", Action("quit_and_stop"), enabled=up))
    return tuple(items)


def _bandwidth(limits: LimitsView | None) -> tuple[Item, ...]:
    upload = _presets("upload", UPLOAD_PRESETS_MBIT, limits.upload_mbit if limits else None)
    download = _presets("download", DOWNLOAD_PRESETS_MBIT, limits.download_mbit if limits else None)
    return (
        Item("Upload", enabled=False),
        *upload,
        SEPARATOR,
        Item("Download", enabled=False),
        *download,
    )


def _presets(
    name: Literal["upload", "download"], presets: tuple[float, ...], current: float | None
) -> list[Item]:
    known = current is not None
    items = [
        Item(
            _rate(mbit),
            Action(name, mbit),
            enabled=known,
            checked=current is not None and _same(current, mbit),
            radio=True,
        )
        for mbit in presets
    ]
    if current is not None and not any(_same(current, mbit) for mbit in presets):
        text = f"{_rate(current)} (set elsewhere)"
        items.append(Item(text, enabled=False, checked=True, radio=True))
    return items


def _rate(mbit: float) -> str:
    return "Unlimited" if mbit == 0 else f"{mbit:g} Mbit/s"


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _clock(until: float, now: float) -> str:
    """``14:05`` today, ``Tue 14:05`` within a week, else ``2025-03-04 14:05`` (local)."""
    then, today = time.localtime(until), time.localtime(now)
    if then[:3] == today[:3]:
        return time.strftime("%H:%M", then)
    if 0 < until - now < 6 * 86400:
        return time.strftime("%a %H:%M", then)
    return time.strftime("%Y-%m-%d %H:%M", then)


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_LINE else text[: _MAX_LINE - 1] + "…"


def find(items: tuple[Item, ...], text: str) -> Item:
    """The item whose text is ``text``, searching submenus depth first; KeyError if none."""
    for item in items:
        if item.text == text and not item.separator:
            return item
        if item.submenu:
            try:
                return find(item.submenu, text)
            except KeyError:
                pass
    raise KeyError(text)


# -- what the items do ------------------------------------------------------------------


class Controller(Protocol):
    """The part of ``ControlClient`` the menu's actions call."""

    def pause(self) -> Status: ...
    def resume(self) -> Status: ...
    def snooze(self, seconds: float) -> Status: ...
    def set_limits(self, **changes: float | int) -> LimitsView: ...
    def shutdown(self) -> None: ...


def perform(client: Controller, action: Action) -> None:
    """Make the daemon call of ``action``. The tray's own actions (dashboard, start,
    quit) are not daemon calls: ValueError. Raises what the client raises."""
    match action.name:
        case "pause":
            client.pause()
        case "resume":
            client.resume()
        case "snooze":
            client.snooze(action.value or SNOOZE_S)
        case "upload":
            client.set_limits(upload_mbit=action.value or 0.0)
        case "download":
            client.set_limits(download_mbit=action.value or 0.0)
        case "quit_and_stop":
            client.shutdown()
        case _:
            raise ValueError(f"{action.name!r} is not a call to the daemon")


def describe(action: Action) -> str:
    """What ``action`` does, for a message like "Could not pause: …"."""
    match action.name:
        case "upload" | "download":
            return f"set the {action.name} limit to {_rate(action.value or 0.0).lower()}"
        case "snooze":
            return "snooze"
        case "dashboard":
            return "open the dashboard"
        case "start":
            return "start volunteerd"
        case "quit_and_stop":
            return "stop volunteerd"
        case _:
            return action.name
