"""py-libp2p's ``Yamux.close`` as volunteerd patches it (``net/host.py``): the whole
close (GO_AWAY sent, the secured connection closed, the callback awaited) without the
library's 0.1 s sleep after it. If an upgrade of py-libp2p changes how its close ends,
these fail instead of a close being cut short."""

from __future__ import annotations

import struct

import trio
from libp2p.peer.id import ID
from libp2p.stream_muxer.yamux import yamux as _yamux
from libp2p.stream_muxer.yamux.yamux import Yamux

import volunteerd.net.host  # noqa: F401 - the patch is applied on import

PEER = ID(b"\x00\x24\x08\x01\x12\x20" + bytes(32))


class SecuredConn:
    """The few methods of a secured connection that Yamux's close uses."""

    is_initiator = True

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.written.append(bytes(data))

    async def close(self) -> None:
        await trio.lowlevel.checkpoint()
        self.closed = True


def frame_types(conn: SecuredConn) -> list[int]:
    return [struct.unpack(_yamux.YAMUX_HEADER_FORMAT, w[:12])[1] for w in conn.written]


async def test_close_does_everything_but_the_nap(autojump_clock: trio.abc.Clock) -> None:
    conn = SecuredConn()
    callback_done = trio.Event()

    async def on_close() -> None:
        await trio.sleep(1)  # a slow callback is awaited to its end, not cut short
        callback_done.set()

    muxed = Yamux(conn, PEER, on_close=on_close)  # type: ignore[arg-type]
    started = trio.current_time()
    await muxed.close()
    assert frame_types(conn) == [_yamux.TYPE_GO_AWAY]
    assert conn.closed
    assert muxed.event_closed.is_set()
    assert callback_done.is_set()
    assert trio.current_time() - started == 1  # the callback's second, no 0.1 s after it

    started = trio.current_time()
    await muxed.close()  # closing again is harmless, and as quick
    assert frame_types(conn) == [_yamux.TYPE_GO_AWAY]
    assert trio.current_time() - started == 1


async def test_without_a_callback_and_from_two_tasks_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    conn = SecuredConn()
    muxed = Yamux(conn, PEER)  # type: ignore[arg-type]
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(muxed.close)
        nursery.start_soon(muxed.close)
    assert conn.closed
    assert muxed.event_closed.is_set()
    assert frame_types(conn) == [_yamux.TYPE_GO_AWAY]
    assert trio.current_time() == started


async def test_a_cancelled_caller_is_still_cancelled(autojump_clock: trio.abc.Clock) -> None:
    """The patch's own cancellation must not swallow the caller's."""
    conn = SecuredConn()

    async def on_close() -> None:
        await trio.sleep(5)

    muxed = Yamux(conn, PEER, on_close=on_close)  # type: ignore[arg-type]
    with trio.move_on_after(1) as caller:
        await muxed.close()
    assert caller.cancelled_caught
    assert conn.closed
