"""Counting what this machine contributes, as it happens, into the ``StatsStore``.

* Each expert call the daemon answers (forward or backward, alone or in a batch) is
  recorded with its samples and the bytes of its tensors in and out; a refused call
  is recorded with its wire error code as the reason ("paused", "busy", "rejected",
  "bad_shape", ...). The request pipeline (``server.pipeline``) counts each call once:
  through ``counted`` when it reaches the runtime, through ``refused`` when the pause
  gate turns it away; a call the RPC server refuses before any handler (a per-peer
  limit, ``busy``, a frame too large or malformed) comes through ``refused_early``.
* Once a second ``serve`` adds the experts' compute time (worker seconds, from the
  runtime's counters), the uptime (serving, while at least one expert is hosted, or
  paused), the bytes the throttle counted since the last second (all the node's
  traffic, what the transfer quotas count: not only the expert calls' tensors) and a
  sample for the rates;
  every ``flush_s`` it writes the counts to SQLite (in a thread) while expert calls,
  refusals or transfers were counted, and every ``_IDLE_FLUSH_S`` (2 min) while only
  time and the DHT's background traffic were (a crash loses at most that much of
  them; a stop writes everything); every hour it folds old hourly rows into daily ones.
* Per-peer request and refusal counts live in memory only (for the ``peers`` view);
  a peer's first request posts a ``peers`` event, a failed write an ``error`` event.
  The table keeps ``_MAX_PEERS`` peers: a new one beyond them makes room by folding
  the counts of the peer counted longest ago that is not connected now (of the one
  counted longest ago if all are) into the ``other`` row, so the rows still add up to
  every call counted. (New peers were
  counted as ``other`` once 1,000 had been seen, for the rest of the run: a trainer
  that came later never had a row or an event, and the first 1,000 stayed listed.)
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from volunteerd.config import StatsConfig
from volunteerd.control.events import EventSink
from volunteerd.errors import VolunteerdError, wire_code
from volunteerd.net import Throttle, Verb, short
from volunteerd.stats import StatsStore, Totals
from volunteerd.stats.store import NewerStats
from volunteerd.wire import TensorReply, WireTensor

if TYPE_CHECKING:
    from trio_typing import TaskStatus

    # Only for types: a daemon that hosts nothing never imports torch.
    from volunteerd.runtime import ExpertRuntime

__all__ = ["Accountant", "PeerCounts", "RateSample", "Result", "open_stats", "opened_stats"]

Result = tuple[TensorReply, list[bytes]]  # an expert call's reply: header, buffers

logger = logging.getLogger(__name__)

_TICK_S = 1.0
_RATE_WINDOW_S = 10.0
_ROLL_UP_EVERY_S = 3600.0
# With nothing but time and background traffic (the DHT) to write, the counts are
# written this often instead of every ``flush_s``: a crash loses at most this much of
# the uptime and traffic counts. More than this much traffic a second since the last
# write counts as news (a transfer under way): written at the next ``flush_s``.
_IDLE_FLUSH_S = 120.0
_NEWS_BYTES_PER_S = 64 * 1024
_MAX_PEERS = 1000  # peers counted one by one; the ones forgotten share OTHER
OTHER = "other"  # the row of the peers forgotten (no peer id is this)


@dataclass(slots=True)
class PeerCounts:
    requests: int = 0
    refused: int = 0
    last_seen: float = 0.0


@dataclass(frozen=True, slots=True)
class RateSample:
    samples_per_s: float
    requests_per_s: float
    upload_bytes_per_s: float
    download_bytes_per_s: float


# The expert of refusals for uids this daemon does not host (no uid is empty).
NOT_HOSTED = ""
# The verbs whose calls are counted: the expert calls.
EXPERT_VERBS = frozenset({Verb.FORWARD, Verb.BACKWARD, Verb.FORWARD_BATCH, Verb.BACKWARD_BATCH})


def _bytes(buffers: Iterable[bytes | bytearray | memoryview]) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


class Accountant:
    def __init__(
        self,
        store: StatsStore,
        runtime: ExpertRuntime | None,  # None: hosting nothing (no compute time to count)
        throttle: Throttle,
        config: StatsConfig,
        *,
        serving: Callable[[], bool],
        events: EventSink | None = None,
    ) -> None:
        self.store = store
        self._events = events
        self._failing = False  # the last flush failed (its error event is posted)
        self._runtime = runtime
        self._throttle = throttle
        self._config = config
        self._serving = serving
        # by peer id, counted longest ago first; OTHER where peers were forgotten
        self.peers: OrderedDict[str, PeerCounts] = OrderedDict()
        # The peers connected now (``Node.connected_peers``), set once the node is up:
        # a full ``peers`` table forgets one that is not connected first.
        self.connected: Callable[[], Iterable[str]] | None = None
        self.samples = 0  # since the daemon started
        self.last_answered_at: float | None = None  # time.time() of the last call answered
        self.requests = 0
        self.refusals: dict[str, int] = {}  # reason -> count, since the daemon started
        self._compute_seen: dict[str, float] = {}
        self._window: deque[tuple[float, int, int, int, int]] = deque()
        # the throttle's byte counts (since its node started) already in the store
        self._traffic_seen = (0, 0)

    # -- counting --------------------------------------------------------------------

    def _peer(self, peer_id: str) -> PeerCounts:
        counts = self.peers.get(peer_id)
        if counts is None:
            if self._events is not None and peer_id:
                self._events.post("peers", f"{short(peer_id)} sent its first request")
            if len(self.peers) - (OTHER in self.peers) >= _MAX_PEERS:
                self._forget_one()
            counts = self.peers[peer_id] = PeerCounts()
        else:
            self.peers.move_to_end(peer_id)
        counts.last_seen = time.time()
        return counts

    def _forget_one(self) -> None:
        """Fold the peer counted longest ago that is not connected now (the one counted
        longest ago if all are) into the OTHER row."""
        connected = set(self.connected()) if self.connected is not None else set()
        forgotten = None
        for peer in self.peers:
            if peer == OTHER:
                continue
            if forgotten is None:
                forgotten = peer
            if peer not in connected:
                forgotten = peer
                break
        if forgotten is None:
            return
        counts = self.peers.pop(forgotten)
        other = self.peers.setdefault(OTHER, PeerCounts())
        other.requests += counts.requests
        other.refused += counts.refused
        other.last_seen = max(other.last_seen, counts.last_seen)

    async def counted(
        self, kind: str, uid: str, peer_id: str, tensors: list[WireTensor], call: Awaitable[Result]
    ) -> Result:
        """Await ``call``, a ``kind`` ("forward", "backward") call of ``uid``, and count it
        answered or refused (then re-raised)."""
        try:
            header, buffers = await call
        except VolunteerdError as exc:
            self.refused(uid, peer_id, exc)
            raise
        self.served(kind, uid, peer_id, tensors, buffers)
        return header, buffers

    def served(
        self, kind: str, uid: str, peer_id: str, tensors: list[WireTensor], buffers: list[bytes]
    ) -> None:
        """A forward or backward call of ``uid`` answered with ``buffers``."""
        samples = tensors[0].shape[0] if tensors and tensors[0].shape else 0
        self.store.record(
            uid,
            forward=kind == "forward",
            backward=kind == "backward",
            samples=samples,
            bytes_in=_bytes(t.data for t in tensors),
            bytes_out=_bytes(buffers),
        )
        self.samples += samples
        self.requests += 1
        self.last_answered_at = time.time()
        self._peer(peer_id).requests += 1

    def refused(self, uid: str, peer_id: str, exc: BaseException) -> None:
        """A call of ``uid`` refused with ``exc`` (counted by its wire code). A uid this
        daemon does not host is counted as ``NOT_HOSTED``: the store keeps a row per
        hour, expert and reason, and uids cost a peer nothing to make up (batches of
        64 invented ones grew the statistics file by 2.5 MB a second, for good)."""
        reason = wire_code(exc)
        hosted = self._runtime is not None and self._runtime.hosts(uid)
        self.store.reject(uid if hosted else NOT_HOSTED, reason)
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        self._peer(peer_id).refused += 1

    def refused_early(self, verb: Verb, peer_id: str, exc: VolunteerdError) -> None:
        """For ``RpcServer.refused_early``: an expert call refused before the pipeline
        saw it (a per-peer limit, the in-flight budget, a frame too large or malformed),
        counted by its wire code as one refused call of no uid (none was read; a batch
        counts once). Only the totals, not the per-peer table (the ``peers`` view has
        the limits' refusals from the server's own counts), and a flood of them costs a
        counter each, never a write (the store writes its counts every ``flush_s``).
        They were missing from "Refused": a caller refused 8 times for its rate and once
        for a garbage frame left today's refusals empty (an outside audit)."""
        del peer_id  # counted per peer by the server (``RpcStats.refused``)
        if verb not in EXPERT_VERBS:
            return
        reason = wire_code(exc)
        self.store.reject(NOT_HOSTED, reason)
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    # -- the loop --------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick, flush and roll up until cancelled (then flush once more)."""
        await trio.to_thread.run_sync(self._roll_up)
        self._sample()
        task_status.started()
        last = trio.current_time()
        last_flush = last
        last_roll_up = last
        try:
            while True:
                await trio.sleep(_TICK_S)
                now = trio.current_time()
                self._tick(now - last)
                last = now
                self._count_compute()
                self._sample()
                if self._flush_due(now - last_flush):
                    last_flush = now
                    await trio.to_thread.run_sync(self._flush)
                if now - last_roll_up >= _ROLL_UP_EVERY_S:
                    last_roll_up = now
                    await trio.to_thread.run_sync(self._roll_up)
        finally:
            # the time since the last tick counts too (a run shorter than a tick, or the
            # last second of a longer one)
            self._tick(trio.current_time() - last)
            self._count_compute()
            self.count_traffic()

    def _flush_due(self, since: float) -> bool:
        """Whether to write now, ``since`` seconds after the last write: every
        ``flush_s`` while expert calls, refusals or transfers were counted, every
        ``_IDLE_FLUSH_S`` while only time ticked and the DHT's trickle flowed (an idle
        daemon wrote ~11 MB/h to its WAL, four pages every 5 s; an outside audit)."""
        if since < self._config.flush_s:
            return False
        if since >= max(_IDLE_FLUSH_S, self._config.flush_s):
            return True
        return self.store.has_news(round(_NEWS_BYTES_PER_S * since))

    def _tick(self, seconds: float) -> None:
        """Count ``seconds`` as paused while the volunteer is not serving, as serving
        while it is and hosts at least one expert, and not at all while it hosts none:
        a daemon that hosted nothing counted 10 s of "time serving" in its first 10 s
        (an outside audit)."""
        if not self._serving():
            self.store.tick(seconds, paused=True)
        elif self._runtime is not None and self._runtime.uids:
            self.store.tick(seconds, paused=False)

    def _count_compute(self) -> None:
        if self._runtime is None:
            return
        for stats in self._runtime.statistics():
            seen = self._compute_seen.get(stats.uid, 0.0)
            if stats.compute_s > seen:
                self.store.record(stats.uid, compute_s=stats.compute_s - seen)
                self._compute_seen[stats.uid] = stats.compute_s

    def count_traffic(self) -> None:
        """Add to the store the bytes the throttle counted since the last call (each
        ``serve`` tick calls it). A count lower than the last one is a throttle that
        started again (a new node): all of its counts, up and down, are new."""
        stats = self._throttle.statistics()
        self._count_traffic(stats.bytes_up, stats.bytes_down)

    def _count_traffic(self, up: int, down: int) -> None:
        seen_up, seen_down = self._traffic_seen
        if up < seen_up or down < seen_down:
            seen_up = seen_down = 0
        new_up, new_down = up - seen_up, down - seen_down
        self._traffic_seen = (up, down)
        if new_up or new_down:
            self.store.transferred(up=new_up, down=new_down)

    def _flush(self) -> None:
        _move_to_file(self.store)
        try:
            self.store.flush()
        except Exception as exc:  # a full disk must not stop the daemon; counts wait in memory
            _log_failure(exc, "could not write the statistics (%s); retrying at the next flush")
            if not self._failing:  # one event until a write works again, not one a flush
                self._failing = True
                self._post_error(f"could not write the statistics ({exc}); retrying")
        else:
            self._failing = False

    def _roll_up(self) -> None:
        try:
            folded = self.store.roll_up()
        except Exception as exc:
            _log_failure(exc, "could not roll up old statistics (%s)")
            self._post_error(f"could not roll up old statistics ({exc})")
            return
        if folded:
            logger.info("statistics: folded %d hourly rows into daily rows", folded)

    async def counted_since(self, since: float) -> Totals:
        """``store.current(since)``, read in a thread: the event loop never waits for a
        query (``/status`` read "today" on it, 1.9 s a call on a file of 718k rows, an
        outside audit). If the file cannot be read (a disk error), only what is counted
        and not written yet, with one line logged: the control API's status must keep
        answering (the statistics failing made every ``/status`` a 500, so ``volunteerd
        status``, the dashboard and the tray saw nothing)."""
        return await trio.to_thread.run_sync(self._counted_since, since)

    def _counted_since(self, since: float) -> Totals:
        try:
            return self.store.current(since)
        except sqlite3.Error as exc:
            logger.error(
                "could not read the statistics (%s); showing only the counts not written yet",
                exc,
            )
            return self.store.pending(since)

    def _sample(self) -> None:
        throttle = self._throttle.statistics()
        self._count_traffic(throttle.bytes_up, throttle.bytes_down)
        now = time.monotonic()
        self._window.append(
            (now, self.samples, self.requests, throttle.bytes_up, throttle.bytes_down)
        )
        while len(self._window) > 2 and now - self._window[0][0] > _RATE_WINDOW_S:
            self._window.popleft()

    def rates(self) -> RateSample:
        """Per second over the last ~10 s."""
        if len(self._window) < 2:
            return RateSample(0.0, 0.0, 0.0, 0.0)
        (t0, s0, r0, u0, d0), (t1, s1, r1, u1, d1) = self._window[0], self._window[-1]
        dt = max(t1 - t0, 1e-9)
        return RateSample((s1 - s0) / dt, (r1 - r0) / dt, (u1 - u0) / dt, (d1 - d0) / dt)

    def _post_error(self, message: str) -> None:
        """Post from a worker thread (flushes run in one)."""
        if self._events is not None:
            trio.from_thread.run_sync(self._events.post, "error", message)


def open_stats(path: Path, keep_hourly_days: int) -> StatsStore:
    """The contribution store at ``path``. A damaged file is moved aside, never
    deleted, and counting starts afresh; one that cannot be opened for the moment (a
    full disk) or that a newer volunteerd wrote is left alone and this run counts in
    memory: statistics must not stop a volunteer from contributing. The first is tried
    again at each flush (``waiting_for``), and what was counted meanwhile moves there.
    (A newer version's file was moved aside as damaged: back on that version, its
    totals were gone.)"""
    try:
        return StatsStore.open(path, keep_hourly_days=keep_hourly_days)
    except NewerStats as exc:
        logger.error(
            "%s: it is kept as it is, and this run's statistics are kept in memory only "
            "(upgrade volunteerd to count there again)",
            exc,
        )
        return StatsStore.open(Path(":memory:"), keep_hourly_days=keep_hourly_days)
    except (sqlite3.DatabaseError, RuntimeError, OSError) as exc:
        if not _damaged(path, exc):  # a full disk, a read-only folder: the file is kept
            logger.error(
                "%s cannot be opened (%s%s): it is kept as it is, and this run's "
                "statistics are kept in memory until it can be",
                path,
                exc,
                _disk_full(path),
            )
            return _standing_in(path, keep_hourly_days)
        aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
        for suffix in ("", "-wal", "-shm"):
            part = path.with_name(path.name + suffix)
            if part.is_symlink() or part.exists():  # a link to nothing, or to itself, too
                try:
                    part.replace(aside.with_name(aside.name + suffix))
                except OSError as why:
                    logger.error("%s could not be moved aside: %s", part, why)
        logger.error("%s is unreadable (%s); moved to %s, counting afresh", path, exc, aside)
    try:
        return StatsStore.open(path, keep_hourly_days=keep_hourly_days)
    except (sqlite3.DatabaseError, RuntimeError, OSError) as exc:
        logger.error(
            "%s cannot be made either (%s%s): this run's statistics are kept in memory "
            "until it can be",
            path,
            exc,
            _disk_full(path),
        )
        return _standing_in(path, keep_hourly_days)


def _standing_in(path: Path, keep_hourly_days: int) -> StatsStore:
    """An in-memory store for ``path``, which ``Accountant`` tries again at each flush."""
    store = StatsStore.open(Path(":memory:"), keep_hourly_days=keep_hourly_days)
    store.waiting_for = path
    return store


def _disk_full(path: Path) -> str:
    """ "; the disk is full" when the folder's file system has (next to) no room left:
    SQLite says "disk I/O error" for it."""
    try:
        free = shutil.disk_usage(next(p for p in path.parents if p.is_dir())).free
    except (OSError, StopIteration):
        return ""
    return "; the disk is full" if free < 1 << 20 else ""


def _move_to_file(store: StatsStore) -> bool:
    """Try the file ``store`` stands in for again; True once it is the file's."""
    path = store.waiting_for
    if path is None:
        return True
    try:
        store.move_to_file(path)
    except (sqlite3.Error, RuntimeError, OSError) as exc:
        logger.debug("%s still cannot be opened: %s", path, exc)
        return False
    logger.info(
        "%s could be opened at last: this run's statistics are written there from now on",
        path,
    )
    return True


def _log_failure(exc: Exception, message: str) -> None:
    """Log a failed write or read of the statistics file as one line (``message`` with
    ``exc``), like every other failed write of the daemon: a full disk logged a 13-line
    traceback at every flush. Any other error is a bug of ours and keeps its traceback.
    ``message`` is fixed, ``exc`` an argument, so ``logs._OwnRepeats`` counts them as
    one kind."""
    if isinstance(exc, sqlite3.Error | OSError):
        logger.error(message, exc)
    else:
        logger.exception(message, exc)


# SQLite's primary result codes for a file that is not (or no longer) a database.
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


def _damaged(path: Path, exc: BaseException) -> bool:
    """Whether opening ``path`` failed for the file itself (not a database, damaged,
    from a newer version, a link to nothing), not for the moment (a full disk, a
    read-only or missing folder, a lock): only a damaged file is moved aside."""
    if isinstance(exc, RuntimeError):  # empty, a newer schema, tables with other columns
        return True
    if path.is_symlink() and not path.is_file():
        return True
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)


@asynccontextmanager
async def opened_stats(path: Path, keep_hourly_days: int) -> AsyncIterator[StatsStore]:
    """``open_stats`` in a thread; closed (in a thread, shielded) on the way out."""
    store = await trio.to_thread.run_sync(open_stats, path, keep_hourly_days)
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            if not await trio.to_thread.run_sync(_move_to_file, store):
                logger.error(
                    "%s could not be opened during this run: its statistics were kept in "
                    "memory only, and are not saved",
                    store.waiting_for,
                )
            try:
                await trio.to_thread.run_sync(store.close)
            except (sqlite3.Error, OSError) as exc:  # a full disk: the daemon still stops well
                logger.error("the last statistics could not be written: %s", exc)
