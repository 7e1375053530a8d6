"""Contribution accounting: what this machine did, per expert and per quarter hour, in
SQLite.

The daemon counts in memory (``record``, ``reject``, ``tick``: cheap, on the event loop)
and ``flush`` writes the counts since the last flush in one transaction, every few
seconds. Counting never waits for SQL: the counts have their own short lock that no
query or write holds, and queries read through a connection of their own, which WAL lets
run beside the writer. (Queries held the one lock for their whole run: on a file of 718k
rows, one open dashboard's ``/stats`` held it for 2-3 s, and the event loop, counting
each second and each answered call, waited as long: an expert call took 5.5 s instead of
0.15 s, an outside audit.) SQLite runs in WAL mode with ``synchronous=NORMAL``: a crash,
even ``kill -9``, loses at most what was counted since the last flush and never leaves a
damaged file. Hourly rows older than ``keep_hourly_days`` (at least 7, so that the last
7 days are summed from them exactly) are rolled up into daily rows, so the file stays
small (a year of a busy daemon hosting 16 experts: a few MiB).

Counts are stamped with the wall clock, which can be set back: a query counts only the
buckets that begin by now, and a flush writes counts stamped ahead of now into now's
bucket (a row stamped three days ahead was counted in "today" on each of those days).

Counts go into quarter-hour buckets: every UTC offset in use is a whole number of
quarter hours, so local midnight begins a bucket and "today" counts nothing of
yesterday. (Hourly buckets, as files written before hold, counted the UTC hour that
holds local midnight whole in half-hour and 45-minute zones: 5 requests at 23:59 in
India were in the next day's "today".) "Hourly rows" below are the quarter-hour and
hourly ones; ``history`` sums them per hour.

Tables (times are UTC; ``bucket`` is Unix seconds at the start of the bucket; daily
buckets are UTC days):

* ``work(bucket, size, expert, forward, backward, samples, compute_s, bytes_in,
  bytes_out)`` — ``size`` is 900 (a quarter hour), 3600 (an hour, in files written by
  versions before) or 86400 (a day);
* ``rejected(bucket, size, expert, reason, count)`` — ``expert`` is "" for uids the
  daemon did not host (a peer makes those up for free: ``server.contribution``);
* ``uptime(bucket, size, running_s, paused_s)``;
* ``traffic(bucket, size, bytes_up, bytes_down)`` — every byte the throttle counted
  (``net/throttle.py``, and so the transfer quotas): expert calls, parameters and
  shards sent to peers, replica averaging, relayed circuits, the DHT. ``work``'s
  ``bytes_in`` and ``bytes_out`` are only the tensors of expert calls: 5 ``params``
  requests sent 10.5 MB, which the quota counted and "Uploaded" did not (an outside
  audit). Files written before have no such table: it is made, and their traffic
  until then is unknown (0). A version without it ignores it (it reads only its own
  tables), so the schema version stays 1 and an older volunteerd still opens the file.
"""

from __future__ import annotations

import functools
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

from volunteerd.atomic import make_private_dirs

__all__ = [
    "HOUR",
    "IDLE_READERS",
    "MalformedStats",
    "NewerStats",
    "StatsStore",
    "Totals",
    "Traffic",
    "Work",
]

HOUR = 3600
QUARTER = 900  # the size of a new bucket
KEEP_HOURLY_DAYS_AT_LEAST = 7  # whatever ``stats.keep_hourly_days`` says
DAY = 86400
_SCHEMA_VERSION = 1
_TABLES = ("work", "rejected", "uptime", "traffic")
# The history's buckets: quarter hours summed per hour (the dashboard's chart is
# hourly), daily rows as they are.
_HOURLY = f"CASE WHEN size < {HOUR} THEN bucket - bucket % {HOUR} ELSE bucket END"
_HOURLY_SIZE = f"MAX(size, {HOUR})"
# A query's window as a range of the primary key's first column, so SQLite reads only
# the rows it needs: ``bucket + size > since`` alone scanned the whole table (718k
# rows for "today"); a bucket ends at most a day (the largest size) after it begins.
_WINDOW = f"bucket > ? - {DAY} AND bucket + size > ? AND bucket <= ?"
# how many of each table's first columns are its primary key (the rest are sums)
_KEY_COLUMNS = {"work": 3, "rejected": 4, "uptime": 2, "traffic": 2}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS work (
    bucket INTEGER NOT NULL, size INTEGER NOT NULL, expert TEXT NOT NULL,
    forward INTEGER NOT NULL DEFAULT 0, backward INTEGER NOT NULL DEFAULT 0,
    samples INTEGER NOT NULL DEFAULT 0, compute_s REAL NOT NULL DEFAULT 0,
    bytes_in INTEGER NOT NULL DEFAULT 0, bytes_out INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (bucket, size, expert)
);
CREATE TABLE IF NOT EXISTS rejected (
    bucket INTEGER NOT NULL, size INTEGER NOT NULL, expert TEXT NOT NULL,
    reason TEXT NOT NULL, count INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (bucket, size, expert, reason)
);
CREATE TABLE IF NOT EXISTS uptime (
    bucket INTEGER NOT NULL, size INTEGER NOT NULL,
    running_s REAL NOT NULL DEFAULT 0, paused_s REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (bucket, size)
);
CREATE TABLE IF NOT EXISTS traffic (
    bucket INTEGER NOT NULL, size INTEGER NOT NULL,
    bytes_up INTEGER NOT NULL DEFAULT 0, bytes_down INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (bucket, size)
);
"""


@functools.cache
def _columns() -> dict[str, list[str]]:
    """The column names of each table, in order, as ``_SCHEMA`` makes them."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(_SCHEMA)
        return {t: [row[1] for row in db.execute(f"PRAGMA table_info({t})")] for t in _TABLES}
    finally:
        db.close()


def _check_columns(db: sqlite3.Connection) -> None:
    """Raise ``RuntimeError`` if a table of ours has columns other than ours (a table
    that is missing is made). ``CREATE TABLE IF NOT EXISTS`` keeps a table of the same
    name whatever its columns, and the writes insert by position: a file whose ``work``
    was ``work(x)`` failed every flush and every status request for the whole run."""
    for table, names in _columns().items():
        found = [row[1] for row in db.execute(f"PRAGMA table_info({table})")]
        if found and found != names:
            raise RuntimeError(
                f"its table {table} has the columns ({', '.join(found)}), not ({', '.join(names)})"
            )


class NewerStats(RuntimeError):
    """The file was written by a newer volunteerd (a higher schema): not damaged, not
    ours to change."""


class MalformedStats(sqlite3.DatabaseError):
    """SQLite's error message quoted bytes of the file that are not UTF-8 (a schema
    damaged in one byte: 'malformed database schema (traffic) - near "DEF\\xa2ULT"'),
    which Python's ``sqlite3`` raises as ``UnicodeDecodeError``, no ``sqlite3.Error``:
    the daemon, which sets a damaged file aside, failed to start on every restart (a
    fuzzing audit). SQLite's own messages that quote nothing of the file (a full disk,
    a lock) are plain text, so such bytes come from the file: it is damaged
    (``SQLITE_CORRUPT``)."""

    sqlite_errorcode = sqlite3.SQLITE_CORRUPT
    sqlite_errorname = "SQLITE_CORRUPT"


@contextmanager
def _decoded_errors() -> Iterator[None]:
    """Raise ``MalformedStats`` for a ``UnicodeDecodeError`` of SQL run inside, with
    the message's bytes that are not UTF-8 replaced."""
    try:
        yield
    except UnicodeDecodeError as exc:
        raw = exc.object if isinstance(exc.object, bytes) else bytes(exc.object)
        raise MalformedStats(raw.decode("utf-8", "replace")) from exc


@dataclass(slots=True)
class Work:
    """Counts of one expert in one bucket (or summed over many)."""

    forward: int = 0
    backward: int = 0
    samples: int = 0
    compute_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0

    def add(self, other: Work) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def requests(self) -> int:
        return self.forward + self.backward


@dataclass(slots=True)
class Traffic:
    """Bytes this node sent and received, all of them (what the quotas count)."""

    bytes_up: int = 0
    bytes_down: int = 0

    def add(self, other: Traffic) -> None:
        self.bytes_up += other.bytes_up
        self.bytes_down += other.bytes_down


@dataclass(slots=True)
class Totals:
    """Everything counted since some time."""

    work: Work = field(default_factory=Work)
    by_expert: dict[str, Work] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    running_s: float = 0.0
    paused_s: float = 0.0
    traffic: Traffic = field(default_factory=Traffic)


class _Counts:
    """What was counted and not written yet."""

    __slots__ = ("rejected", "traffic", "uptime", "work")

    def __init__(self) -> None:
        self.work: dict[tuple[int, str], Work] = {}
        self.rejected: Counter[tuple[int, str, str]] = Counter()
        self.uptime: dict[int, list[float]] = {}
        self.traffic: dict[int, Traffic] = {}

    def __bool__(self) -> bool:
        return bool(self.work or self.rejected or self.uptime or self.traffic)

    def add(self, other: _Counts) -> None:
        for key, w in other.work.items():
            self.work.setdefault(key, Work()).add(w)
        self.rejected.update(other.rejected)
        for bucket, (run, pause) in other.uptime.items():
            slot = self.uptime.setdefault(bucket, [0.0, 0.0])
            slot[0] += run
            slot[1] += pause
        for bucket, t in other.traffic.items():
            self.traffic.setdefault(bucket, Traffic()).add(t)


# A read that takes a read transaction's snapshot of the file (any read does), and how
# many times a query takes it again when a flush overlapped, before it holds the writer
# off instead.
_PIN = "SELECT 1 FROM sqlite_master LIMIT 1"
_PIN_TRIES = 3
# Idle query connections kept for the next reads; more readers at once (a burst of
# dashboard requests, each in a thread) open their own and close them after.
IDLE_READERS = 2


class StatsStore:
    """Open with ``StatsStore.open(path)``; ``close()`` flushes. Safe to call from one
    thread at a time for counting and from any thread for ``flush`` and queries.

    Three locks, none held inside another but the writer's around the others: the
    counts' (held for microseconds: counting never waits for SQL), the writer's
    (``flush``, ``roll_up``, ``move_to_file``) and the readers' (a list of idle
    connections: queries run on connections of their own, side by side, so that
    ``/status``'s "today" does not wait for ``/stats``'s "all time"). ``current`` adds
    the file's sums and the counts not written yet, each once, although a flush may
    write them meanwhile: see ``_reading``."""

    def __init__(
        self,
        db: sqlite3.Connection,
        *,
        path: Path | None = None,
        keep_hourly_days: int = 14,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        # The file, for the queries' own connections; None for an in-memory store.
        self._path = path
        self._readers: list[sqlite3.Connection] = []  # idle, under ``_read_lock``
        # Never fewer than the dashboard's "last 7 days": a daily row only partly in
        # that window was counted whole (a day too much with keep_hourly_days = 1).
        self._keep_hourly_s = max(keep_hourly_days, KEEP_HOURLY_DAYS_AT_LEAST) * DAY
        self._clock = clock
        self._lock = threading.Lock()  # the counts; no SQL under it
        self._write_lock = threading.RLock()
        self._read_lock = threading.Lock()  # the list of idle readers
        self._counts = _Counts()
        # the counts a flush is writing: still counted by ``pending`` until committed
        self._flushing = _Counts()
        self._flushes = 0  # odd while a flush writes (changed under ``_lock``)
        # The file this in-memory store stands in for, while it cannot be opened for the
        # moment (a full disk at the start): ``move_to_file`` tries it again.
        self.waiting_for: Path | None = None

    @classmethod
    def open(cls, path: Path, **kwargs: object) -> StatsStore:
        """Open (or make) the store at ``path``. Raises ``RuntimeError`` for a file that
        is not one this version can use (emptied, from a newer version, tables with
        other columns), ``sqlite3.DatabaseError`` for one that is not a database, and
        ``OSError`` or ``sqlite3.Error`` for one that cannot be opened for now. (So do
        writes and queries: none raises ``UnicodeDecodeError``, see ``MalformedStats``.)"""
        make_private_dirs(path.parent)
        if str(path) != ":memory:" and path.is_file() and path.stat().st_size == 0:
            # SQLite takes an empty file for a new database and deletes its WAL, where
            # the counts since the last checkpoint are: an audit truncated the file to
            # 0 bytes and the totals restarted from zero, without a word in the log. A
            # file this store made has its first page from the next line on (WAL mode).
            raise RuntimeError("it is empty: 0 bytes")
        with _decoded_errors():
            return cls._open(path, **kwargs)

    @classmethod
    def _open(cls, path: Path, **kwargs: object) -> StatsStore:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > _SCHEMA_VERSION:
                raise NewerStats(f"{path} was written by a newer volunteerd (schema {version})")
            _check_columns(db)
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        except BaseException:
            db.close()
            raise
        file = None if str(path) == ":memory:" else path
        return cls(db, path=file, **kwargs)  # type: ignore[arg-type]

    def move_to_file(self, path: Path) -> None:
        """Open ``path`` (raising as ``open`` does) and add what this store holds, in
        memory and flushed, to what the file holds; from then on this store writes
        there. A daemon that started on a full disk counted in memory for its whole
        run, although space came back seconds later (an outside audit)."""
        opened = StatsStore.open(path)
        # no flush into the memory store between the copy and the swap (and no query
        # of it: an in-memory store's queries take this lock too)
        with self._write_lock:
            try:
                with opened._transaction() as target:
                    for table, names in _columns().items():
                        keys = names[: _KEY_COLUMNS[table]]
                        values = names[len(keys) :]
                        target.executemany(
                            f"INSERT INTO {table} VALUES ({', '.join('?' * len(names))}) "
                            f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET "
                            + ", ".join(f"{v} = {v} + excluded.{v}" for v in values),
                            self._db.execute(f"SELECT * FROM {table}").fetchall(),
                        )
            except BaseException:
                opened._db.close()
                raise
            self._db.close()
            self._db = opened._db
            self._path = opened._path
            self.waiting_for = None

    def close(self) -> None:
        """Write what is counted and close; the database is closed even when the
        writing fails (a full disk), and that error raised afterwards."""
        try:
            self.flush()
        finally:
            with self._read_lock:
                readers, self._readers = self._readers, []
            for reader in readers:
                reader.close()
            self._db.close()

    # -- counting (in memory) -------------------------------------------------------

    def _bucket(self) -> int:
        now = int(self._clock())
        return now - now % QUARTER

    def record(
        self,
        expert: str,
        *,
        forward: int = 0,
        backward: int = 0,
        samples: int = 0,
        compute_s: float = 0.0,
        bytes_in: int = 0,
        bytes_out: int = 0,
    ) -> None:
        bucket = self._bucket()
        with self._lock:
            work = self._counts.work.setdefault((bucket, expert), Work())
            work.add(Work(forward, backward, samples, compute_s, bytes_in, bytes_out))

    def reject(self, expert: str, reason: str, count: int = 1) -> None:
        bucket = self._bucket()
        with self._lock:
            self._counts.rejected[(bucket, expert, reason)] += count

    def tick(self, seconds: float, *, paused: bool) -> None:
        """Add ``seconds`` of uptime, running or paused, to the current hour."""
        bucket = self._bucket()
        with self._lock:
            slot = self._counts.uptime.setdefault(bucket, [0.0, 0.0])
            slot[1 if paused else 0] += seconds

    def transferred(self, up: int = 0, down: int = 0) -> None:
        """Add bytes sent (``up``) and received (``down``) to the current bucket."""
        bucket = self._bucket()
        with self._lock:
            self._counts.traffic.setdefault(bucket, Traffic()).add(Traffic(up, down))

    def has_news(self, traffic_bytes: int) -> bool:
        """Whether the counts not written yet hold more than uptime: an expert call, a
        refusal, or over ``traffic_bytes`` sent and received. Time alone ticks every
        second, and an idle daemon's DHT traffic never stops: writing those every
        ``flush_s`` cost an idle volunteer ~11 MB/h of disk writes (an outside audit)."""
        with self._lock:
            counts = self._counts
            if counts.work or counts.rejected:
                return True
            moved = sum(t.bytes_up + t.bytes_down for t in counts.traffic.values())
            return moved > traffic_bytes

    # -- persistence ----------------------------------------------------------------

    def flush(self) -> None:
        """Write what was counted since the last flush, in one transaction. The counts
        being written stay in ``pending`` until they are committed; counting goes on
        meanwhile."""
        with self._write_lock:
            with self._lock:
                if not self._counts:
                    return
                counts, self._counts = self._counts, _Counts()
                self._flushing = counts
                self._flushes += 1
            written = False
            try:
                self._write(counts.work, counts.rejected, counts.uptime, counts.traffic)
                written = True
            finally:
                with self._lock:
                    if not written:
                        # Not written (full disk, locked file): keep the counts for
                        # the next try.
                        counts.add(self._counts)
                        self._counts = counts
                    self._flushing = _Counts()
                    self._flushes += 1

    def _write(
        self,
        work: dict[tuple[int, str], Work],
        rejected: Counter[tuple[int, str, str]],
        uptime: dict[int, list[float]],
        traffic: dict[int, Traffic],
    ) -> None:
        """Write the counts; those of buckets ahead of now (counted before the clock
        was set back) into now's: a bucket in the future is in no window until its
        time comes. Rows written ahead of now earlier (the clock was set back after
        they were written) are moved into now's too: they were in no total, all time
        included, until the clock caught up with them, a year on for a clock a year
        ahead (a re-check)."""
        latest = self._bucket()
        with self._transaction() as db:
            for table, names in _columns().items():
                keys = names[: _KEY_COLUMNS[table]]
                rest, values = keys[2:], names[len(keys) :]
                if db.execute(
                    f"SELECT 1 FROM {table} WHERE bucket > ? LIMIT 1", (latest,)
                ).fetchone():
                    db.execute(
                        f"INSERT INTO {table} SELECT ?, {QUARTER}"
                        + "".join(f", {k}" for k in rest)
                        + "".join(f", SUM({v})" for v in values)
                        + f" FROM {table} WHERE bucket > ?"
                        + (f" GROUP BY {', '.join(rest)}" if rest else "")
                        + f" ON CONFLICT ({', '.join(keys)}) DO UPDATE SET "
                        + ", ".join(f"{v} = {v} + excluded.{v}" for v in values),
                        (latest, latest),
                    )
                    db.execute(f"DELETE FROM {table} WHERE bucket > ?", (latest,))
            db.executemany(
                "INSERT INTO work VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (bucket, size, expert) DO UPDATE SET "
                "forward = forward + excluded.forward, backward = backward + excluded.backward, "
                "samples = samples + excluded.samples, "
                "compute_s = compute_s + excluded.compute_s, "
                "bytes_in = bytes_in + excluded.bytes_in, "
                "bytes_out = bytes_out + excluded.bytes_out",
                [
                    (
                        min(hour, latest),
                        QUARTER,
                        expert,
                        w.forward,
                        w.backward,
                        w.samples,
                        w.compute_s,
                        w.bytes_in,
                        w.bytes_out,
                    )
                    for (hour, expert), w in work.items()
                ],
            )
            db.executemany(
                "INSERT INTO rejected VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (bucket, size, expert, reason) DO UPDATE SET "
                "count = count + excluded.count",
                [(min(h, latest), QUARTER, e, r, n) for (h, e, r), n in rejected.items()],
            )
            db.executemany(
                "INSERT INTO uptime VALUES (?, ?, ?, ?) ON CONFLICT (bucket, size) DO UPDATE "
                "SET running_s = running_s + excluded.running_s, "
                "paused_s = paused_s + excluded.paused_s",
                [(min(h, latest), QUARTER, run, pause) for h, (run, pause) in uptime.items()],
            )
            db.executemany(
                "INSERT INTO traffic VALUES (?, ?, ?, ?) ON CONFLICT (bucket, size) DO UPDATE "
                "SET bytes_up = bytes_up + excluded.bytes_up, "
                "bytes_down = bytes_down + excluded.bytes_down",
                [(min(h, latest), QUARTER, t.bytes_up, t.bytes_down) for h, t in traffic.items()],
            )

    def roll_up(self) -> int:
        """Fold hourly rows older than ``keep_hourly_days`` into daily rows; returns the
        number of hourly rows folded."""
        cutoff = self._bucket() - self._keep_hourly_s
        cutoff -= cutoff % DAY
        day = f"(bucket - bucket % {DAY})"
        with self._transaction() as db:
            folded = db.execute(
                "SELECT COUNT(*) FROM work WHERE size < ? AND bucket < ?", (DAY, cutoff)
            ).fetchone()[0]
            db.execute(
                f"INSERT INTO work SELECT {day}, {DAY}, expert, SUM(forward), SUM(backward), "
                "SUM(samples), SUM(compute_s), SUM(bytes_in), SUM(bytes_out) FROM work "
                f"WHERE size < {DAY} AND bucket < ? GROUP BY {day}, expert "
                "ON CONFLICT (bucket, size, expert) DO UPDATE SET "
                "forward = forward + excluded.forward, backward = backward + excluded.backward, "
                "samples = samples + excluded.samples, "
                "compute_s = compute_s + excluded.compute_s, "
                "bytes_in = bytes_in + excluded.bytes_in, "
                "bytes_out = bytes_out + excluded.bytes_out",
                (cutoff,),
            )
            db.execute(
                f"INSERT INTO rejected SELECT {day}, {DAY}, expert, reason, SUM(count) "
                f"FROM rejected WHERE size < {DAY} AND bucket < ? "
                f"GROUP BY {day}, expert, reason "
                "ON CONFLICT (bucket, size, expert, reason) DO UPDATE SET "
                "count = count + excluded.count",
                (cutoff,),
            )
            db.execute(
                f"INSERT INTO uptime SELECT {day}, {DAY}, SUM(running_s), SUM(paused_s) "
                f"FROM uptime WHERE size < {DAY} AND bucket < ? GROUP BY {day} "
                "ON CONFLICT (bucket, size) DO UPDATE SET "
                "running_s = running_s + excluded.running_s, "
                "paused_s = paused_s + excluded.paused_s",
                (cutoff,),
            )
            db.execute(
                f"INSERT INTO traffic SELECT {day}, {DAY}, SUM(bytes_up), SUM(bytes_down) "
                f"FROM traffic WHERE size < {DAY} AND bucket < ? GROUP BY {day} "
                "ON CONFLICT (bucket, size) DO UPDATE SET "
                "bytes_up = bytes_up + excluded.bytes_up, "
                "bytes_down = bytes_down + excluded.bytes_down",
                (cutoff,),
            )
            for table in _TABLES:
                db.execute(f"DELETE FROM {table} WHERE size < ? AND bucket < ?", (DAY, cutoff))
        return int(folded)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._write_lock, _decoded_errors():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- queries (what was flushed) -------------------------------------------------

    @contextmanager
    def _reading(self, since: float | None = None) -> Iterator[tuple[sqlite3.Connection, Totals]]:
        """``_snapshot``, its errors and its queries' ``sqlite3.Error``s (see
        ``MalformedStats``): a reader opened on a file damaged since the start."""
        with _decoded_errors(), self._snapshot(since) as reading:
            yield reading

    @contextmanager
    def _snapshot(self, since: float | None = None) -> Iterator[tuple[sqlite3.Connection, Totals]]:
        """A connection to query, in a read transaction (one snapshot of the file),
        that no write or other query uses meanwhile (an idle one of the readers, or a
        new one), and ``pending(since)`` as it was at that snapshot (empty for
        ``since=None``): their sum counts each count once.

        A flush that commits between reading ``pending`` and taking the snapshot moves
        counts from one into the other (counted twice, or lost the other way round). So
        the snapshot is taken first with a cheap read, ``pending`` and the flush count
        read before it and the count again after it, and the pair kept only if no flush
        began or ended meanwhile (the count is even and unchanged); otherwise taken
        again, and after a few tries with the writer held off (a flush in a thread
        waits for a few milliseconds). Only this is tried again, never the query: an
        "all time" of 718k rows took 1 s, and a flush every 2 s overlapped most of
        them. An in-memory store's queries use the writer's connection under its lock
        (a second connection to ":memory:" is another, empty, database)."""

        def counted() -> Totals:
            return Totals() if since is None else self._pending(since)

        if self._path is None:
            with self._write_lock:
                if self._path is None:
                    with self._lock:
                        extra = counted()
                    yield self._db, extra
                    return
        path = self._path
        with self._read_lock:
            db = self._readers.pop() if self._readers else None
        if db is None:
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            for _ in range(_PIN_TRIES):
                with self._lock:
                    before = self._flushes
                    extra = counted()
                if before % 2:
                    continue
                db.execute("BEGIN")
                db.execute(_PIN).fetchall()
                with self._lock:
                    if self._flushes == before:
                        break
                db.execute("COMMIT")
            else:
                with self._write_lock:
                    with self._lock:
                        extra = counted()
                    db.execute("BEGIN")
                    db.execute(_PIN).fetchall()
            try:
                yield db, extra
            finally:
                db.execute("COMMIT")
        except BaseException:
            db.close()
            raise
        with self._read_lock:
            if len(self._readers) < IDLE_READERS:
                self._readers.append(db)
                return
        db.close()

    def totals(self, since: float = 0.0) -> Totals:
        """Sums over the buckets that end after ``since`` and begin by now: a bucket
        stamped ahead of now (the clock was ahead, then set right) is counted once its
        time comes, not on each day until then."""
        with self._reading() as (db, _):
            return self._sums(db, since)

    def _sums(self, db: sqlite3.Connection, since: float) -> Totals:
        out = Totals()
        window = (since, since, self._clock())
        rows = db.execute(
            "SELECT expert, SUM(forward), SUM(backward), SUM(samples), SUM(compute_s), "
            f"SUM(bytes_in), SUM(bytes_out) FROM work WHERE {_WINDOW} GROUP BY expert",
            window,
        ).fetchall()
        for expert, *values in rows:
            work = Work(*values)
            out.by_expert[expert] = work
            out.work.add(work)
        for reason, count in db.execute(
            f"SELECT reason, SUM(count) FROM rejected WHERE {_WINDOW} GROUP BY reason",
            window,
        ):
            out.rejected[reason] = int(count)
        running, paused = db.execute(
            "SELECT COALESCE(SUM(running_s), 0), COALESCE(SUM(paused_s), 0) FROM uptime "
            f"WHERE {_WINDOW}",
            window,
        ).fetchone()
        up, down = db.execute(
            "SELECT COALESCE(SUM(bytes_up), 0), COALESCE(SUM(bytes_down), 0) FROM traffic "
            f"WHERE {_WINDOW}",
            window,
        ).fetchone()
        out.running_s, out.paused_s = float(running), float(paused)
        out.traffic = Traffic(int(up), int(down))
        return out

    def pending(self, since: float = 0.0) -> Totals:
        """What was counted but not flushed yet, in buckets ending after ``since``
        (those ahead of now as the current one, where ``flush`` writes them)."""
        with self._lock:
            return self._pending(since)

    def _pending(self, since: float) -> Totals:
        out = Totals()
        latest = self._bucket()
        for counts in (self._flushing, self._counts):
            for (hour, expert), work in counts.work.items():
                if min(hour, latest) + QUARTER > since:
                    out.by_expert.setdefault(expert, Work()).add(work)
                    out.work.add(work)
            for (hour, _, reason), count in counts.rejected.items():
                if min(hour, latest) + QUARTER > since:
                    out.rejected[reason] = out.rejected.get(reason, 0) + count
            for hour, (running, paused) in counts.uptime.items():
                if min(hour, latest) + QUARTER > since:
                    out.running_s += running
                    out.paused_s += paused
            for hour, traffic in counts.traffic.items():
                if min(hour, latest) + QUARTER > since:
                    out.traffic.add(traffic)
        return out

    def current(self, since: float = 0.0) -> Totals:
        """``totals`` plus ``pending``, each count once (see ``_reading``): everything
        counted so far."""
        with self._reading(since) as (db, extra):
            out = self._sums(db, since)
        out.work.add(extra.work)
        for expert, work in extra.by_expert.items():
            out.by_expert.setdefault(expert, Work()).add(work)
        for reason, count in extra.rejected.items():
            out.rejected[reason] = out.rejected.get(reason, 0) + count
        out.running_s += extra.running_s
        out.paused_s += extra.paused_s
        out.traffic.add(extra.traffic)
        return out

    def history(self, since: float = 0.0) -> list[tuple[int, int, Work]]:
        """``(bucket, size, work summed over experts)`` per hour or day that has a
        bucket that ends after ``since`` and begins by now, oldest first: quarter hours
        are summed per hour (the dashboard's chart is hourly)."""
        with self._reading() as (db, _):
            rows = db.execute(
                f"SELECT {_HOURLY} AS b, {_HOURLY_SIZE} AS s, SUM(forward), SUM(backward), "
                "SUM(samples), "
                "SUM(compute_s), SUM(bytes_in), SUM(bytes_out) FROM work "
                f"WHERE {_WINDOW} GROUP BY b, s ORDER BY b",
                (since, since, self._clock()),
            ).fetchall()
        return [(bucket, size, Work(*values)) for bucket, size, *values in rows]

    def traffic_history(self, since: float = 0.0) -> dict[tuple[int, int], Traffic]:
        """``history``'s buckets for the ``traffic`` table: ``(bucket, size)`` to the
        bytes sent and received then (an hour with traffic and no expert call too)."""
        with self._reading() as (db, _):
            rows = db.execute(
                f"SELECT {_HOURLY} AS b, {_HOURLY_SIZE} AS s, SUM(bytes_up), SUM(bytes_down) "
                f"FROM traffic WHERE {_WINDOW} GROUP BY b, s",
                (since, since, self._clock()),
            ).fetchall()
        return {(bucket, size): Traffic(up, down) for bucket, size, up, down in rows}

    def file_rows(self) -> int:
        with self._reading() as (db, _):
            return sum(db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in _TABLES)
