"""The tray's menu as data: what the icon and the menu show for what the tray knows
about the daemon (a ``Seen``), and which client call each item makes.

Pure: no pystray, no display, no I/O. ``app`` renders a ``View`` with pystray, the
unit tests read it directly, and ``scripts/screenshot_tray.py`` draws it.

The menu, connected and contributing::

    Helping: Tiny LM by Ana · 1,234 samples today    (a label)
    ─────────
    Pause                                   (Resume while paused or snoozed)
    Snooze for 1 hour
    ☐ Compute only when idle                (the schedule's run = "when_idle")
    Bandwidth ▸   Upload                    (a label)
                  ◉ Unlimited  ○ 1 Mbit/s  ○ 5 Mbit/s  ○ 10 Mbit/s  ○ 50 Mbit/s
                  ─────────
                  Download                  (a label)
                  ◉ Unlimited  ○ 5 Mbit/s  ○ 10 Mbit/s  ○ 50 Mbit/s  ○ 100 Mbit/s
    ─────────
    Open dashboard                          (the default: a click on the icon)
    Join a project…                         (the dashboard's join field)
    ─────────
    Quit
    Quit and stop volunteerd

The first line is what the daemon does for whom (``Status.activity``): "Helping:
<description> by <owner>" while it contributes to a project, else the activity's
message ("Not in a project", "No peers"; "Joining tinylm: waiting, paused by you" for a
join held back, paused or not), with its hint as a second line and in the tooltip. The
icon shows "waiting" whenever the daemon runs but contributes nothing.

Bandwidth: the presets set one direction each and are radio-checked from the daemon's
limits (``Status.limits``). Upload is what a home link has least of, so its presets
start at 1 Mbit/s; download presets sit one step higher (home links download several
times faster than they upload, and an expert's weights arrive by download). A limit
set elsewhere (config file, dashboard) that is no preset shows as an extra checked,
disabled item, so the menu never claims a limit the daemon does not have.

While the daemon does not answer, every item that needs it is disabled; "Start
volunteerd" appears (and is the click action) when nothing is starting it: not while
a daemon holds the data folder's lock (restarting in place after a join or leave),
where a second one would only be refused.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from volunteerd.control.models import LimitsView, Status
from volunteerd.shown import clock_time, one_line

__all__ = [
    "DOWNLOAD_PRESETS_MBIT",
    "ICON_STATES",
    "MAX_TITLE",
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
    "helping",
    "icon_state",
    "perform",
    "status_line",
    "view",
]

IconState = Literal["contributing", "waiting", "paused", "error", "disconnected"]
ICON_STATES: tuple[IconState, ...] = ("contributing", "waiting", "paused", "error", "disconnected")

# connected: the daemon answered the last poll (``Seen.status`` is its reply)
# starting:  nothing answers yet; the tray started a daemon and waits for it
# absent:    nothing answers (not running, stopped, or gone away)
# failed:    the daemon the tray started exited before it answered (``Seen.error``)
# error:     the daemon answers but refuses the tray (e.g. a wrong token; ``Seen.error``)
# busy: the daemon's process runs but its control API did not answer in time
# locked:    nothing answers, but a daemon holds the data folder's lock (``Seen.pid``):
#            starting, or restarting in place (a join or leave), or its API is off
Link = Literal["connected", "starting", "busy", "locked", "absent", "failed", "error"]

ActionName = Literal[
    "pause",
    "resume",
    "snooze",
    "upload",  # value: Mbit/s, 0 = unlimited
    "download",  # value: Mbit/s, 0 = unlimited
    "dashboard",
    "join",  # the dashboard, at its join field
    "idle_only",  # value: 1 = compute only when idle, 0 = always
    "start",
    "quit",
    "quit_and_stop",
]

SNOOZE_S = 3600.0
UPLOAD_PRESETS_MBIT: tuple[float, ...] = (0.0, 1.0, 5.0, 10.0, 50.0)
DOWNLOAD_PRESETS_MBIT: tuple[float, ...] = (0.0, 5.0, 10.0, 50.0, 100.0)

_MAX_LINE = 64  # characters of an error or a project's description in a menu line
_MAX_OWNER = 32  # characters of a project owner's name there
# characters of the tooltip: pystray's Windows backend copies it into a WCHAR[128]
# (NOTIFYICONDATAW.szTip, its end included) and raises on a longer one
MAX_TITLE = 127


@dataclass(frozen=True, slots=True)
class Seen:
    """What the tray knows about the daemon."""

    link: Link
    status: Status | None = None  # the daemon's last reply, only while connected
    error: str = ""  # why the link is "failed" or "error"
    notice: str = ""  # the last action that failed, shown for a while
    schedule_run: str | None = None  # the schedule's ``run`` (None: not known)
    pid: int | None = None  # the lock holder's, while "locked" (None: not known)


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


# Activity states that are no contribution although the daemon runs.
_WAITING = ("not_in_project", "joining", "waiting", "no_peers", "unreachable")


def icon_state(seen: Seen) -> IconState:
    if seen.link == "connected" and seen.status is not None:
        if seen.status.state != "running":
            return "paused"
        return "waiting" if seen.status.activity.state in _WAITING else "contributing"
    if seen.link in ("failed", "error"):
        return "error"
    return "disconnected"


def helping(status: Status) -> str:
    """ "Helping: <description> by <owner>" for the projects contributed to ("" if none)."""
    joined = [p for p in status.projects if p.state == "joined"]
    if not joined:
        return ""
    first = joined[0]
    # no owner: a project of the config's experiments.join, trusted by its settings
    owner = first.owner_name or (_short_id(first.owner) if first.owner else "")
    by = f" by {_shorten(owner, _MAX_OWNER)}" if owner else ""
    more = f" and {len(joined) - 1} more" if len(joined) > 1 else ""
    # Shortened like the rest: a manifest's description of 280 characters made a
    # menu line (and tooltip) of 340.
    return f"Helping: {_shorten(first.description or first.name)}{by}{more}"


def status_line(seen: Seen, *, now: float | None = None) -> str:
    """One line for people: what the daemon does now, or why the tray cannot tell."""
    status = seen.status
    if seen.link == "connected" and status is not None:
        if status.state == "running":
            if status.activity.state in _WAITING:  # a failed join's error, for one
                return _sentence(_shorten(status.activity.message))
            if not status.serving:
                return "Starting to contribute…"
            samples = status.today.samples
            what = helping(status) or "Contributing"
            return f"{what} · {samples:,} sample{'' if samples == 1 else 's'} today"
        if status.activity.state == "joining":  # "joining tinylm: waiting, paused by you"
            return _sentence(_shorten(status.activity.message))
        if status.state == "paused":
            return "Paused"
        if status.state == "scheduled":  # "paused: outside the hours set to compute"
            return _sentence(_shorten(status.activity.message))
        if status.state == "snoozed":
            if status.snoozed_until is None:
                return "Snoozed"
            now = time.time() if now is None else now
            return "Snoozed until " + clock_time(status.snoozed_until, now)
        return f"Paused · {_used_up(status.limits) or 'transfer'} quota used up"
    if seen.link == "starting":
        return "Not connected — starting volunteerd…"
    if seen.link == "busy":
        return "Not connected — volunteerd runs but does not answer (busy?)"
    if seen.link == "locked":
        pid = f" (pid {seen.pid})" if seen.pid is not None else ""
        return f"Not connected — volunteerd is starting or restarting{pid}…"
    if seen.link == "absent":
        return "Not connected — volunteerd is not running"
    return "Error: " + _shorten(seen.error or "unknown")


def view(seen: Seen, *, now: float | None = None) -> View:
    """The icon state, tooltip and menu for ``seen``; ``now`` (Unix seconds) for tests."""
    line = status_line(seen, now=now)
    hint = _hint(seen)
    title = f"volunteerd — {line}" + (f" — {hint}" if hint else "")
    return View(
        state=icon_state(seen),
        title=_shorten(title, MAX_TITLE),  # the hint can be longer than one line
        status_line=line,
        items=_items(seen, line, hint),
    )


def _hint(seen: Seen) -> str:
    """What to do about a daemon that runs but contributes nothing, or about a join held
    back ("" otherwise)."""
    status = seen.status
    if seen.link != "connected" or status is None:
        return ""
    if status.activity.state == "joining":  # held back too: what to do about the hold
        return status.activity.hint
    if status.state != "running":
        return ""
    return status.activity.hint if status.activity.state in _WAITING else ""


def _used_up(limits: LimitsView) -> str:
    """Which quota ``limits`` shows used up, "monthly" or "daily" ("" neither), decided
    as the daemon's throttle decides it (``Throttle.exhausted_quota``: the month's
    first). A used-up daily quota was named the monthly one."""
    if limits.monthly_quota_gb > 0 and limits.month_bytes >= round(limits.monthly_quota_gb * 1e9):
        return "monthly"
    if limits.daily_quota_gb > 0 and limits.day_bytes >= round(limits.daily_quota_gb * 1e9):
        return "daily"
    return ""


def _items(seen: Seen, line: str, hint: str) -> tuple[Item, ...]:
    status = seen.status if seen.link == "connected" else None
    up = status is not None
    items = [Item(line, enabled=False)]
    if hint:
        items.append(Item(_shorten(hint), enabled=False))
    if seen.notice:
        items.append(Item(_shorten(seen.notice), enabled=False))
    items.append(SEPARATOR)
    if status is not None and status.state in ("paused", "snoozed"):
        items.append(Item("Resume", Action("resume")))
    else:
        items.append(Item("Pause", Action("pause"), enabled=up))
    items.append(Item("Snooze for 1 hour", Action("snooze", SNOOZE_S), enabled=up))
    if up and seen.schedule_run is not None:
        idle_only = seen.schedule_run == "when_idle"
        items.append(
            Item(
                "Compute only when idle",
                Action("idle_only", 0.0 if idle_only else 1.0),
                checked=idle_only,
            )
        )
    items.append(
        Item("Bandwidth", enabled=up, submenu=_bandwidth(status.limits if status else None))
    )
    items.append(SEPARATOR)
    can_start = seen.link in ("absent", "failed")
    items.append(Item("Open dashboard", Action("dashboard"), enabled=up, default=up))
    items.append(Item("Join a project…", Action("join"), enabled=up))
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


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _short_id(peer_id: str) -> str:
    return f"{peer_id[:8]}…{peer_id[-6:]}" if len(peer_id) > 16 else peer_id


def _shorten(text: str, limit: int = _MAX_LINE) -> str:
    """``text`` on one line of at most ``limit`` characters: runs of white space (line
    breaks too) as one space, other control or invisible characters as escapes."""
    text = one_line(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
    def set_schedule(self, **changes: Any) -> Any: ...
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
        case "idle_only":
            client.set_schedule(run="when_idle" if action.value else "always")
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
        case "join":
            return "open the dashboard to join a project"
        case "idle_only":
            return "compute only when idle" if action.value else "compute always"
        case "start":
            return "start volunteerd"
        case "quit_and_stop":
            return "stop volunteerd"
        case _:
            return action.name
