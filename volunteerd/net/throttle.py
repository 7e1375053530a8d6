"""Bandwidth limits and the monthly transfer quota, for every stream of one node.

A ``Throttle`` holds two token buckets, one for what this node sends and one for what
it receives, shared by all peers and all verbs. The RPC server and client wrap every
stream they accept or open in ``ThrottledStream``: a write waits for tokens before it
goes out, in pieces of at most 64 KiB so that one large reply cannot hold the bucket
while small requests wait; a read takes tokens for what it received (delaying the
reader lets the multiplexer's flow-control window push back on the sender). The DHT's
record verbs' streams are ``urgent``: their small writes take turns with the others'
pieces rather than queue behind all of them, within a share of the rate, one party at a
time (``TokenBucket``, ``net.rpc.URGENT_VERBS``).

Rates are in Mbit/s (10^6 bits), 0 meaning unlimited, and change at once:
``set_rates`` wakes every waiter to recompute its wait. Bursts are a tenth of a
second's worth (at least 64 KiB), so a measured transfer keeps to the rate within a
few percent over seconds.

The ``TransferLedger`` counts the bytes of the current calendar month and of the
current day (local time, following a change of the machine's time zone), up and down
together, in a small JSON file in the data folder (``transfer.json``). A node counts
its TCP connections' payload, every byte through their sockets (``Throttle.wire_meter``,
``net/flow.py``), not the Ethernet, IP and TCP headers around it (~35 % of an idle
node's bytes on the wire, its packets being small): the DHT, identify, pings,
multistream, Noise and Yamux framing, relayed circuits and the RPC streams, in the
ledger and in ``bytes_up``/``bytes_down`` (the traffic since start, which the
statistics and rates show). The streams' own bytes then only pace, or they
would count twice; only they counted before, ~12 % of an idle node's wire bytes. A
throttle whose host has no TCP (the in-memory test network) counts its streams' bytes.

The file is saved as soon as ``_SAVE_BYTES`` (or 1 % of a quota set, if less, but at
least ``_MIN_SAVE_BYTES``, 64 KiB) were counted since the last save: the counting path
wakes the saver when it crosses that; otherwise at most every ``_SAVE_AT_MOST_S`` while
anything was counted, and when the node stops. An idle node (DHT upkeep: a few KB a
minute) rewrote it every 5 s, two fsyncs each: 17,280 rewrites a day; now ~1,440 with
one fsync each. Saves are at least ``_SAVE_GAP_S`` (5 s) apart, so a server moving
32 MB/s rewrites it once every 5 s, not 32 times a second. A crash loses at most that
much counting: the threshold, or the last 5 s of heavier traffic, or a minute of a
trickle (and what moved during the one save under way).
There is a monthly and a daily quota, 0 meaning none; the throttle only reports which
one is used up (``exhausted_quota``): pausing is the volunteer controls' job.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import trio

from volunteerd import localtime
from volunteerd.atomic import STATE_MAX_BYTES, read_small, write_atomic
from volunteerd.config import LimitsConfig
from volunteerd.net.limits import address_key
from volunteerd.net.transport import Stream

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = [
    "BYTES_PER_MBIT",
    "URGENT_MAX_BYTES",
    "URGENT_SHARE",
    "Throttle",
    "ThrottleStats",
    "ThrottledStream",
    "TokenBucket",
    "TransferLedger",
]

logger = logging.getLogger(__name__)

BYTES_PER_MBIT = 125_000  # 10^6 bits
_PIECE = 64 * 1024  # the largest single write while a rate applies
_BURST_S = 0.1
_MIN_BURST = 64 * 1024
# How much of the count a crash may lose (it lost up to 30 s of it: 55 MB in an
# outside probe, under replica averaging): a save as soon as this much was counted since
# the last one (or 1 % of a quota, if less, but not under 64 KiB: 1 % of a 1.6 MB quota
# rewrote the file 4 times a minute on DHT upkeep alone, a re-check). The counting path
# wakes the saver when it crosses it (looked at only every 5 s, a kill -9 under 32 MB/s
# lost 5 s of counting: 61 MB)...
_SAVE_BYTES = 1_000_000
_QUOTA_SHARE = 0.01
_MIN_SAVE_BYTES = 64 * 1024
_CHECK_EVERY_S = 5.0
# ... and otherwise at most this often, while anything at all was counted; but never
# sooner than this after the last save: saved at each megabyte, a server moving 32 MB/s
# rewrote the file (an fsync each) 32 times a second.
_SAVE_AT_MOST_S = 60.0
_SAVE_GAP_S = 5.0
_SAVE_FAILED_LOG_S = 600.0
# The urgent class is for small messages (a DHT store, ~2 KB): a larger urgent write
# waits as bulk. Turns are per write, not per byte: a DHT find reply of 24-48 KB each
# urgent turn against a 64 KiB reply piece each bulk one let one stream of a stranger's
# finds take 43 % of a 2 Mbit/s upload and cut forward replies from 3.73 to 2.13 a
# second (a re-check).
URGENT_MAX_BYTES = 8 * 1024
# The urgent-class party of callers with no address of their own (relayed).
_RELAYED = "relayed"
# ... and while bulk waiters wait, urgent bytes take turns only within this share of
# the rate (with a second's worth of it as their burst); bulk ones take the turns left.
URGENT_SHARE = 0.2


class _Turns:
    """A lock whose waiters are served one party at a time, in turn, and in arrival
    order within a party: many waiters of one party (a stranger's 128 streams) hold
    another party's one waiter for one of theirs, not for all of them (in one FIFO an
    honest 2 KB store waited 58.6 s behind a flood of DHT finds)."""

    def __init__(self) -> None:
        self._held = False
        self._waiting: dict[Hashable, deque[trio.Event]] = {}
        self._order: deque[Hashable] = deque()  # parties with waiters, next first

    def locked(self) -> bool:
        return self._held

    async def acquire(self, party: Hashable) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._held:
            self._held = True
            await trio.lowlevel.cancel_shielded_checkpoint()  # as trio.Lock does
            return
        turn = trio.Event()
        queue = self._waiting.get(party)
        if queue is None:
            queue = self._waiting[party] = deque()
            self._order.append(party)
        queue.append(turn)
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():  # handed the lock as it was cancelled: hand it on
                self.release()
            else:
                queue.remove(turn)
                if not queue:
                    del self._waiting[party]
                    self._order.remove(party)
            raise

    def release(self) -> None:
        """Hand the lock to the next party's first waiter, or free it."""
        if not self._order:
            self._held = False
            return
        party = self._order.popleft()
        queue = self._waiting[party]
        turn = queue.popleft()
        if queue:
            self._order.append(party)
        else:
            del self._waiting[party]
        turn.set()  # held still: now the waiter's


class TokenBucket:
    """A token bucket of ``rate`` bytes per second (0 = unlimited), refilled by trio's
    clock. Waiters are served in arrival order within their class; a request larger than
    the burst drives the bucket into debt, which the next ones wait out, so the long-run
    rate holds exactly whatever the piece sizes.

    Two classes of waiters: bulk, and ``urgent`` (the DHT's small record messages, what
    keeps a node findable; a request over ``URGENT_MAX_BYTES`` waits as bulk). While
    both wait, they take turns, one request each, as long as the urgent bytes keep
    within ``URGENT_SHARE`` of the rate (a credit refilled at that share, a second's
    worth at most); past it, bulk takes the turns until the credit is back. An urgent
    request waits for about one bulk piece, not for every piece queued ahead of it. In
    one queue, a ~2 KB DHT store waited behind every reply piece going out (2 Mbit/s up,
    32 expert calls in flight: 4 of 11 stores past the DHT's 5 s, their peers forgotten,
    and the node said its announcements reached no other peer). Urgent waiters are
    served one ``party`` (a peer's address) at a time, in turn (``_Turns``)."""

    def __init__(self, rate: float = 0.0) -> None:
        self.rate = 0.0
        self.burst = float(_MIN_BURST)
        self._tokens = 0.0
        self._stamp: float | None = None
        self._lock = trio.Lock()  # fair: FIFO among bulk waiters
        self._urgent_lock = _Turns()  # ... and party by party among urgent ones
        self._urgent_turn = False  # whose turn it is while both classes wait
        self._urgent_credit = 0.0  # urgent bytes that may still go while bulk waits
        self._urgent_need = 0.0  # the first urgent waiter's request
        self._changed = trio.Event()
        self._configure(rate)

    def _configure(self, rate: float) -> None:
        was_unlimited = self.rate <= 0
        self.rate = max(0.0, float(rate))
        self.burst = max(float(_MIN_BURST), self.rate * _BURST_S)
        self._tokens = self.burst if was_unlimited else min(self._tokens, self.burst)
        self._urgent_cap = max(float(URGENT_MAX_BYTES), self.rate * URGENT_SHARE)
        self._urgent_credit = (
            self._urgent_cap if was_unlimited else min(self._urgent_credit, self._urgent_cap)
        )

    def set_rate(self, rate: float) -> None:
        """Change the rate now; waiters recompute their wait."""
        if self._stamp is not None:
            self._refill()
        self._configure(rate)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _refill(self) -> None:
        now = trio.current_time()
        if self._stamp is not None and self.rate > 0:
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._urgent_credit = min(
                self._urgent_cap,
                self._urgent_credit + (now - self._stamp) * self.rate * URGENT_SHARE,
            )
        self._stamp = now

    async def consume(self, n: int, *, urgent: bool = False, party: Hashable = None) -> None:
        """Wait until ``n`` bytes may pass (``urgent``: in the urgent class, if ``n`` is
        at most ``URGENT_MAX_BYTES``; ``party``: whose they are, for the urgent class's
        turns). Cancellation takes nothing from the bucket."""
        if self.rate <= 0:
            return
        if not urgent or n > URGENT_MAX_BYTES:
            async with self._lock:
                try:
                    await self._take(n, False)
                except BaseException:
                    self._gave_up(False)
                    raise
            return
        await self._urgent_lock.acquire(party)
        try:
            self._urgent_need = float(n)
            await self._take(n, True)
        except BaseException:
            self._gave_up(True)
            raise
        finally:
            self._urgent_lock.release()

    def _gave_up(self, urgent: bool) -> None:
        # cancelled: the other class's first waiter need not wait for this one
        self._urgent_turn = not urgent
        self._wake()

    def _urgent_may_go(self) -> bool:
        """The first urgent waiter's request is within the urgent class's share."""
        return self._urgent_credit + 1.0 >= self._urgent_need

    async def _take(self, n: int, urgent: bool) -> None:
        while self.rate > 0:
            self._refill()
            need = min(float(n), self.burst)
            # the other class's first waiter holds its lock: take turns with it, the
            # urgent class within its share
            theirs = (self._lock if urgent else self._urgent_lock).locked()
            if urgent:
                my_turn = not theirs or (self._urgent_turn and self._urgent_may_go())
            else:
                my_turn = not theirs or not self._urgent_turn or not self._urgent_may_go()
            if my_turn and self._tokens + 1.0 >= need:  # a byte's slack: float rounding
                self._tokens -= n
                if urgent and theirs:
                    self._urgent_credit -= n
                self._urgent_turn = not urgent
                self._wake()  # the other class's waiter: its turn now
                return
            changed = self._changed
            # not its turn: until the other takes its piece, or the urgent class's
            # credit is back (a hang guard beside)
            if my_turn:
                wait = (need - self._tokens) / self.rate
            elif urgent and self._urgent_turn:
                wait = (n - self._urgent_credit) / (self.rate * URGENT_SHARE)
            else:
                wait = self.burst / self.rate
            with trio.move_on_after(max(wait, 0.0)):
                await changed.wait()


def _month(now: float) -> str:
    return localtime.strftime("%Y-%m", now)


def _day(now: float) -> str:
    return localtime.strftime("%Y-%m-%d", now)


# Every read and write counts here: the date and the zone are read again (strftime and
# localtime cost microseconds) only this long after the last time, or at the day's end.
_RECHECK_S = 5.0
_DAY_S = 86400.0
# A clock set back by less than this is a correction within the day or month counted:
# they are not started again. Further back, the clock was wrong before (a year ahead),
# and counting starts afresh rather than wait for the wrong date.
_SET_BACK_S = 2 * 86400.0


class TransferLedger:
    """Bytes sent and received in the current calendar month, and today, kept in
    ``path`` (no file: counted in memory only). A new month, or day, starts from zero.

    The day counted ends at ``day_end`` (``time.time()`` seconds): the next local
    midnight when it began. A change of the machine's time zone (or a clock jump
    across summer time) ends it no later than the new zone's next midnight, and at
    once where the new zone's date is already a later one: flying west from Berlin at
    Tuesday 03:00 the day counted until Wednesday 00:00 New York time, 30-49 h. A
    clock set back across midnight keeps the later day and month (the quotas could be
    passed by setting the clock back an hour and forward again)."""

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        now = clock()
        self.month = _month(now)
        self.day = _day(now)
        self.day_end = localtime.next_day_start(now)
        self.bytes_up = 0
        self.bytes_down = 0
        self.day_bytes = 0  # up + down today
        # Days begun since this ledger was made: what tells a new day from the old one
        # where its date is the same (a day ended early by flying west).
        self.days_begun = 0
        self._dirty = False
        self.counted = 0  # bytes added since this ledger was made, never reset
        self._saved = 0  # ``counted`` when last saved
        self._offset = localtime.utc_offset_s(now)  # when the date was last read
        self._latest = now  # the clock's latest reading
        self._checked = (now, min(self.day_end, now + _RECHECK_S))
        if path is not None:
            self._load(path, now)

    def _load(self, path: Path, now: float) -> None:
        try:
            data: Any = json.loads(read_small(path, STATE_MAX_BYTES))
            month, up, down = data["month"], int(data["bytes_up"]), int(data["bytes_down"])
            # files written before the daily count have no day: today counts from zero
            day, day_bytes = data.get("day"), int(data.get("day_bytes", 0))
            # nor before the day's end was kept: the day is the date's
            day_end = None if data.get("day_end") is None else float(data["day_end"])
            offset = None if data.get("utc_offset_s") is None else int(data["utc_offset_s"])
            if day_end is not None and not math.isfinite(day_end):
                raise ValueError(f"day_end is {day_end}")
        except FileNotFoundError:
            return
        except OSError as exc:  # a folder, a FIFO, a link to nothing: nothing to keep
            logger.warning("%s is unreadable (%s); counting this month from zero", path, exc)
            return
        except (
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            ArithmeticError,
            RecursionError,
        ) as exc:
            # kept for a look (the next save would write over it), as the stats file is
            aside = path.with_name(f"{path.name}.damaged")
            try:
                path.replace(aside)
            except OSError:
                aside = path
            logger.warning(
                "%s is unreadable (%s); counting this month from zero (the file: %s)",
                path,
                exc,
                aside,
            )
            return
        if day_end is None:
            keep_day = day == self.day
        else:  # as a running ledger would have gone on (``_roll``)
            keep_day = (
                isinstance(day, str)
                and now < day_end <= now + _SET_BACK_S + _DAY_S
                and not self.day > day
            )
        if month == self.month or (keep_day and isinstance(month, str) and month > self.month):
            self.month, self.bytes_up, self.bytes_down = month, max(0, up), max(0, down)
        if keep_day:
            self.day, self.day_bytes = day, max(0, day_bytes)
            if day_end is not None:
                self.day_end = day_end
                if offset is not None and offset != self._offset:
                    self.day_end = min(day_end, localtime.next_day_start(now))
            self._checked = (now, min(self.day_end, now + _RECHECK_S))

    def _roll(self) -> None:
        now = self._clock()
        since, until = self._checked
        if since <= now < until:
            return
        offset = localtime.utc_offset_s(now)
        month, day = _month(now), _day(now)
        if self._latest - now >= _SET_BACK_S:  # the dates counted were wrong
            self._latest = now
            self._new_day(now, day)
            if month != self.month:
                self._new_month(month)
        else:
            went_back = now < self._latest
            self._latest = max(self._latest, now)
            if now >= self.day_end or day > self.day:
                self._new_day(now, day)
            elif offset != self._offset and not went_back:
                # the zone changed (or the clock ran into summer time): the day counted
                # ends by the new zone's next midnight
                self.day_end = min(self.day_end, localtime.next_day_start(now))
            if month > self.month:
                self._new_month(month)
        self._offset = offset
        self._checked = (now, min(self.day_end, now + _RECHECK_S))

    def _new_day(self, now: float, day: str) -> None:
        self.day, self.day_bytes, self.day_end = day, 0, localtime.next_day_start(now)
        self.days_begun += 1
        self._dirty = True

    def _new_month(self, month: str) -> None:
        logger.info("a new month (%s): the transfer count starts from zero", month)
        self.month, self.bytes_up, self.bytes_down = month, 0, 0
        self._dirty = True

    def add(self, up: int = 0, down: int = 0) -> None:
        """Count bytes sent and received. Runs for every TCP read and write (the
        date is read again only every few seconds, ``_roll``)."""
        self._roll()
        self.bytes_up += up
        self.bytes_down += down
        self.day_bytes += up + down
        self.counted += up + down
        self._dirty = True

    @property
    def unsaved(self) -> int:
        """Bytes counted since the file was last saved (or the ledger made)."""
        return self.counted - self._saved

    @property
    def dirty(self) -> bool:
        """Whether anything changed since the last save (bytes, a new day or month)."""
        return self._dirty

    @property
    def total(self) -> int:
        """Bytes up and down this month."""
        self._roll()
        return self.bytes_up + self.bytes_down

    @property
    def today(self) -> int:
        """Bytes up and down today (since local midnight)."""
        self._roll()
        return self.day_bytes

    def seconds_left_today(self) -> float:
        """Seconds until the day counted ends (``day_end``), when the daily count starts
        from zero; 0 when it is already past. After a clock set back across midnight the
        later day still counts (``_roll``): this is its end."""
        self._roll()
        return max(0.0, self.day_end - self._clock())

    def seconds_left_this_month(self) -> float:
        """Seconds until the month counted ends (local midnight of the next month's
        first day), when the monthly count starts from zero; 0 when already past."""
        self._roll()
        year, month = (int(part) for part in self.month.split("-"))
        end = time.mktime((year, month + 1, 1, 0, 0, 0, 0, 0, -1))
        return max(0.0, end - self._clock())

    def save(self, *, durable: bool = True) -> None:
        """Write the file atomically (temp file, fsync, rename) if anything changed. May
        run in a worker thread while ``add`` goes on: what it adds meanwhile is saved
        the next time. ``durable=False`` leaves out the folder's fsync: the file is
        still the old content or the new one, never a mix, but after a power cut the
        rename itself may be lost, the previous save's count read back (``write_atomic``)."""
        if self.path is None or not self._dirty:
            return
        self._dirty = False
        counted = self.counted
        data = {
            "month": self.month,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "day": self.day,
            "day_bytes": self.day_bytes,
            # the day counted ends then, and the zone's offset it was read in: a restart
            # after a change of zone goes on as the running ledger would (older
            # releases ignore both)
            "day_end": self.day_end,
            "utc_offset_s": self._offset,
        }
        try:
            write_atomic(self.path, json.dumps(data) + "\n", sync_folder=durable)
        except BaseException:
            self._dirty = True
            raise
        self._saved = counted


@dataclass(frozen=True, slots=True)
class ThrottleStats:
    upload_mbit: float
    download_mbit: float
    bytes_up: int  # since the node started
    bytes_down: int
    month: str
    month_bytes: int  # up + down this month
    quota_bytes: int  # 0 = no quota
    quota_exhausted: bool  # the monthly or the daily quota
    day_bytes: int = 0  # up + down today
    daily_quota_bytes: int = 0  # 0 = no quota


class Throttle:
    """The node's bandwidth limits and transfer accounting (one per node).

    ``ledger`` defaults to counting in memory only. Start ``serve`` to save the ledger
    periodically (``open_node`` does)."""

    def __init__(self, limits: LimitsConfig, ledger: TransferLedger | None = None) -> None:
        self.up = TokenBucket()
        self.down = TokenBucket()
        self.ledger = ledger or TransferLedger(None)
        self.bytes_up = 0
        self.bytes_down = 0
        self._counts_streams = True  # until a host counts the wire (``wire_meter``)
        self.quota_bytes = 0  # a month
        self.daily_quota_bytes = 0
        self._save_after = _SAVE_BYTES  # ``save_after_bytes``, for the counting path
        # set by the counting path once ``_save_after`` bytes are unsaved (``serve``)
        self._save_due: trio.Event | None = None
        # the last failure to save logged: (its errno, when, on the monotonic clock)
        self._save_failed: tuple[int | None, float] | None = None
        self.apply(limits)

    def apply(self, limits: LimitsConfig) -> None:
        """Take the rates and the quotas of ``limits``, effective at once."""
        self.set_rates(limits.upload_mbit, limits.download_mbit)
        self.quota_bytes = round(limits.monthly_quota_gb * 1e9)
        self.daily_quota_bytes = round(limits.daily_quota_gb * 1e9)
        self._save_after = self.save_after_bytes()

    def set_rates(self, up_mbit: float, down_mbit: float) -> None:
        """Upload and download limits in Mbit/s (0 = unlimited), effective at once."""
        self.up.set_rate(up_mbit * BYTES_PER_MBIT)
        self.down.set_rate(down_mbit * BYTES_PER_MBIT)

    @property
    def exhausted_quota(self) -> Literal["monthly", "daily"] | None:
        """Which quota is used up (the month's first), or None."""
        if self.quota_bytes > 0 and self.ledger.total >= self.quota_bytes:
            return "monthly"
        if self.daily_quota_bytes > 0 and self.ledger.today >= self.daily_quota_bytes:
            return "daily"
        return None

    @property
    def quota_exhausted(self) -> bool:
        return self.exhausted_quota is not None

    def wrap(self, stream: Stream, *, urgent: bool = False) -> Stream:
        """``stream`` paced; ``urgent``: its bytes take turns with bulk ones rather than
        queue behind them (``TokenBucket``)."""
        return ThrottledStream(stream, self, urgent=urgent)

    def wire_meter(self) -> Throttle:
        """This throttle, for a host to count its TCP connections' payload into (every
        byte through their sockets, not the TCP/IP headers: ``add``, ``net/host.py``).
        From then on the streams' bytes only pace: they are among the wire's already."""
        self._counts_streams = False
        return self

    def add(self, up: int = 0, down: int = 0) -> None:
        """Count bytes sent and received: since start and in the ledger. Wakes the
        saver (``serve``) once ``save_after_bytes`` are unsaved: one comparison a call."""
        self.bytes_up += up
        self.bytes_down += down
        ledger = self.ledger
        ledger.add(up, down)
        due = self._save_due
        if due is not None and ledger.unsaved >= self._save_after:
            due.set()
            self._save_due = None  # the saver makes a new one

    async def sent(self, n: int, *, urgent: bool = False, party: Hashable = None) -> None:
        if self._counts_streams:
            self.add(up=n)
        await self.up.consume(n, urgent=urgent, party=party)

    async def received(self, n: int, *, urgent: bool = False, party: Hashable = None) -> None:
        if self._counts_streams:
            self.add(down=n)
        await self.down.consume(n, urgent=urgent, party=party)

    def statistics(self) -> ThrottleStats:
        return ThrottleStats(
            upload_mbit=self.up.rate / BYTES_PER_MBIT,
            download_mbit=self.down.rate / BYTES_PER_MBIT,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            month=self.ledger.month,
            month_bytes=self.ledger.total,
            quota_bytes=self.quota_bytes,
            quota_exhausted=self.quota_exhausted,
            day_bytes=self.ledger.today,
            daily_quota_bytes=self.daily_quota_bytes,
        )

    def save_after_bytes(self) -> int:
        """How many counted bytes call for a save now: ``_SAVE_BYTES``, or 1 % of the
        smaller quota set if that is less (what a crash may let a volunteer pass a
        quota by), but at least ``_MIN_SAVE_BYTES``."""
        quotas = [q for q in (self.quota_bytes, self.daily_quota_bytes) if q > 0]
        shares = (max(_MIN_SAVE_BYTES, int(q * _QUOTA_SHARE)) for q in quotas)
        return min([_SAVE_BYTES, *shares])

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Save the ledger as soon as ``save_after_bytes`` were counted since the last
        save (the counting path wakes it, ``add``; what is counted while a save runs is
        saved right after it) but not within ``_SAVE_GAP_S`` of it, or
        ``_SAVE_AT_MOST_S`` after it when anything changed at all (looked at every
        ``_CHECK_EVERY_S``), and once more on the way out."""
        task_status.started()
        ledger = self.ledger
        if ledger.path is None:
            await trio.sleep_forever()  # counted in memory only: nothing to save
        saved_at = trio.current_time()
        try:
            while True:
                self._save_after = self.save_after_bytes()
                if ledger.unsaved < self._save_after:
                    due = self._save_due = trio.Event()
                    with trio.move_on_after(_CHECK_EVERY_S):
                        await due.wait()
                if not ledger.dirty:
                    continue
                now = trio.current_time()
                if ledger.unsaved < self._save_after and now - saved_at < _SAVE_AT_MOST_S:
                    continue
                if now - saved_at < _SAVE_GAP_S:
                    await trio.sleep(saved_at + _SAVE_GAP_S - now)
                saved_at = trio.current_time()
                # an fsync: off the event loop; a counter's rewrite need not fsync the
                # folder (``TransferLedger.save``)
                if not await trio.to_thread.run_sync(self._save, False):
                    await trio.sleep(_CHECK_EVERY_S)  # a failing disk: not in a loop
        finally:
            self._save()

    def _save(self, durable: bool = True) -> bool:
        """Save the ledger; False when that failed. A failure is logged when it is new
        (another error than the last) and then once every ``_SAVE_FAILED_LOG_S``: a disk
        that stays full logged a warning every 5 s, ~17,000 lines a day (a re-check)."""
        try:
            self.ledger.save(durable=durable)
        except OSError as exc:
            now = time.monotonic()
            last = self._save_failed
            if last is None or last[0] != exc.errno or now - last[1] >= _SAVE_FAILED_LOG_S:
                self._save_failed = (exc.errno, now)
                logger.warning("cannot save the transfer count: %s", exc)
            return False
        if self._save_failed is not None:
            self._save_failed = None
            logger.info("the transfer count is saved again")
        return True


class ThrottledStream:
    """``stream`` with its reads and writes paced by ``throttle`` (``urgent``: in the
    buckets' urgent class)."""

    def __init__(self, stream: Stream, throttle: Throttle, *, urgent: bool = False) -> None:
        self._stream = stream
        self._throttle = throttle
        self._urgent = urgent
        # whose bytes, for the urgent class's turns: the peer's address as the
        # per-address limits key it (one host's many identities are one party, an IPv6
        # /64 one host), and every caller with none (over a relay: a free identity
        # each) one party together: 128 identities behind a relay, a party each, held
        # another peer's store 38 s (a re-check)
        self._party: Hashable = None
        if urgent:
            self._party = address_key(stream.remote_host, loopback=True) or _RELAYED

    @property
    def remote_peer_id(self) -> str:
        return self._stream.remote_peer_id

    @property
    def remote_host(self) -> str | None:
        return self._stream.remote_host

    async def read(self, n: int) -> bytes:
        data = await self._stream.read(n)
        if data:
            await self._throttle.received(len(data), urgent=self._urgent, party=self._party)
        return data

    async def write(self, data: bytes) -> None:
        if self._throttle.up.rate <= 0 or len(data) <= _PIECE:
            await self._throttle.sent(len(data), urgent=self._urgent, party=self._party)
            await self._stream.write(data)
            return
        view = memoryview(data)
        for start in range(0, len(view), _PIECE):
            piece = view[start : start + _PIECE]
            await self._throttle.sent(len(piece), urgent=self._urgent, party=self._party)
            await self._stream.write(bytes(piece))

    async def clear_to_send(self, n: int) -> Stream:
        """Wait until ``n`` bytes (at most 64 KiB) may go out under the upload limit,
        count them as sent, and return the stream beneath to write them on unpaced. For
        a writer that times its peer (the RPC server's reply pieces): the wait here is
        this node's own queue, and the peer's time starts after it."""
        await self._throttle.sent(n, urgent=self._urgent, party=self._party)
        return self._stream

    async def close(self) -> None:
        await self._stream.close()

    async def reset(self) -> None:
        await self._stream.reset()
