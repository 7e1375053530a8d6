"""How bytes move through py-libp2p 0.8.1's TCP and Yamux: two patches of its flow.

Both are applied when this module is imported (``net/host.py`` imports it), like the
other patches of the library in ``net/host.py``; ``tests/unit/test_flow.py`` checks them
against the library's real Yamux.

*A writer out of send window is woken by the window update.* The library's
``YamuxStream.write`` polled for credit every 10 ms: a stream that ran out of window
(256 KiB at first) slept in 10 ms steps however soon the peer's update came. A 2 MiB
reply on loopback took 21 ms while the connection's measured round trip let the window
grow, and 45 ms when it did not (after smaller calls on the same connection). Here the
writer waits on an event that is set when the stream's send window grows or the stream
or its connection closes. Everything else is as the library's: a frame at a time within
the window, the same locks, and the same error without credit, after
``ZERO_WINDOW_TIMEOUT_S`` (120 s; the library's 5 s reset readers slower than ~52 KiB/s).

*TCP reads ahead.* Noise reads each message as a 2-byte length and then the message, so
every 64 KiB frame took two or more ``recv`` calls, each a trio checkpoint. A connection
now receives up to ``READ_AHEAD`` bytes at once and serves the following reads from
them. Those bytes would otherwise wait in the kernel's socket buffer; a reader that
stops (a peer's small frames being paced) keeps what it holds, so what all connections
hold together is bounded too: over ``READ_AHEAD_BUDGET`` a read takes only what it asks
for, as the library's did.

The rest bounds what a peer can make this node hold or wait for (docs/security.md):

*Data past the receive window is a protocol violation.* The library buffered whatever
a peer sent on a stream, logging "peer exceeded receive window": a server that answered
a call and then streamed on the pooled stream grew a trainer's memory at line rate.
Now the stream is reset, what it held is dropped, and the connection is closed
(``counts()["window_overruns"]``).

*A TCP write that cannot progress closes the connection.* A peer that stops reading
its socket (frozen, or hostile after granting a large window) held every writer of the
connection, and so every shielded cleanup that writes (a stream's RST or FIN, the
connection's GO_AWAY), forever. A write that moves no byte for ``WRITE_STALL_S`` closes
the socket, so blocked writers and the reader fail at once; a watchdog task per trio
run looks at pending writes every ``WATCH_PERIOD_S`` (cheaper than a deadline per
write), and a process that was not running (stopped, its loop blocked) restarts the
count rather than blame its peers. A write cancelled half-way
(its bytes are a Noise message the peer expects whole) is finished, shielded, for at
most ``CANCELLED_WRITE_GRACE_S``, or the connection is closed: it is never left out of
step.

*Every byte of a TCP connection's payload is metered.* A host built with a meter
(``net/host.py``: the node's transfer ledger) tags each raw connection before its
security handshake (``meter``); the reads and writes here add what crossed the socket
to it, one int add each: multistream negotiation, Noise, Yamux framing, Kademlia,
identify, ping, relayed circuits, every RPC. The monthly and daily quotas count these
bytes (the RPC streams alone were ~12 % of an idle node's wire bytes). The Ethernet, IP
and TCP headers are not the socket's bytes and are not counted (~35 % of an idle
node's bytes on the wire, its packets being small).

*Pings are answered off the reader.* The reader wrote each ping's answer itself, so a
peer sending pings into a socket it never read blocked it for good. An answer is now
written by a task of its own, one at a time; pings that come while one is pending go
unanswered, as go-yamux does.

*A stream's reset and close take at most ``STREAM_CLEANUP_S``.* The library (and
py-libp2p's ``new_stream`` cleanup) awaits them in shielded scopes; past the bound the
stream is given up locally without its RST or FIN.
"""

from __future__ import annotations

import errno
import functools
import logging
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import trio
from libp2p.io import trio as _io
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.stream_muxer.yamux import yamux as _yamux

__all__ = [
    "CANCELLED_WRITE_GRACE_S",
    "FROZEN_S",
    "READ_AHEAD",
    "READ_AHEAD_BUDGET",
    "STREAM_CLEANUP_S",
    "WATCH_PERIOD_S",
    "WRITE_STALL_S",
    "ZERO_WINDOW_TIMEOUT_S",
    "WireMeter",
    "abort",
    "counts",
    "held_ahead",
    "meter",
]

logger = logging.getLogger(__name__)

READ_AHEAD = 128 * 1024  # per connection
READ_AHEAD_BUDGET = 16 * 1024 * 1024  # all connections together
# A writer out of send window gives up after this long without credit. The library's
# was 5 s, and a receiver returns credit once half its window is read (256 KiB once
# grown): every reader slower than ~52 KiB/s, and any reader that stalled 5 s, was reset
# mid-reply (at ~640 KiB), below the 256 kbit/s a bulk reply is promised (a re-check: a
# volunteer downloading at 0.3-0.45 Mbit/s never averaged a 2.1 MB expert). Writers
# bound their own waits, tighter: the RPC each piece of a reply (``frame_read_s``, 30 s)
# and the reader's pace, a request with the call; lookups, relayed circuits and hole
# punching their exchanges. This is the backstop for a write that sets no bound.
ZERO_WINDOW_TIMEOUT_S = 120.0
# A TCP write that moves no byte for this long: the peer stopped reading its socket.
WRITE_STALL_S = 20.0
# A write cancelled half-way may finish, shielded, for this long (its bytes are a Noise
# message the peer expects whole); after that the connection is closed.
CANCELLED_WRITE_GRACE_S = 1.0
# The most a stream's reset or close waits to write its RST or FIN.
STREAM_CLEANUP_S = 1.0


class _Waking:
    """A YamuxStream attribute whose change in one direction sets the event the
    stream's writer waits on (``_vd_credit``): ``send_window`` growing, ``closed`` or
    ``send_closed`` (the connection going away) becoming true. Every write of the
    attribute, the library's included, passes here."""

    def __init__(self, name: str, wakes: Callable[[Any, Any], bool]) -> None:
        self._name, self._key, self._wakes = name, f"_vd_{name}", wakes

    def __get__(self, stream: Any, owner: type | None = None) -> Any:
        if stream is None:
            return self
        try:
            return stream.__dict__[self._key]
        except KeyError:
            raise AttributeError(self._name) from None

    def __set__(self, stream: Any, value: Any) -> None:
        state = stream.__dict__
        before = state.get(self._key)
        state[self._key] = value
        if before is not None and self._wakes(before, value):
            credit: trio.Event | None = state.get("_vd_credit")
            if credit is not None:
                credit.set()


async def _write(self: _yamux.YamuxStream, data: bytes) -> None:
    """The library's ``YamuxStream.write``, waiting for credit on an event."""
    if self.send_closed:
        raise MuxedStreamError("Stream is closed for sending")
    total, sent = len(data), 0
    view = memoryview(data)  # frames are cut from it without a copy each
    while sent < total:
        frame: bytes | None = None
        while frame is None:
            credit: trio.Event | None = None
            async with self.rw_lock.write_lock():
                if self.send_closed:
                    raise MuxedStreamError("Stream is closed for sending")
                async with self.window_lock:
                    if self.closed:
                        raise MuxedStreamError("Stream is closed")
                    if self.send_window > 0:
                        size = min(
                            self.send_window,
                            _yamux.MAX_MESSAGE_SIZE - _yamux.HEADER_SIZE,
                            total - sent,
                        )
                        self.send_window -= size
                        header = struct.pack(
                            _yamux.YAMUX_HEADER_FORMAT, 0, _yamux.TYPE_DATA, 0, self.stream_id, size
                        )
                        frame = header + view[sent : sent + size]
                    else:
                        # set under the same lock as every change of the window
                        credit = self.__dict__["_vd_credit"] = trio.Event()
            if credit is not None:
                self._zero_window_waits += 1
                with trio.move_on_after(ZERO_WINDOW_TIMEOUT_S) as waited:
                    await credit.wait()
                if waited.cancelled_caught:
                    raise MuxedStreamError(
                        "Timed out waiting for window update after "
                        f"{ZERO_WINDOW_TIMEOUT_S:g} seconds."
                    )
        await self.conn._write_frame(frame)
        sent += len(frame) - _yamux.HEADER_SIZE


_yamux.YamuxStream.send_window = _Waking("send_window", lambda before, after: after > before)  # type: ignore[assignment]
_yamux.YamuxStream.closed = _Waking("closed", lambda before, after: after and not before)  # type: ignore[assignment]
_yamux.YamuxStream.send_closed = _Waking(  # type: ignore[assignment]
    "send_closed", lambda before, after: after and not before
)
_yamux.YamuxStream.write = _write  # type: ignore[method-assign]


class WireMeter(Protocol):
    """What counts a connection's bytes (``TransferLedger``): called on the event loop
    for every TCP read and write, so it must be cheap and never block."""

    def add(self, up: int = 0, down: int = 0) -> None: ...


def meter(conn: Any, wire: WireMeter) -> bool:
    """Count every byte the TCP connection under ``conn`` (a raw connection) reads from
    and writes to its socket from now on (its payload, not the TCP/IP headers) into
    ``wire``; False when there is no TCP socket under it (a
    relayed connection: its bytes cross the relay's connection, counted there)."""
    tcp = _tcp_of(conn)
    if tcp is None:
        return False
    tcp.__dict__["_vd_meter"] = wire
    return True


class _Ahead:
    """The bytes one connection received ahead and has not handed out yet."""

    __slots__ = ("at", "data", "left")

    def __init__(self) -> None:
        self.data, self.at, self.left = b"", 0, 0


_held_in_all = 0  # bytes received ahead by every connection together
_counting = threading.Lock()  # a trainer's node runs its own trio loop in a thread


def _count(change: int) -> None:
    global _held_in_all
    with _counting:
        _held_in_all += change


def _release(ahead: _Ahead) -> None:
    """Run when a connection is gone: what it still held no longer counts."""
    _count(-ahead.left)


def _ahead_of(stream: _io.TrioTCPStream) -> _Ahead:
    ahead: _Ahead | None = stream.__dict__.get("_vd_ahead")
    if ahead is None:
        ahead = stream.__dict__["_vd_ahead"] = _Ahead()
        weakref.finalize(stream, _release, ahead)
    return ahead


def _take(ahead: _Ahead, n: int | None) -> bytes:
    """Up to ``n`` of the bytes received ahead (b"" if none are left)."""
    if not ahead.left:
        return b""
    at, data = ahead.at, ahead.data
    size = ahead.left if n is None else min(n, ahead.left)
    piece = data[at : at + size] if size < len(data) else data
    ahead.at, ahead.left = at + size, ahead.left - size
    _count(-size)
    if not ahead.left:
        ahead.data = b""
    return piece


async def _read_ahead(self: _io.TrioTCPStream, n: int | None = None) -> bytes:
    """The library's ``TrioTCPStream.read`` (up to ``n`` bytes; b"" once closed
    locally; ``ConnectionClosedError`` when reset), receiving ``READ_AHEAD`` at once
    while all connections together hold less than ``READ_AHEAD_BUDGET``."""
    if n == 0:
        return b""
    ahead = _ahead_of(self)
    piece = _take(ahead, n)  # without the lock: no checkpoint for bytes in hand
    if piece:
        return piece
    async with self.read_lock:
        piece = _take(ahead, n)  # received by a reader this one waited for
        if piece:
            return piece
        size = n
        if _held_in_all + READ_AHEAD <= READ_AHEAD_BUDGET:
            size = max(n or 0, READ_AHEAD)
        try:
            data = await self.stream.receive_some(size)
        except trio.BrokenResourceError as error:
            raise _io.ConnectionClosedError(
                f"TCP connection reset by remote peer: {error}", transport="tcp"
            ) from error
        except trio.ClosedResourceError:
            return b""
        wire: WireMeter | None = self.__dict__.get("_vd_meter")
        if wire is not None:
            wire.add(down=len(data))
        if n is None or len(data) <= n:
            return data
        ahead.data, ahead.at, ahead.left = data, n, len(data) - n
        _count(ahead.left)
        return data[:n]


_library_close = _io.TrioTCPStream.close


async def _close_dropping_what_is_held(self: _io.TrioTCPStream) -> None:
    """The library's close; bytes received ahead and not read are dropped with the
    connection (they no longer count against the budget, and are never handed out)."""
    ahead: _Ahead | None = self.__dict__.get("_vd_ahead")
    if ahead is not None and ahead.left:
        _count(-ahead.left)
        ahead.data, ahead.at, ahead.left = b"", 0, 0
    await _library_close(self)


def held_ahead() -> int:
    """Bytes received ahead by all connections and not handed out yet."""
    return _held_in_all


_io.TrioTCPStream.read = _read_ahead  # type: ignore[method-assign]
_io.TrioTCPStream.close = _close_dropping_what_is_held  # type: ignore[method-assign]


# --- what a peer can make a connection hold or wait for ---------------------------

_counts = {"window_overruns": 0, "stalled_writes": 0, "cut_writes": 0, "pings_unanswered": 0}


def _tally(name: str) -> None:
    with _counting:
        _counts[name] += 1


def counts() -> dict[str, int]:
    """Connections closed for data past a stream's receive window
    (``window_overruns``), for a write that moved nothing for ``WRITE_STALL_S``
    (``stalled_writes``) or one cancelled half-way and not finished in its grace
    (``cut_writes``), and pings left unanswered while an answer was pending: since the
    process started, all connections together."""
    with _counting:
        return dict(_counts)


def _tcp_of(conn: Any) -> _io.TrioTCPStream | None:
    """The TCP stream under a Yamux connection (its secured connection, Noise, the raw
    connection: py-libp2p 0.8.1's attribute names); None over a relay."""
    seen = conn
    for _ in range(8):
        if isinstance(seen, _io.TrioTCPStream):
            return seen
        state = getattr(seen, "__dict__", {})
        for name in ("secured_conn", "_conn", "conn", "read_writer", "read_write_closer", "stream"):
            if name in state and state[name] is not seen:
                seen = state[name]
                break
        else:
            return None
    return None


def _cut(tcp: _io.TrioTCPStream) -> None:
    """Close ``tcp``'s socket now: tasks blocked writing or reading it fail at once
    (trio wakes them), and bytes received ahead are dropped."""
    ahead: _Ahead | None = tcp.__dict__.get("_vd_ahead")
    if ahead is not None and ahead.left:
        _count(-ahead.left)
        ahead.data, ahead.at, ahead.left = b"", 0, 0
    try:
        tcp.stream.socket.close()
    except Exception:  # closed already, or not a socket stream
        logger.debug("closing a socket failed", exc_info=True)


def abort(conn: Any) -> None:
    """Close a Yamux connection at once, without its GO_AWAY: its TCP socket is
    closed, so every task blocked on it fails, and its reader, at the end of the
    stream, closes the connection as when a peer goes away. Over a relay (no socket of
    its own) the connection is closed by a task of its own, within ``STREAM_CLEANUP_S``."""
    tcp = _tcp_of(conn)
    if tcp is not None:
        _cut(tcp)
        return
    nursery: trio.Nursery | None = getattr(conn, "_nursery", None)
    if nursery is None:
        return

    async def close_secured() -> None:
        with trio.move_on_after(STREAM_CLEANUP_S):
            try:
                await conn.secured_conn.close()
            except Exception:
                logger.debug("closing a relayed connection failed", exc_info=True)

    try:
        nursery.start_soon(close_secured)
    except RuntimeError:  # the connection's tasks are ending: it is closing already
        pass


class _ReceiveWindow:
    """``YamuxStream.recv_window``: what the peer may still send on the stream. The
    library subtracts each data frame after buffering it, and where that goes below
    zero only logs; here the stream is reset, its buffered bytes dropped and the
    connection closed (``abort``) — what a peer sends past the window is never kept."""

    def __get__(self, stream: Any, owner: type | None = None) -> Any:
        if stream is None:
            return self
        try:
            return stream.__dict__["_vd_recv_window"]
        except KeyError:
            raise AttributeError("recv_window") from None

    def __set__(self, stream: Any, value: int) -> None:
        state = stream.__dict__
        if value < 0 and "_vd_recv_window" in state:
            _overrun(stream, -value)
            value = 0
        state["_vd_recv_window"] = value


def _overrun(stream: Any, excess: int) -> None:
    conn = stream.conn
    _tally("window_overruns")
    logger.warning(
        "peer %s sent %d bytes past stream %d's receive window: closing the connection",
        getattr(conn, "peer_id", "?"),
        excess,
        stream.stream_id,
    )
    buffered = conn.stream_buffers.get(stream.stream_id)
    if buffered is not None:
        del buffered[:]
    stream.reset_received = True
    stream.recv_closed = True
    stream.send_closed = True
    stream.closed = True
    event = conn.stream_events.get(stream.stream_id)
    if event is not None:
        event.set()
    abort(conn)


_yamux.YamuxStream.recv_window = _ReceiveWindow()  # type: ignore[assignment]


class _StreamEvents(dict[int, trio.Event]):
    """``Yamux.stream_events``, keeping events only for the connection's streams. A
    stream's reader puts a fresh event back after each wake-up, also once the stream
    has been finalized (refused, reset): the library left one event per such stream
    until the connection closed, ~350 KB per 1,000 refused requests on one
    connection, which a peer can send for days."""

    __slots__ = ("_streams",)

    def __init__(self, streams: dict[int, Any]) -> None:
        super().__init__()
        self._streams = streams

    def __setitem__(self, stream_id: int, event: trio.Event) -> None:
        if stream_id in self._streams:
            super().__setitem__(stream_id, event)


_library_yamux_init = _yamux.Yamux.__init__


@functools.wraps(_library_yamux_init)
def _yamux_init(self: _yamux.Yamux, *args: Any, **kwargs: Any) -> None:
    _library_yamux_init(self, *args, **kwargs)
    self.stream_events = _StreamEvents(self.streams)


_yamux.Yamux.__init__ = _yamux_init  # type: ignore[method-assign]


class _Closed(Exception):
    """The socket was closed here (``abort``, or the connection's close)."""


# A write's progress is watched, not bounded by a deadline of its own (a cancel scope
# per write cost ~5 µs). A write notes when it last moved bytes; one task per trio run
# (while writes are pending) looks every ``WATCH_PERIOD_S`` and closes the socket of a
# write stuck for ``WRITE_STALL_S``. A look later than ``FROZEN_S`` means this process
# did not run (SIGSTOP, a paused VM, an event loop held): the writes had no chance to
# move, so their count starts again.
WATCH_PERIOD_S = 1.0
FROZEN_S = 5.0


class _Watch:
    """A trio run's pending TCP writes: when each last moved a byte."""

    __slots__ = ("pending", "running")

    def __init__(self) -> None:
        self.pending: dict[_io.TrioTCPStream, float] = {}
        self.running = False


_WATCH: trio.lowlevel.RunVar[_Watch] = trio.lowlevel.RunVar("volunteerd_flow_watch")


def _watch() -> _Watch:
    try:
        return _WATCH.get()
    except LookupError:
        watch = _Watch()
        _WATCH.set(watch)
        return watch


async def _watchdog(watch: _Watch) -> None:
    """Close the socket of every write that moved nothing for ``WRITE_STALL_S``; end
    once no write is pending (the next write starts another)."""
    try:
        while watch.pending:
            due = trio.current_time() + WATCH_PERIOD_S
            await trio.sleep_until(due)
            now = trio.current_time()
            if now - due > FROZEN_S:
                logger.info("this process did not run for %.0f s: stalls counted anew", now - due)
                for tcp in watch.pending:
                    watch.pending[tcp] = now
                continue
            for tcp, since in list(watch.pending.items()):
                if now - since < WRITE_STALL_S:
                    continue
                del watch.pending[tcp]
                tcp.__dict__["_vd_stalled"] = True
                _tally("stalled_writes")
                try:
                    remote = tcp.get_remote_address()
                except Exception:
                    remote = None
                logger.info(
                    "a peer (%s) took nothing for %g s: closing the connection",
                    remote,
                    WRITE_STALL_S,
                )
                _cut(tcp)
    except Exception:  # a system task's error would end the whole run
        logger.exception("the TCP write watchdog failed")
    finally:
        watch.running = False


def _watching(tcp: _io.TrioTCPStream) -> _Watch:
    """Note ``tcp``'s write as pending from now; start the run's watchdog if none runs."""
    watch = _watch()
    watch.pending[tcp] = trio.current_time()
    if not watch.running:
        try:
            trio.lowlevel.spawn_system_task(_watchdog, watch, name="volunteerd TCP write watchdog")
            watch.running = True
        except RuntimeError:  # the run is ending: its writes are not watched
            logger.debug("no watchdog for a write at the end of a run", exc_info=True)
    return watch


async def _send_some(tcp: _io.TrioTCPStream, data: memoryview) -> int:
    """Send a first part of ``data`` on ``tcp``'s socket: how many bytes went. Raises
    _Closed, or ConnectionClosedError when the peer reset the connection or the
    watchdog closed it (nothing moved for ``WRITE_STALL_S``)."""
    try:
        sent: int = await tcp.stream.socket.send(data)
        wire: WireMeter | None = tcp.__dict__.get("_vd_meter")
        if wire is not None:
            wire.add(up=sent)
        return sent
    except trio.ClosedResourceError:
        pass
    except OSError as error:
        if error.errno != errno.EBADF:
            raise ConnectionClosedError(
                f"TCP connection reset by remote peer: {error}", transport="tcp"
            ) from error
    if tcp.__dict__.get("_vd_stalled"):
        raise ConnectionClosedError(
            f"the peer took nothing for {WRITE_STALL_S:g} s; connection closed", transport="tcp"
        )
    raise _Closed


async def _write_or_close(self: _io.TrioTCPStream, data: bytes) -> None:
    """The library's ``TrioTCPStream.write`` (nothing happens once closed here;
    ``ConnectionClosedError`` when reset), but a write that moves nothing for
    ``WRITE_STALL_S`` closes the connection, and one cancelled half-way finishes or
    closes it (``CANCELLED_WRITE_GRACE_S``)."""
    if not hasattr(self.stream, "socket"):  # not a socket stream: the library's own
        await _library_write(self, data)
        return
    view = memoryview(data).cast("B")
    total, sent, locked = len(view), 0, False
    watch: _Watch | None = None
    try:
        await self.write_lock.acquire()
        locked = True
        watch = _watching(self)
        sent = await _send_some(self, view)
        while sent < total:  # the socket's buffer was full: progress, noted
            watch.pending[self] = trio.current_time()
            sent += await _send_some(self, view[sent:])
    except _Closed:
        return
    except trio.Cancelled:
        # Noise counted the message already: the peer must get it whole, or nothing
        # more on this connection.
        with trio.CancelScope(shield=True), trio.move_on_after(CANCELLED_WRITE_GRACE_S):
            try:
                if not locked:
                    await self.write_lock.acquire()
                    locked = True
                while sent < total:
                    sent += await _send_some(self, view[sent:])
            except (_Closed, ConnectionClosedError):
                pass
        if sent < total:
            _tally("cut_writes")
            _cut(self)
        raise
    finally:
        if watch is not None:
            watch.pending.pop(self, None)
        if locked:
            self.write_lock.release()


_library_write = _io.TrioTCPStream.write
_io.TrioTCPStream.write = _write_or_close  # type: ignore[method-assign]


_PONG = struct.pack("!BBH", 0, _yamux.TYPE_PING, _yamux.FLAG_ACK)
_library_write_frame = _yamux.Yamux._write_frame


async def _write_frame(self: _yamux.Yamux, data: bytes) -> None:
    """The library's ``Yamux._write_frame``, but the answer to a ping (written by the
    connection's reader) goes out from a task of its own, at most one at a time."""
    if len(data) == _yamux.HEADER_SIZE and data[:4] == _PONG:
        _answer_ping(self, bytes(data))
        await trio.lowlevel.checkpoint()
        return
    await _library_write_frame(self, data)


def _answer_ping(conn: _yamux.Yamux, pong: bytes) -> None:
    state = conn.__dict__
    nursery: trio.Nursery | None = conn._nursery
    if state.get("_vd_answering") or nursery is None:
        _tally("pings_unanswered")
        return

    async def answer() -> None:
        try:
            await _library_write_frame(conn, pong)
        except Exception:  # the connection is going: its reader sees to it
            logger.debug("answering a ping failed", exc_info=True)
        finally:
            state["_vd_answering"] = False

    state["_vd_answering"] = True
    try:
        nursery.start_soon(answer)
    except RuntimeError:  # the connection's tasks are ending
        state["_vd_answering"] = False


_yamux.Yamux._write_frame = _write_frame  # type: ignore[method-assign]


_library_reset = _yamux.YamuxStream.reset
_library_stream_close = _yamux.YamuxStream.close


async def _reset_within(self: _yamux.YamuxStream) -> None:
    """The library's ``YamuxStream.reset`` within ``STREAM_CLEANUP_S``; past it the
    stream is reset here without its RST."""
    with trio.move_on_after(STREAM_CLEANUP_S) as waited:
        await _library_reset(self)
    if waited.cancelled_caught:
        self.reset_received = True
        _given_up(self, fully=True)


async def _close_within(self: _yamux.YamuxStream) -> None:
    """The library's ``YamuxStream.close`` within ``STREAM_CLEANUP_S``; past it the
    stream is closed for sending here without its FIN."""
    with trio.move_on_after(STREAM_CLEANUP_S) as waited:
        await _library_stream_close(self)
    if waited.cancelled_caught:
        _given_up(self, fully=self.recv_closed)


def _given_up(stream: _yamux.YamuxStream, *, fully: bool) -> None:
    """A stream whose RST or FIN could not be written in time: closed here all the
    same, and its bookkeeping released by the connection's tasks (which need its lock)."""
    stream.send_closed = True
    if fully:
        stream.recv_closed = True
        stream.closed = True
    conn = stream.conn
    event = conn.stream_events.get(stream.stream_id)
    if event is not None:
        event.set()
    nursery: trio.Nursery | None = conn._nursery
    if nursery is None:
        return
    try:
        nursery.start_soon(functools.partial(conn._finalize_stream, stream, fully_closed=fully))
    except RuntimeError:  # the connection's tasks are ending: nothing left to release
        pass


_yamux.YamuxStream.reset = _reset_within  # type: ignore[method-assign]
_yamux.YamuxStream.close = _close_within  # type: ignore[method-assign]
