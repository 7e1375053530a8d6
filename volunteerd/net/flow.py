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
the window, the same locks, and the same error after 5 s without credit.

*TCP reads ahead.* Noise reads each message as a 2-byte length and then the message, so
every 64 KiB frame took two or more ``recv`` calls, each a trio checkpoint. A connection
now receives up to ``READ_AHEAD`` bytes at once and serves the following reads from
them. Those bytes would otherwise wait in the kernel's socket buffer; a reader that
stops (a peer's small frames being paced) keeps what it holds, so what all connections
hold together is bounded too: over ``READ_AHEAD_BUDGET`` a read takes only what it asks
for, as the library's did.
"""

from __future__ import annotations

import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

import trio
from libp2p.io import trio as _io
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.stream_muxer.yamux import yamux as _yamux

__all__ = ["READ_AHEAD", "READ_AHEAD_BUDGET", "ZERO_WINDOW_TIMEOUT_S", "held_ahead"]

READ_AHEAD = 128 * 1024  # per connection
READ_AHEAD_BUDGET = 16 * 1024 * 1024  # all connections together
ZERO_WINDOW_TIMEOUT_S = 5.0  # the library's: a peer that gives no credit for 5 s


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
