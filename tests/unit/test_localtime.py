"""Local time as a daemon that runs for weeks reads it: it follows a change of the
machine's time zone, finds where a local day starts where midnight happens twice or
not at all, and says which zone it goes by (and when TZ silently means UTC)."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from volunteerd import localtime, logs
from volunteerd.control.models import ScheduleStatus, ScheduleView
from volunteerd.control.verbs import format_schedule
from volunteerd.schedule import service
from volunteerd.schedule.policy import in_windows
from volunteerd.shown import clock_time

SetZone = Callable[..., None]


@pytest.fixture
def set_zone(monkeypatch: pytest.MonkeyPatch) -> Iterator[SetZone]:
    """``set_zone(name)``: the process's zone is ``name`` (TZ and tzset);
    ``set_zone(name, tzset=False)``: the machine's zone changes under a running
    process, which the C library notices only when asked (as when /etc/localtime is
    replaced: localtime_r reads neither again)."""

    def set_zone(name: str, *, tzset: bool = True) -> None:
        if not Path("/usr/share/zoneinfo", name).is_file():
            pytest.skip(f"no time zone data for {name}")
        monkeypatch.setenv("TZ", name)
        if tzset:
            time.tzset()

    yield set_zone
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def follow_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reading reads the zone again (as one does ``FOLLOW_EVERY_S`` later)."""
    monkeypatch.setattr(localtime, "FOLLOW_EVERY_S", 0.0)


def at(zone: str, *when: int, fold: int = 0) -> float:
    return dt.datetime(*when, tzinfo=ZoneInfo(zone), fold=fold).timestamp()  # type: ignore[misc]


# ------------------------------------------------------------------ a zone that changes


def test_the_schedules_minute_follows_a_change_of_the_machines_zone(
    set_zone: SetZone, follow_at_once: None
) -> None:
    """The scheduler went by the old zone for 121 s and more after `timedatectl
    set-timezone` (an outside probe: glibc's localtime_r never reads the zone again)."""
    set_zone("Europe/Berlin")
    assert service._minute_now() == _minute_in("Europe/Berlin")
    set_zone("America/New_York", tzset=False)
    assert service._minute_now() == _minute_in("America/New_York")


def _minute_in(zone: str) -> int:
    now = dt.datetime.now(ZoneInfo(zone))
    return now.hour * 60 + now.minute


def test_the_log_and_the_times_shown_follow_a_change_of_zone(
    set_zone: SetZone, follow_at_once: None
) -> None:
    when = at("UTC", 2026, 12, 8, 12, 0)
    set_zone("Europe/Berlin")
    record = logging.LogRecord("volunteerd", logging.INFO, __file__, 1, "x", None, None)
    record.created = when
    formatter = logs._NotingFormatter("%(asctime)s %(message)s", "%H:%M")
    assert formatter.formatTime(record, "%H:%M") == "13:00"
    assert clock_time(when, when) == "13:00"
    set_zone("Asia/Kathmandu", tzset=False)
    assert formatter.formatTime(record, "%H:%M") == "17:45"
    assert clock_time(when, when) == "17:45"


def test_the_zone_is_read_again_at_most_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stat of the zone file per reading would be wasted: once in FOLLOW_EVERY_S."""
    calls: list[None] = []
    monkeypatch.setattr(time, "tzset", lambda: calls.append(None), raising=False)
    monkeypatch.setattr(localtime, "_followed_at", None)
    for _ in range(100):
        localtime.local()
    assert len(calls) == 1


# ------------------------------------------------------------------ where a day starts


@pytest.mark.parametrize(
    ("zone", "day"),
    [
        ("Atlantic/Azores", (2026, 10, 25)),  # 01:00 +00 -> 00:00 -01
        ("America/Havana", (2026, 11, 1)),  # 01:00 CDT -> 00:00 CST
        ("Europe/Berlin", (2026, 10, 25)),  # back at 03:00: one midnight
        ("UTC", (2026, 12, 8)),
    ],
)
def test_today_starts_at_the_first_of_two_midnights(
    set_zone: SetZone, zone: str, day: tuple[int, int, int]
) -> None:
    """Where midnight happens twice, "today" (the status, the dashboard) began at the
    second one after any earlier mktime call had guessed winter time: the day's first
    hour was missing from it (an outside probe)."""
    set_zone(zone)
    first = at(zone, *day, 0, 0, fold=0)
    for instant in (first, first + 1800, at(zone, *day, 0, 30, fold=1), at(zone, *day, 12, 0)):
        time.mktime((*day, 12, 0, 0, 0, 0, 0))  # glibc's guess: winter time
        assert localtime.day_start(instant) == first
    before = at(zone, *day, 0, 0) - 3 * 3600
    assert localtime.next_day_start(before) == first


def test_a_day_whose_midnight_is_skipped_starts_at_the_jump(set_zone: SetZone) -> None:
    """Havana's clocks jump from 00:00 to 01:00 (2026-03-08): the day starts at 01:00."""
    set_zone("America/Havana")
    jump = at("America/Havana", 2026, 3, 8, 1, 0)
    assert time.localtime(jump - 1).tm_mday == 7
    assert localtime.day_start(at("America/Havana", 2026, 3, 8, 12, 0)) == jump
    assert localtime.next_day_start(at("America/Havana", 2026, 3, 7, 12, 0)) == jump
    assert localtime.next_day_start(jump) == at("America/Havana", 2026, 3, 9, 0, 0)


# ------------------------------------------------------------------ the schedule's minutes


def openings(zone: str, window: str, day: tuple[int, int, int]) -> list[str]:
    """When ``window`` opens (+) and shuts (-), a minute at a time from noon to noon."""
    start = at(zone, *day, 12, 0)
    changes, was = [], False
    for minute in range(25 * 60):
        t = start + 60 * minute
        now = in_windows([window], localtime.minute_of_day(t))
        if now != was:
            local = dt.datetime.fromtimestamp(t, ZoneInfo(zone))
            changes.append(f"{local:%H:%M%Z}{'+' if now else '-'}")
            was = now
    return changes


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        # open when the clocks go back at 03:00 CEST: it stays open (it shut 02:00-02:30 CET)
        ("02:30-06:00", ["02:30CEST+", "06:00CET-"]),
        # shut by then: it does not open again for the repeated half hour
        ("22:00-02:30", ["22:00CEST+", "02:30CEST-"]),
        ("02:00-02:45", ["02:00CEST+", "02:45CEST-"]),
        ("03:00-04:00", ["03:00CET+", "04:00CET-"]),
        ("22:00-07:00", ["22:00CEST+", "07:00CET-"]),
    ],
)
def test_a_window_opens_and_shuts_once_in_the_night_the_clocks_go_back(
    set_zone: SetZone, window: str, expected: list[str]
) -> None:
    set_zone("Europe/Berlin")
    assert openings("Europe/Berlin", window, (2026, 10, 24)) == expected


def test_a_window_in_the_skipped_hour_stays_shut(set_zone: SetZone) -> None:
    set_zone("Europe/Berlin")
    assert openings("Europe/Berlin", "02:00-02:45", (2026, 3, 28)) == []
    assert openings("Europe/Berlin", "01:30-02:30", (2026, 3, 28)) == ["01:30CET+", "03:00CEST-"]


# ------------------------------------------------------------------ which zone, and TZ's traps


@pytest.mark.parametrize(
    "tz", ["Europe/Berlin", ":Europe/Berlin", "UTC0", "EST5EDT", "<+0545>-5:45", "UTC", ""]
)
def test_a_zone_name_or_a_posix_string_is_not_warned_about(tz: str) -> None:
    assert localtime.zone_warning(tz) is None


@pytest.mark.parametrize("tz", ["/etc/passwd", "UT+1", "x" * 300, "Europe/" + "x" * 5000])
def test_what_is_no_zone_file_is_warned_about_and_stops_nothing(tz: str) -> None:
    """A file that is no zone file, a name glibc does not read as POSIX ("UT" is two
    letters: UTC+0 with no name, not UTC-01:00), and names too long for the file
    system ("File name too long" stopped the daemon at start, exit 5: a re-check)."""
    warning = localtime.zone_warning(tz)
    assert warning is not None
    assert "names no time zone" in warning


def test_a_zone_path_through_dot_dot_is_a_zone_as_glibc_reads_it() -> None:
    assert localtime.zone_warning("Europe/../Europe/Berlin") is None


def test_a_name_with_no_zone_file_is_warned_about_as_utc() -> None:
    warning = localtime.zone_warning("Europe/Berln")
    assert warning is not None
    assert warning.startswith("TZ=Europe/Berln names no time zone")
    assert "local time is UTC" in warning


@pytest.mark.parametrize("tz", ["UTC+\u0665", "EST\u0665"])  # Arabic-Indic five
def test_an_offset_in_digits_glibc_does_not_read_is_warned_about_as_utc(
    tz: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``\\d`` takes them: "UTC+5" in Arabic-Indic was said to be UTC-05:00, "EST5" a
    POSIX string."""
    warning = localtime.zone_warning(tz)
    assert warning is not None
    assert "names no time zone" in warning
    assert "local time is UTC" in warning
    try:  # and so it is
        monkeypatch.setenv("TZ", tz)
        time.tzset()
        assert time.localtime().tm_gmtoff == 0
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize(
    ("tz", "is_", "meant", "fix"),
    [
        ("UTC+14", "UTC-14:00", "UTC+14:00", "<+1400>-14"),
        ("GMT-3", "UTC+03:00", "UTC-03:00", "<-0300>3"),
        ("UTC+5:45", "UTC-05:45", "UTC+05:45", "<+0545>-5:45"),
    ],
)
def test_utc_plus_n_is_warned_about_its_reversed_sign(
    monkeypatch: pytest.MonkeyPatch, tz: str, is_: str, meant: str, fix: str
) -> None:
    """TZ=UTC+14 is 14 hours behind UTC (POSIX counts westward), silently."""
    warning = localtime.zone_warning(tz)
    assert warning is not None
    assert f"local time is {is_}, not {meant}" in warning
    assert f"TZ={fix}" in warning
    try:  # the fix it names means what was meant
        monkeypatch.setenv("TZ", fix)
        time.tzset()
        assert localtime.offset_words(time.localtime().tm_gmtoff) == meant
        monkeypatch.setenv("TZ", tz)
        time.tzset()
        assert localtime.offset_words(time.localtime().tm_gmtoff) == is_
    finally:
        monkeypatch.undo()
        time.tzset()


def test_schedule_shows_the_zone_its_hours_go_by() -> None:
    view = ScheduleView(
        run="always",
        idle_minutes=5,
        on_battery=True,
        compute_hours=["18:00-23:00"],
        network_hours=[],
        gpu="always",
    )
    now = ScheduleStatus(zone="Asia/Kathmandu", utc_offset_s=20700)
    assert "time zone     Asia/Kathmandu (UTC+05:45)" in format_schedule(view, now).splitlines()
    older = ScheduleStatus.model_validate({"computing": True})  # an older daemon's
    assert older.zone is None
    assert "time zone" not in format_schedule(view, older)
