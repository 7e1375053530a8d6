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
``isdst=-1`` picked either midnight by a guess left over from its last call.
"""

from __future__ import annotations

import time

__all__ = [
    "FOLLOW_EVERY_S",
    "day_start",
    "follow_zone",
    "local",
    "next_day_start",
    "strftime",
    "utc_offset_s",
]

FOLLOW_EVERY_S = 5.0
_followed_at: float | None = None
# the farthest two instants of one local date can be apart from a moment of it (the
# widest zone offsets are 26 h apart; a day of a zone that changed its offset by a day)
_DAY_REACH_S = 50 * 3600


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
