"""Text from peers and project owners, made safe to show: ``escaped`` writes every
character a terminal, a tray or a log would act on rather than show (escape sequences,
line breaks, bidi overrides, zero-width and line/paragraph separators) as its escape
(``\\x1b``, ``\\n``, ``\\u202e``). The log, the command line's status, the tray and the
dashboard's activity line all show such text. ``short_id`` is a peer id as people see
it (the dashboard's ``shortId``, the tray's); ``clock_time`` a moment to come (a snooze's
end) as the tray and the activity line say it, and ``span`` how long until then."""

from __future__ import annotations

import time
import unicodedata

from volunteerd import localtime

__all__ = ["clock_time", "escaped", "one_line", "short_id", "span"]

# What is acted on rather than shown: control, format (bidi, zero-width), surrogates,
# line and paragraph separators.
_UNSHOWN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def escaped(text: str, keep: str = "") -> str:
    """``text`` with every unshown character (but those in ``keep``) as its escape."""
    if text.isprintable():  # the usual case, at C speed (it is False for more than _UNSHOWN)
        return text
    return "".join(
        c if c in keep or unicodedata.category(c) not in _UNSHOWN else ascii(c)[1:-1] for c in text
    )


def one_line(text: str) -> str:
    """``text`` on one line: runs of white space (line breaks too) as one space, other
    unshown characters as escapes."""
    return escaped(" ".join(text.split()))


def short_id(peer_id: str) -> str:
    """``peer_id`` as people see it: its first 8 and last 6 characters (every Ed25519
    peer id starts "12D3KooW", so the end tells two apart)."""
    return f"{peer_id[:8]}…{peer_id[-6:]}" if len(peer_id) > 16 else peer_id


def clock_time(when: float, now: float) -> str:
    """``when`` (``time.time()``) in local time: ``14:05`` today, ``Tue 14:05`` within a
    week, else ``2025-03-04 14:05``. A bare time of day for a 3-day snooze read as "now"."""
    then, today = localtime.local(when), localtime.local(now)
    if then[:3] == today[:3]:
        return time.strftime("%H:%M", then)
    if 0 < when - now < 6 * 86400:
        return time.strftime("%a %H:%M", then)
    return time.strftime("%Y-%m-%d %H:%M", then)


def span(seconds: float) -> str:
    """A wait as people say it: ``7 h 12 min``, ``12 min``, ``40 s``."""
    seconds = max(0, round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    if seconds >= 60:
        return f"{seconds // 60} min"
    return f"{seconds} s"
