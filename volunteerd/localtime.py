"""The computer's local time, as a daemon that runs for weeks must read it.

A change of the machine's time zone while the daemon runs (``timedatectl
set-timezone`` replaces ``/etc/localtime``; a laptop carried to another zone) reaches
a process only when the C library reads the zone again: glibc does in ``mktime`` and
``tzset``, not in ``localtime_r``, which ``time.localtime`` uses. Every reading here
calls ``time.tzset`` first, at most every ``FOLLOW_EVERY_S`` (it costs a ``stat`` of
the zone file), so the schedule, the log's times and the transfer quota's day follow a
new zone within seconds (an outside probe: the schedule still went by the old zone
after 121 s, a daemon with a daily quota up to an hour).

A day does not always start at 00:00, nor last 24 hours: where clocks go back at
midnight (Atlantic/Azores, America/Havana) 00:00 happens twice, and the day starts at
the first; where they jump forward at midnight it starts at 01:00. ``day_start`` and
``next_day_start`` find the instant the local date changes; ``time.mktime`` with
``isdst=-1`` picked either midnight by a guess left over from its last call. Where the
clocks go back, ``minute_of_day`` reads the repeated time as the minute before it, so
that a schedule's window is not shut and opened again in the middle of the night.

``zone_name``, ``utc_offset_s`` and ``zone_warning`` say which zone the daemon goes
by, and when ``TZ`` is set to something that silently means UTC or the wrong side
of it (a misspelt name, ``UTC+14``).
"""

from __future__ import annotations

import os
import re
import time
import zoneinfo
from pathlib import Path

__all__ = [
    "FOLLOW_EVERY_S",
    "day_start",
    "follow_zone",
    "local",
    "minute_of_day",
    "next_day_start",
    "offset_words",
    "strftime",
    "utc_offset_s",
    "zone_name",
    "zone_warning",
]

FOLLOW_EVERY_S = 5.0
_followed_at: float | None = None
# the farthest two instants of one local date can be apart from a moment of it (the
# widest zone offsets are 26 h apart; a day of a zone that changed its offset by a day)
_DAY_REACH_S = 50 * 3600
# the most the clocks go back at once (Antarctica/Troll: 2 h)
_REPEAT_REACH_S = 3 * 3600
_LOCALTIME = Path("/etc/localtime")
# A POSIX TZ string: a name of three letters or more (or <...>) and an offset.
# ASCII digits: "\d" takes Arabic-Indic ones, which glibc does not: TZ=UTC+5 in them is UTC,
# not UTC-05:00
_POSIX_TZ = re.compile(r"(<[^>]+>|[A-Za-z]{3,})[+-]?[0-9]")
_UTC_PLUS = re.compile(r"(?:UTC|GMT)([+-])([0-9]{1,2})(?::?([0-9]{2}))?", re.IGNORECASE)


def follow_zone() -> None:
    """Have the C library read the machine's time zone again, at most every
    ``FOLLOW_EVERY_S`` (only where ``time.tzset`` exists: not on Windows)."""
    global _followed_at
    now = time.monotonic()
    if _followed_at is not None and 0 <= now - _followed_at < FOLLOW_EVERY_S:
        return
    _followed_at = now
    if hasattr(time, "tzset"):
        time.tzset()


def local(when: float | None = None) -> time.struct_time:
    """``time.localtime(when)`` in the machine's current time zone."""
    follow_zone()
    return time.localtime(when)


def strftime(format: str, when: float | None = None) -> str:
    """``when`` (default: now) formatted in the machine's current time zone."""
    return time.strftime(format, local(when))


def utc_offset_s(when: float | None = None) -> int:
    """How far local time is ahead of UTC at ``when``, in seconds (west: negative)."""
    return local(when).tm_gmtoff


def minute_of_day(when: float | None = None) -> int:
    """The minute of the local day (0..1439) as the schedule reads it. Where the clocks
    go back, the time they repeat reads as the last minute before they went back (02:59
    in Berlin, for the hour after 03:00 CEST became 02:00 CET): a window open then stays
    open until its end comes round, one shut stays shut. Read plainly, "02:30-06:00"
    shut at 02:00 CET and opened again 30 minutes later, and "22:00-02:30" opened again
    for 30 minutes."""
    now = time.time() if when is None else when
    t = local(now)
    drop = time.localtime(now - _REPEAT_REACH_S).tm_gmtoff - t.tm_gmtoff
    if drop > 0 and time.localtime(now - drop).tm_gmtoff > t.tm_gmtoff:
        # the clocks went back less than ``drop`` ago: find when, to the second
        lo, hi = int(now - drop), int(now)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if time.localtime(mid).tm_gmtoff > t.tm_gmtoff:
                lo = mid
            else:
                hi = mid
        t = time.localtime(lo)
    return t.tm_hour * 60 + t.tm_min


def _first_instant(after: float, before: float, date: tuple[int, int, int]) -> float:
    """The earliest whole second in (``after``, ``before``] whose local date is
    ``date`` or later; ``after``'s is earlier and ``before``'s is not."""
    lo, hi = int(after), int(before)
    if tuple(time.localtime(hi)[:3]) < date:  # ``before`` has a fraction
        hi += 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tuple(time.localtime(mid)[:3]) < date:
            lo = mid
        else:
            hi = mid
    return float(hi)


def day_start(when: float) -> float:
    """The first instant of ``when``'s local date: its (first) midnight, or the moment
    the date began where midnight was skipped."""
    t = local(when)
    date = (t.tm_year, t.tm_mon, t.tm_mday)
    return min(when, _first_instant(when - _DAY_REACH_S, when, date))


def next_day_start(when: float) -> float:
    """The first instant after ``when`` whose local date is a later one: when the day
    that ``when`` is in ends."""
    t = local(when)
    # mktime normalises the 32nd of a month; only its date is used
    after = time.localtime(time.mktime((t.tm_year, t.tm_mon, t.tm_mday + 1, 12, 0, 0, 0, 0, -1)))
    date = (after.tm_year, after.tm_mon, after.tm_mday)
    return _first_instant(when, when + _DAY_REACH_S, date)


def zone_name() -> str:
    """The time zone the machine's local time goes by: ``TZ`` when set, else the zone
    that ``/etc/localtime`` links to (``Europe/Berlin``), else its abbreviation now
    (``CET``; a zone file copied rather than linked names no zone)."""
    tz = os.environ.get("TZ")
    if tz is not None:
        return tz.removeprefix(":") or "UTC"
    try:
        target = os.readlink(_LOCALTIME)
    except OSError:
        pass
    else:
        if "zoneinfo/" in target:
            return target.rsplit("zoneinfo/", 1)[1]
    return local().tm_zone


def _zone_file_exists(name: str) -> bool:
    """Whether ``name`` is a zone file (an absolute path, or under the zone folders),
    as glibc would find it. A name the file system cannot take (300 characters: "File
    name too long", a folder the daemon may not read) is none: it stopped the daemon
    at start (a re-check)."""
    folders = [os.environ.get("TZDIR") or "/usr/share/zoneinfo", *zoneinfo.TZPATH]
    paths = [Path(name)] if name.startswith("/") else [Path(folder, name) for folder in folders]
    return any(_is_zone_file(path) for path in paths)


def _is_zone_file(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            return file.read(4) == b"TZif"  # what every zone file begins with
    except (OSError, ValueError):
        return False


def offset_words(offset_s: int) -> str:
    """An offset from UTC as people read it: ``UTC+05:45``, ``UTC-03:00``."""
    sign = "+" if offset_s >= 0 else "-"
    hours, rest = divmod(abs(offset_s), 3600)
    return f"UTC{sign}{hours:02d}:{rest // 60:02d}"


def zone_warning(tz: str | None = None) -> str | None:
    """What is wrong with ``tz`` (default: the ``TZ`` variable), or None. glibc takes a
    name with no zone file as UTC, silently (``TZ=Europe/Berln``), and a POSIX string
    counts its offset westward: ``TZ=UTC+14`` is 14 hours behind UTC."""
    if tz is None:
        tz = os.environ.get("TZ")
    if not tz:  # unset: the machine's zone; empty: UTC, as asked
        return None
    name = tz.removeprefix(":")
    if plus := _UTC_PLUS.fullmatch(name):
        sign, hours, minutes = plus.groups()
        offset_s = (int(hours) * 3600 + int(minutes or 0) * 60) * (-1 if sign == "+" else 1)
        if offset_s == 0:
            return None
        meant = -offset_s
        hours_meant, minutes_meant = divmod(abs(meant) // 60, 60)
        east = "+" if meant > 0 else "-"
        posix = f"<{east}{hours_meant:02d}{minutes_meant:02d}>{'-' if meant > 0 else ''}"
        posix += f"{hours_meant}" + (f":{minutes_meant:02d}" if minutes_meant else "")
        return (
            f"TZ={tz} is a POSIX time zone, whose offset counts westward: local time is "
            f"{offset_words(offset_s)}, not {offset_words(meant)}; for "
            f"{offset_words(meant)} set TZ={posix} or a zone's name"
        )
    if _zone_file_exists(name) or _POSIX_TZ.match(name):
        return None
    return (
        f"TZ={tz} names no time zone here (no such zone file): local time is UTC "
        "(the schedule's hours and the daily quota's day go by UTC)"
    )
