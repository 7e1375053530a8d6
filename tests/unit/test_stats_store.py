"""Contribution accounting: exact counts, surviving restarts and kill -9, rolled up."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from volunteerd.stats import HOUR, StatsStore, Work
from volunteerd.stats.store import DAY, IDLE_READERS


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


START = 1_780_000_000 - 1_780_000_000 % DAY  # midnight UTC


def test_counts_are_exact_and_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "stats.sqlite3"
    clock = Clock(START + 10)
    store = StatsStore.open(path, clock=clock)
    for _ in range(37):
        store.record("ffn.0.1", forward=1, samples=16, compute_s=0.002, bytes_in=100)
    for _ in range(5):
        store.record("ffn.0.2", backward=1, samples=8, compute_s=0.01, bytes_out=50)
    store.reject("ffn.0.1", "outlier_gradient")
    store.reject("ffn.0.1", "outlier_gradient")
    store.tick(30.0, paused=False)
    store.tick(12.5, paused=True)
    clock.now += HOUR  # the next hour: a second bucket
    store.record("ffn.0.1", forward=3, samples=3)
    store.close()

    reopened = StatsStore.open(path, clock=clock)
    totals = reopened.totals()
    assert totals.by_expert["ffn.0.1"] == Work(40, 0, 595, pytest.approx(0.074), 3700, 0)
    assert totals.by_expert["ffn.0.2"] == Work(0, 5, 40, pytest.approx(0.05), 0, 250)
    assert totals.work.requests == 45
    assert totals.rejected == {"outlier_gradient": 2}
    assert (totals.running_s, totals.paused_s) == (30.0, 12.5)
    assert reopened.totals(since=START + HOUR).work.samples == 3
    history = reopened.history()
    assert [(bucket - START, size) for bucket, size, _ in history] == [(0, HOUR), (HOUR, HOUR)]
    assert history[0][2].samples == 37 * 16 + 5 * 8
    reopened.close()


def test_old_hours_roll_up_into_days_without_losing_a_count(tmp_path: Path) -> None:
    clock = Clock(START)
    store = StatsStore.open(tmp_path / "stats.sqlite3", keep_hourly_days=7, clock=clock)
    for hour in range(24 * 10):  # ten days, every hour
        clock.now = START + hour * HOUR
        store.record("ffn.0", forward=2, samples=10)
        store.reject("ffn.0", "non_finite_input")
        store.tick(3600.0, paused=hour % 2 == 1)
        store.flush()
    before = store.totals()
    rows_before = store.file_rows()
    folded = store.roll_up()
    after = store.totals()
    assert folded > 0
    assert store.file_rows() < rows_before
    assert after.work == before.work
    assert after.rejected == before.rejected
    assert (after.running_s, after.paused_s) == (before.running_s, before.paused_s)
    sizes = {size for _, size, _ in store.history()}
    assert sizes == {HOUR, DAY}
    assert store.roll_up() == 0  # idempotent
    assert store.totals().work == before.work
    store.close()


WRITER = """
import sys, time
from pathlib import Path
from volunteerd.stats import StatsStore
store = StatsStore.open(Path(sys.argv[1]))
n = 0
while True:
    store.record("ffn.0", forward=1, samples=1)
    n += 1
    if n % 100 == 0:
        store.flush()
        print(n, flush=True)
    time.sleep(0.0005)
"""


def test_kill_minus_nine_loses_at_most_the_unflushed_counts(tmp_path: Path) -> None:
    path = tmp_path / "stats.sqlite3"
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), str(path)],
        stdout=subprocess.PIPE,
        text=True,
    ) as writer:
        assert writer.stdout is not None
        flushed = 0
        deadline = time.monotonic() + 60
        while flushed < 1000 and time.monotonic() < deadline:
            flushed = int(writer.stdout.readline())
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
    store = StatsStore.open(path)
    counted = store.totals().work.forward
    # Every flush that was reported made it; at most one more flush may have landed.
    assert flushed <= counted <= flushed + 200
    assert counted % 100 == 0
    store.record("ffn.0", forward=1)  # and the file is usable
    store.close()


@pytest.mark.parametrize("link", ["to nothing", "to itself"])
def test_a_stats_file_that_is_a_broken_link_is_moved_aside(tmp_path: Path, link: str) -> None:
    """``exists()`` follows links: a link to nothing (or a loop) was never moved aside,
    though the log said so, and the daemon did not start."""
    from volunteerd.server.contribution import open_stats

    path = tmp_path / "stats.sqlite3"
    path.symlink_to(tmp_path / "unmounted" / "stats.sqlite3" if link == "to nothing" else path)
    store = open_stats(path, keep_hourly_days=7)
    store.record("ffn.0.0", forward=1, samples=4)
    store.close()
    assert not path.is_symlink()
    assert [p.is_symlink() for p in tmp_path.glob("stats.sqlite3.unreadable-*")] == [True]
    again = StatsStore.open(path, keep_hourly_days=7)
    assert again.current().work.forward == 1
    again.close()


def test_statistics_that_cannot_be_kept_anywhere_are_kept_in_memory(tmp_path: Path) -> None:
    from volunteerd.server.contribution import open_stats

    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    store = open_stats(blocked / "stats.sqlite3", keep_hourly_days=7)  # its folder is a file
    store.record("ffn.0.0", forward=2, samples=4)
    store.flush()
    assert store.current().work.forward == 2
    store.close()


async def test_a_full_disk_at_the_last_write_still_lets_the_daemon_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The last flush failing (a full disk) raised out of the daemon's stop: exit 1
    with a traceback instead of a clean stop, and the database left open."""
    import sqlite3

    from volunteerd.server.contribution import opened_stats

    def full() -> None:
        raise sqlite3.OperationalError("database or disk is full")

    async with opened_stats(tmp_path / "stats.sqlite3", keep_hourly_days=7) as store:
        store.record("ffn.0.0", forward=1, samples=4)
        store.flush = full  # type: ignore[method-assign]
    assert "the last statistics could not be written: database or disk is full" in caplog.text
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        store._db.execute("SELECT 1")


def test_a_stats_file_that_cannot_be_written_for_now_is_kept_not_moved_aside(
    tmp_path: Path,
) -> None:
    """A start on a full disk moved a healthy stats file aside as "unreadable" (the
    all-time totals read 0 from then on). A real write failure here: the process may
    write no byte to a file (RLIMIT_FSIZE 0), so SQLite cannot make its WAL files."""
    path = tmp_path / "stats.sqlite3"
    store = StatsStore.open(path, keep_hourly_days=7)
    store.record("ffn.0.0", forward=3, samples=12)
    store.close()
    for extra in ("-wal", "-shm"):  # a clean close leaves only the database
        path.with_name(path.name + extra).unlink(missing_ok=True)
    script = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "from volunteerd.server.contribution import open_stats\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
        "store = open_stats(Path(sys.argv[1]), keep_hourly_days=7)\n"
        "store.record('ffn.0.0', forward=1)\n"
        "print(store.current().work.forward)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert ran.stdout.split() == ["1"], ran.stderr  # this run counted in memory
    assert "kept as it is" in ran.stderr
    assert not list(tmp_path.glob("stats.sqlite3.unreadable-*"))
    again = StatsStore.open(path, keep_hourly_days=7)
    assert again.totals().work.forward == 3
    again.close()


def test_a_stats_file_whose_tables_have_other_columns_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real SQLite file with ``work(x)`` and ``uptime(x)`` was kept: every flush and
    every status request failed for the whole run, and nothing was written."""
    import sqlite3

    from volunteerd.server.contribution import open_stats

    path = tmp_path / "stats.sqlite3"
    other = sqlite3.connect(path)
    other.executescript(
        "CREATE TABLE work (x); CREATE TABLE uptime (x); INSERT INTO work VALUES (7)"
    )
    other.close()
    store = open_stats(path, keep_hourly_days=7)
    store.record("ffn.0.0", forward=2, samples=4)
    store.tick(1.5, paused=False)
    store.flush()
    assert store.roll_up() == 0
    assert store.current().work.forward == 2
    store.close()
    [aside] = tmp_path.glob("stats.sqlite3.unreadable-*[0-9]")
    assert "table work has the columns (x)" in caplog.text
    assert f"moved to {aside}" in caplog.text
    kept = sqlite3.connect(aside)  # moved, not deleted
    assert kept.execute("SELECT x FROM work").fetchall() == [(7,)]
    kept.close()


def test_a_stats_file_whose_schema_has_a_byte_not_utf8_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One byte of the schema text changed to 0xA2: SQLite's "malformed database
    schema" message quotes it, Python's sqlite3 raised ``UnicodeDecodeError`` (no
    ``sqlite3.Error``) and the daemon did not start, on every restart (a fuzzing
    audit)."""
    from volunteerd.server.contribution import open_stats

    path = tmp_path / "stats.sqlite3"
    made = StatsStore.open(path, keep_hourly_days=7)
    made.record("ffn.0.0", forward=3)
    made.close()
    data = bytearray(path.read_bytes())
    at = data.find(b"DEFAULT")
    data[at + 3] = 0xA2  # "DEF\xa2ULT"
    path.write_bytes(bytes(data))
    with pytest.raises(sqlite3.DatabaseError, match="malformed database schema"):
        StatsStore.open(path, keep_hourly_days=7)
    store = open_stats(path, keep_hourly_days=7)
    assert store.waiting_for is None  # the file's again, not counting in memory
    store.record("ffn.0.0", forward=2)
    store.close()
    [aside] = tmp_path.glob("stats.sqlite3.unreadable-*[0-9]")
    assert aside.read_bytes() == bytes(data)  # moved, not deleted
    assert f"moved to {aside}, counting afresh" in caplog.text
    again = StatsStore.open(path, keep_hourly_days=7)
    assert again.totals().work.forward == 2
    again.close()


def test_a_stats_file_whose_schema_is_damaged_while_running_fails_queries_as_sqlite_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A query's connection opened after the schema got a byte that is not UTF-8
    raised ``UnicodeDecodeError``, which ``/status`` (it answers without the file's
    counts when they cannot be read) and ``/stats`` did not catch."""
    from volunteerd.config import Config, LimitsConfig
    from volunteerd.net import Throttle
    from volunteerd.server.contribution import Accountant

    store = StatsStore.open(tmp_path / "stats.sqlite3", keep_hourly_days=7)
    counts = Accountant(store, None, Throttle(LimitsConfig()), Config().stats, serving=lambda: True)
    store.record("ffn.0.0", forward=4)
    store.flush()
    other = sqlite3.connect(tmp_path / "stats.sqlite3", isolation_level=None)
    other.execute("PRAGMA writable_schema=ON")
    other.execute(
        "UPDATE sqlite_master SET sql = replace(sql, 'DEFAULT', CAST(X'444546A2554C54' AS TEXT)) "
        "WHERE name = 'traffic'"
    )
    other.close()
    store.record("ffn.0.0", forward=1)
    with pytest.raises(sqlite3.DatabaseError, match="malformed database schema"):
        store.totals()
    assert trio.run(counts.counted_since, 0.0).work.forward == 1  # what is in memory
    assert "could not read the statistics (malformed database schema" in caplog.text
    store.close()


def test_a_stats_file_with_our_tables_and_others_besides_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "stats.sqlite3"
    store = StatsStore.open(path, keep_hourly_days=7)
    store.record("ffn.0.0", forward=3)
    store._db.execute("CREATE TABLE notes (text)")  # a curious volunteer's
    store.close()
    again = StatsStore.open(path, keep_hourly_days=7)
    assert again.totals().work.forward == 3
    again.close()


def test_a_stats_file_from_before_the_traffic_table_is_kept_and_counts_traffic(
    tmp_path: Path,
) -> None:
    path = tmp_path / "stats.sqlite3"
    store = StatsStore.open(path)
    store.record("ffn.0.0", forward=3)
    store.transferred(up=5)
    store.close()
    with sqlite3.connect(path) as db:  # as the version before wrote it
        db.execute("DROP TABLE traffic")
    db.close()
    again = StatsStore.open(path)
    again.transferred(up=1000, down=20)
    again.flush()
    totals = again.totals()
    assert totals.work.forward == 3
    assert (totals.traffic.bytes_up, totals.traffic.bytes_down) == (1000, 20)
    again.close()


def test_a_stats_file_emptied_to_0_bytes_is_moved_aside_with_its_wal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite takes an empty file for a new database and deletes its WAL: an audit
    truncated the file and the totals restarted from zero with no log line."""
    import shutil

    from volunteerd.server.contribution import open_stats

    running = StatsStore.open(tmp_path / "running.sqlite3", keep_hourly_days=7)
    running.record("ffn.0.0", forward=5)
    running.flush()  # in the WAL: a running daemon's files, copied as they are
    path = tmp_path / "stats.sqlite3"
    for extra in ("", "-wal", "-shm"):
        shutil.copyfile(tmp_path / f"running.sqlite3{extra}", tmp_path / f"stats.sqlite3{extra}")
    running.close()
    wal = (tmp_path / "stats.sqlite3-wal").read_bytes()
    path.write_bytes(b"")
    store = open_stats(path, keep_hourly_days=7)
    assert store.current().work.forward == 0
    store.close()
    [aside] = tmp_path.glob("stats.sqlite3.unreadable-*[0-9]")
    assert aside.with_name(aside.name + "-wal").read_bytes() == wal
    assert "is unreadable (it is empty: 0 bytes)" in caplog.text


def test_a_failed_flush_logs_one_line_not_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk logged a 13-line traceback at every flush (every 5 s), where every
    other failed write of the daemon logs one line."""
    import sqlite3

    from volunteerd.config import Config, LimitsConfig
    from volunteerd.net import Throttle
    from volunteerd.server.contribution import Accountant

    def full(*args: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    store = StatsStore.open(tmp_path / "stats.sqlite3", keep_hourly_days=7)
    counts = Accountant(store, None, Throttle(LimitsConfig()), Config().stats, serving=lambda: True)
    store._write = full  # type: ignore[method-assign]
    for _ in range(2):
        store.record("ffn.0.0", forward=1)
        counts._flush()
    failed = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.exc_info for r in failed] == [None, None]
    assert "could not write the statistics (database or disk is full)" in failed[0].getMessage()
    assert store.totals().work.forward == 0  # not written: the counts wait in memory
    assert store.pending().work.forward == 2
    del store._write
    store.close()


def test_status_counts_what_is_in_memory_when_the_file_cannot_be_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A query of the file failing made every ``GET /status`` a 500: ``volunteerd
    status``, the dashboard and the tray saw nothing for the whole run."""
    import sqlite3

    from volunteerd.config import Config, LimitsConfig
    from volunteerd.net import Throttle
    from volunteerd.server.contribution import Accountant

    def broken(*args: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    store = StatsStore.open(tmp_path / "stats.sqlite3", keep_hourly_days=7)
    counts = Accountant(store, None, Throttle(LimitsConfig()), Config().stats, serving=lambda: True)
    store.record("ffn.0.0", forward=4, samples=8)
    store.flush()
    store.record("ffn.0.0", forward=1, samples=2)
    assert trio.run(counts.counted_since, 0.0).work.forward == 5
    store._sums = broken  # type: ignore[method-assign]
    assert trio.run(counts.counted_since, 0.0).work.samples == 2
    [line] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert line.exc_info is None
    assert "could not read the statistics (disk I/O error)" in line.getMessage()
    del store._sums
    store.close()


def test_a_stats_file_from_a_newer_version_is_left_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It was moved aside as damaged and counting restarted in a new file: back on the
    newer version (a downgrade and an upgrade again), its totals were gone (an outside
    probe)."""
    import sqlite3

    from volunteerd.server.contribution import open_stats

    path = tmp_path / "stats.sqlite3"
    newer = StatsStore.open(path, keep_hourly_days=7)
    newer.record("ffn.0.0", forward=5, samples=10)
    newer.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=99")
    db.close()
    before = path.read_bytes()
    store = open_stats(path, keep_hourly_days=7)
    store.record("ffn.0.0", forward=2, samples=4)
    store.flush()
    assert store.current().work.forward == 2  # this run, in memory
    store.close()
    assert path.read_bytes() == before
    assert list(tmp_path.glob("stats.sqlite3.unreadable-*")) == []
    assert "written by a newer volunteerd (schema 99)" in caplog.text
    assert "upgrade volunteerd" in caplog.text


def test_statistics_kept_in_memory_for_want_of_their_file_move_there_once_it_can_be_opened(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a daemon started on a full disk counted in memory for its whole run, although
    # space came back 5 s later: 57 trainer steps, 0 calls in the file (an outside audit)
    import logging

    from volunteerd.config import Config, LimitsConfig
    from volunteerd.net import Throttle
    from volunteerd.server.contribution import Accountant, open_stats

    folder = tmp_path / "data"
    path = folder / "stats.sqlite3"
    earlier = StatsStore.open(path, keep_hourly_days=7)  # a file with counts of its own
    earlier.record("ffn.0.0", forward=5, samples=10)
    earlier.close()
    moved = tmp_path / "moved"
    folder.rename(moved)
    folder.write_text("for the moment, not a folder")  # cannot be opened, nor made
    caplog.set_level(logging.INFO, logger="volunteerd.server.contribution")
    store = open_stats(path, keep_hourly_days=7)
    assert store.waiting_for == path
    counts = Accountant(store, None, Throttle(LimitsConfig()), Config().stats, serving=lambda: True)
    store.record("ffn.0.0", forward=2, samples=4)
    counts._flush()  # still blocked: into memory
    store.record("ffn.0.1", backward=3)
    assert store.waiting_for == path
    folder.unlink()
    moved.rename(folder)  # the way is clear again
    store.record("ffn.0.0", forward=1)
    counts._flush()
    assert store.waiting_for is None
    assert any("could be opened at last" in r.getMessage() for r in caplog.records)
    store.record("ffn.0.1", backward=1)
    store.close()
    reopened = StatsStore.open(path, keep_hourly_days=7)
    totals = reopened.totals()
    reopened.close()
    assert totals.by_expert["ffn.0.0"].forward == 5 + 2 + 1
    assert totals.by_expert["ffn.0.0"].samples == 10 + 4
    assert totals.by_expert["ffn.0.1"].backward == 3 + 1


async def test_a_run_that_never_could_open_its_statistics_says_at_the_stop_they_are_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from volunteerd.server.contribution import opened_stats

    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    async with opened_stats(blocked / "stats.sqlite3", keep_hourly_days=7) as store:
        store.record("ffn.0.0", forward=2)
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("kept in memory only, and are not saved" in m for m in said), said


def test_counts_written_while_the_clock_was_ahead_are_moved_to_now_at_the_next_flush(
    tmp_path: Path,
) -> None:
    """The clock was three days (or a year) ahead while these were counted and written,
    then set right. Counted in "today" on each of the next days at first (no upper bound
    on the queries), then hidden from every total, all time included, until the clock
    caught up with them (a re-check): the next flush now moves them to now."""
    for ahead in (3 * DAY, 365 * DAY):
        clock = Clock(START + ahead + 10)
        store = StatsStore.open(tmp_path / f"stats-{ahead}.sqlite3", clock=clock)
        store.record("ffn.0.1", forward=1, samples=5)
        store.flush()
        clock.now = START + 10  # set right
        assert store.current(since=START).work.samples == 0  # a bucket not begun yet
        store.record("ffn.0.1", forward=1, samples=2)
        store.flush()
        assert store.current(since=START).work.samples == 7
        assert store.current().work.samples == 7  # all time
        assert [(bucket - START, size) for bucket, size, _ in store.history()] == [(0, HOUR)]
        clock.now = START + DAY + 10
        assert store.current(since=START + DAY).work.samples == 0  # not "today" again
        clock.now = START + ahead + 10
        assert store.current().work.samples == 7  # nor twice when its stamp comes
        store.close()


def test_counts_made_before_the_clock_was_set_back_are_written_at_now(
    tmp_path: Path,
) -> None:
    clock = Clock(START + 3 * DAY + 10)
    store = StatsStore.open(tmp_path / "stats.sqlite3", clock=clock)
    store.record("ffn.0.1", forward=1, samples=5)
    store.reject("ffn.0.1", "busy")
    store.tick(2.0, paused=False)
    clock.now = START + 10  # set right before the flush
    assert store.current(since=START).work.samples == 5
    store.flush()
    today = store.current(since=START)
    assert (today.work.samples, today.rejected, today.running_s) == (5, {"busy": 1}, 2.0)
    assert [(bucket - START, size) for bucket, size, _ in store.history()] == [(0, HOUR)]
    store.close()


@pytest.mark.parametrize(
    "offset_min", [330, 345, 570, -210]
)  # India, Nepal, Adelaide, Newfoundland
def test_today_in_a_zone_of_half_or_quarter_hours_counts_nothing_of_yesterday(
    tmp_path: Path, offset_min: int
) -> None:
    # Local midnight in a zone at UTC+5:30 is 18:30 UTC: hourly buckets counted the
    # whole hour from 18:00 UTC, 23:30 to 00:30 local, in "today".
    midnight = START + DAY - offset_min * 60  # local midnight, as Unix seconds
    clock = Clock(midnight - 60)  # 23:59 local
    store = StatsStore.open(tmp_path / "stats.sqlite3", clock=clock)
    store.record("ffn.0.1", forward=5, samples=5)
    store.reject("ffn.0.1", "busy")
    store.tick(60.0, paused=False)
    store.flush()
    clock.now = midnight + 60  # 00:01 local
    store.record("ffn.0.1", forward=2, samples=2)
    today = store.current(since=midnight)
    assert (today.work.forward, today.rejected, today.running_s) == (2, {}, 0.0)
    store.flush()
    today = store.totals(since=midnight)
    assert (today.work.forward, today.rejected, today.running_s) == (2, {}, 0.0)
    assert store.totals().work.forward == 7
    # The history stays hourly.
    assert sum(size == HOUR for _, size, _ in store.history()) == len(store.history())
    store.close()


def test_hourly_rows_of_older_files_are_still_read_and_rolled_up(tmp_path: Path) -> None:
    path = tmp_path / "stats.sqlite3"
    clock = Clock(START + 10)
    store = StatsStore.open(path, keep_hourly_days=1, clock=clock)
    store._db.execute(  # as a version before quarter hours wrote it
        "INSERT INTO work VALUES (?, ?, 'ffn.0.1', 3, 0, 3, 0, 0, 0)", (START, HOUR)
    )
    store.record("ffn.0.1", forward=4, samples=4)
    store.flush()
    assert store.totals(since=START).work.forward == 7
    assert [(b - START, size, w.forward) for b, size, w in store.history()] == [(0, HOUR, 7)]
    clock.now += 9 * DAY
    assert store.roll_up() == 2
    assert [(b - START, size, w.forward) for b, size, w in store.history()] == [(0, DAY, 7)]
    store.close()


def test_the_last_7_days_count_no_more_when_hourly_rows_are_kept_fewer_days(
    tmp_path: Path,
) -> None:
    # keep_hourly_days = 1 folded the day the window begins in into one daily row,
    # counted whole: the last 7 days held up to a day more.
    clock = Clock(START + HOUR)
    store = StatsStore.open(tmp_path / "stats.sqlite3", keep_hourly_days=1, clock=clock)
    store.record("ffn.0.1", forward=3)  # 01:00 on day 0
    clock.now = START + 13 * HOUR
    store.record("ffn.0.1", forward=4)  # 13:00 on day 0
    store.flush()
    clock.now = START + 7 * DAY + 12 * HOUR
    store.roll_up()
    assert store.totals(since=clock.now - 7 * DAY).work.forward == 4
    clock.now += 2 * DAY  # past the 7 days: folded then
    assert store.roll_up() == 2
    assert store.totals().work.forward == 7
    store.close()


class _Gate:
    """Holds a query in ``thread`` inside SQLite until ``release``: every connection
    the store opens gets a progress handler that waits, once, in that thread only
    (any thread but the one that made the gate while ``thread`` is None): in the
    first statement that holds ``at`` (the one that reads the ``rejected`` table is
    ``totals``' second: its snapshot of the file is taken by then), or in the first
    statement at all (before any snapshot) for ``at=None``. The query is made slow on
    purpose, not by the file's size."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: str | None = None) -> None:
        self.thread: threading.Thread | None = None
        self.home = threading.current_thread()
        self.at = at
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        connect = sqlite3.connect

        def gated(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            db = connect(*args, **kwargs)
            db.set_trace_callback(self._arm)
            db.set_progress_handler(self._wait, 1)
            return db

        monkeypatch.setattr("volunteerd.stats.store.sqlite3.connect", gated)

    def _ours(self) -> bool:
        here = threading.current_thread()
        return here is self.thread if self.thread is not None else here is not self.home

    def _arm(self, statement: str) -> None:
        if (self.at is None or self.at in statement) and self._ours():
            self.armed = True

    def _wait(self) -> int:
        if self.armed and not self.entered.is_set() and self._ours():
            self.entered.set()
            self.release.wait(30)
        return 0

    def start(self, query: Callable[[], object]) -> list[object]:
        """Run ``query`` in a thread and return once it waits inside SQLite."""
        result: list[object] = []
        self.thread = threading.Thread(target=lambda: result.append(query()))
        self.thread.start()
        assert self.entered.wait(10), "the query never reached SQLite"
        return result


def test_counting_and_flushing_do_not_wait_for_a_query(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``record`` and ``tick`` run on the daemon's event loop, once a second and once an
    answered call. They took the lock that a query held for its whole run: on a file of
    718k rows, one open dashboard's ``/stats`` (2-3 s) stalled every expert call as
    long (an outside audit)."""
    gate = _Gate(monkeypatch, at="FROM rejected")
    store = StatsStore.open(tmp_path / "stats.sqlite3")
    store.record("ffn.0.0", forward=1)
    store.flush()
    read = gate.start(lambda: store.totals().work.forward)

    def count() -> None:
        store.record("ffn.0.0", forward=2)
        store.tick(1.0, paused=False)
        store.transferred(up=5)
        store.reject("ffn.0.0", "busy")
        store.flush()  # a writer beside the reader (WAL)

    counting = threading.Thread(target=count)
    counting.start()
    try:
        counting.join(10)
        assert not counting.is_alive(), "counting waited for the query"
        assert gate.thread is not None
        assert gate.thread.is_alive()  # still held
    finally:
        gate.release.set()
        counting.join()
        assert gate.thread is not None
        gate.thread.join()
    assert read == [1]  # the snapshot it began with
    assert store.current().work.forward == 3
    store.close()


def test_a_flush_during_a_read_neither_loses_nor_doubles_a_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``current`` adds the file's sums and the counts not written yet; a flush that
    writes the counts after the read took them from memory and before it took its
    snapshot of the file moves them from one to the other."""
    gate = _Gate(monkeypatch)
    store = StatsStore.open(tmp_path / "stats.sqlite3")
    store.record("ffn.0.0", forward=1)
    store.flush()
    store.record("ffn.0.0", forward=10)  # in memory while the read begins
    read = gate.start(lambda: store.current().work.forward)
    # written before the read takes its snapshot, so in it, and in memory no longer
    flushing = threading.Thread(target=store.flush)
    flushing.start()
    flushing.join(10)
    store.record("ffn.0.0", forward=100)
    gate.release.set()
    flushing.join()
    assert store.totals().work.forward == 11
    gate.thread.join()  # type: ignore[union-attr]
    assert read == [111]
    assert store.current().work.forward == 111
    store.close()


def test_queries_read_only_the_rows_of_their_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bucket + size > since`` cannot bound the primary key's range from below:
    every query read the table from its first row (718k rows for "today")."""
    seen: list[str] = []
    connect = sqlite3.connect

    def traced(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        db = connect(*args, **kwargs)
        db.set_trace_callback(seen.append)
        return db

    monkeypatch.setattr("volunteerd.stats.store.sqlite3.connect", traced)
    clock = Clock(START + 30 * DAY)
    store = StatsStore.open(tmp_path / "stats.sqlite3", clock=clock)
    store.record("ffn.0.0", forward=1)
    store.flush()
    seen.clear()
    store.current(since=clock.now - DAY)
    store.history(since=clock.now - DAY)
    store.traffic_history(since=clock.now - DAY)
    queries = [q for q in seen if q.startswith("SELECT") and "sqlite_master" not in q]
    assert len(queries) == 6
    plain = connect(tmp_path / "stats.sqlite3")
    for query in queries:
        plan = " ".join(row[3] for row in plain.execute(f"EXPLAIN QUERY PLAN {query}"))
        # from the window's start, not from the file's first row up to now
        assert "(bucket>? AND bucket<?)" in plan, (query, plan)
    plain.close()
    store.close()


async def test_status_reads_today_in_a_thread_while_the_loop_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GET /status`` read "today" on the event loop: 1.9 s a call on a file of 718k
    rows, every expert call waiting as long (an outside audit)."""
    from volunteerd.config import Config, LimitsConfig
    from volunteerd.net import Throttle
    from volunteerd.server.contribution import Accountant

    gate = _Gate(monkeypatch, at="FROM rejected")
    store = StatsStore.open(tmp_path / "stats.sqlite3")
    counts = Accountant(store, None, Throttle(LimitsConfig()), Config().stats, serving=lambda: True)
    store.record("ffn.0.0", forward=1)
    store.flush()
    read: list[int] = []

    async def status() -> None:
        read.append((await counts.counted_since(0.0)).work.forward)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(status)
        await trio.to_thread.run_sync(gate.entered.wait, 10)
        store.record("ffn.0.0", forward=2)  # the loop goes on while the query waits
        await trio.sleep(0.01)
        assert read == []
        gate.release.set()
    assert read == [1]  # as it was when the read began
    assert store.current().work.forward == 3
    store.close()


def test_a_burst_of_readers_keeps_at_most_a_few_connections_open(tmp_path: Path) -> None:
    """Each query runs on a connection of its own; a burst of them at once (dashboard
    requests, each in a thread) opens one each, and keeps only ``IDLE_READERS`` for
    the next: the rest were kept open for the daemon's life."""
    store = StatsStore.open(tmp_path / "stats.sqlite3")
    store.record("ffn.0.0", forward=1, samples=4)
    store.flush()
    together = threading.Barrier(8)

    def read() -> None:
        with store._reading() as (db, _):  # eight reads under way at once
            together.wait()
            assert db.execute("SELECT SUM(samples) FROM work").fetchone() == (4,)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store._readers) <= IDLE_READERS
