"""py-libp2p's Yamux writes and TCP reads as ``net/flow.py`` patches them, on the
library's real Yamux (two ends over an in-memory pipe) and a real socket pair.

In virtual time: a writer out of send window must resume when the credit arrives, not
at the next tick of a poll (the library slept 10 ms at a time)."""

from __future__ import annotations

import gc
import os
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing
from libp2p.io.trio import TrioTCPStream
from libp2p.peer.id import ID
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.stream_muxer.yamux import yamux as _yamux
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream

from volunteerd.net import flow

A = ID(b"\x00\x24\x08\x01\x12\x20" + bytes(32))
B = ID(b"\x00\x24\x08\x01\x12\x20" + bytes(31) + b"\x01")


class Pipe:
    """One end of an in-memory byte pipe, as the secured connection Yamux reads."""

    def __init__(self, stream: trio.abc.Stream, initiator: bool) -> None:
        self._stream = stream
        self.is_initiator = initiator

    async def read(self, n: int | None = None) -> bytes:
        return await self._stream.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self._stream.send_all(data)

    async def close(self) -> None:
        await self._stream.aclose()


async def connected(nursery: trio.Nursery) -> tuple[Yamux, Yamux]:
    left, right = trio.testing.memory_stream_pair()
    dialer = Yamux(Pipe(left, True), B)  # type: ignore[arg-type]
    listener = Yamux(Pipe(right, False), A)  # type: ignore[arg-type]
    nursery.start_soon(dialer.start)
    nursery.start_soon(listener.start)
    await dialer.event_started.wait()
    await listener.event_started.wait()
    return dialer, listener


async def opened(dialer: Yamux, listener: Yamux) -> tuple[YamuxStream, YamuxStream]:
    ours = await dialer.open_stream()
    await ours.write(b"hello")  # the SYN goes with the first frame
    theirs = await listener.accept_stream()
    assert await theirs.read(5) == b"hello"
    return ours, theirs  # type: ignore[return-value]


def aside(
    nursery: trio.Nursery, job: Callable[[], Awaitable[object]]
) -> tuple[list[object], trio.Event]:
    """Run ``job`` in ``nursery``: its result, or the MuxedStreamError it raised, lands
    in the list, then the event is set."""
    outcome: list[object] = []
    ended = trio.Event()

    async def run() -> None:
        try:
            outcome.append(await job())
        except MuxedStreamError as exc:
            outcome.append(exc)
        ended.set()

    nursery.start_soon(run)
    return outcome, ended


async def read_all(stream: YamuxStream, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        got += await stream.read(min(64 * 1024, n - len(got)))
    return bytes(got)


async def test_a_writer_out_of_window_resumes_as_soon_as_credit_comes(
    autojump_clock: trio.abc.Clock,
) -> None:
    payload = os.urandom(2 * 1024 * 1024)  # 8 windows of 256 KiB
    async with trio.open_nursery() as nursery:
        dialer, listener = await connected(nursery)
        ours, theirs = await opened(dialer, listener)
        started = trio.current_time()
        received, done = aside(nursery, lambda: read_all(theirs, len(payload)))
        await ours.write(payload)
        await done.wait()
        took = trio.current_time() - started
        assert received == [payload]
        assert ours._zero_window_waits > 0  # it did run out of window, and waited
        # No clock ran: every wait ended with the credit that ended it. The library's
        # 10 ms poll took at least 10 ms per wait here.
        assert took == 0
        nursery.cancel_scope.cancel()


async def test_a_peer_that_gives_no_credit_fails_the_write_after_five_seconds(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        dialer, listener = await connected(nursery)
        ours, _ = await opened(dialer, listener)
        started = trio.current_time()
        with pytest.raises(MuxedStreamError, match="window update"):
            await ours.write(bytes(1024 * 1024))  # nobody reads: the window stays shut
        assert trio.current_time() - started == pytest.approx(flow.ZERO_WINDOW_TIMEOUT_S)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("side", ["ours", "theirs", "connection"])
async def test_a_reset_while_the_writer_waits_for_credit_ends_the_write_at_once(
    autojump_clock: trio.abc.Clock, side: str
) -> None:
    async with trio.open_nursery() as nursery:
        dialer, listener = await connected(nursery)
        ours, theirs = await opened(dialer, listener)
        outcome, ended = aside(nursery, lambda: ours.write(bytes(1024 * 1024)))
        await trio.sleep(1)  # the window ran out long ago; the writer waits
        assert not outcome
        assert ours.send_window == 0
        reset_at = trio.current_time()
        if side == "connection":
            await dialer.close()
        else:
            await (ours if side == "ours" else theirs).reset()
        await ended.wait()
        assert isinstance(outcome[0], MuxedStreamError), "the write ended without an error"
        assert trio.current_time() == reset_at  # not the end of the 5 s wait
        assert ours.closed
        nursery.cancel_scope.cancel()


async def test_window_and_closed_read_and_write_as_plain_attributes() -> None:
    async with trio.open_nursery() as nursery:
        dialer, listener = await connected(nursery)
        ours, _ = await opened(dialer, listener)
        assert ours.send_window == _yamux.DEFAULT_WINDOW_SIZE - 5
        ours.send_window += 10
        assert ours.send_window == _yamux.DEFAULT_WINDOW_SIZE + 5
        assert ours.closed is False
        nursery.cancel_scope.cancel()
    with pytest.raises(AttributeError):
        YamuxStream.__new__(YamuxStream).send_window  # noqa: B018 - never set


async def socket_pair() -> tuple[TrioTCPStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return TrioTCPStream(trio.SocketStream(a)), trio.SocketStream(b)


async def test_reads_ahead_serve_exact_pieces_in_order_and_hold_at_most_the_read_ahead() -> None:
    ours, theirs = await socket_pair()
    payload = os.urandom(1024 * 1024)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(theirs.send_all, payload)
        got = bytearray()
        sizes = [2, 65535, 12, 1, 300_000, 7]
        for i in range(10_000):
            if len(got) == len(payload):
                break
            piece = await ours.read(sizes[i % len(sizes)])
            assert 0 < len(piece) <= sizes[i % len(sizes)]
            got += piece
            assert ours.__dict__["_vd_ahead"].left <= flow.READ_AHEAD
        assert bytes(got) == payload
    await theirs.aclose()
    assert await ours.read(10) == b""  # the peer closed: end of stream
    await ours.close()
    assert await ours.read(10) == b""  # closed here: end of stream too


async def test_two_readers_of_one_connection_get_each_byte_once() -> None:
    ours, theirs = await socket_pair()
    payload = os.urandom(512 * 1024)
    pieces: list[bytes] = []  # in the order the reads returned
    all_read = trio.Event()

    async def reader() -> None:
        while not all_read.is_set():
            piece = await ours.read(1000)
            if not piece:
                return
            pieces.append(piece)
            if sum(map(len, pieces)) == len(payload):
                all_read.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        nursery.start_soon(reader)
        await theirs.send_all(payload)
        with trio.fail_after(10):
            await all_read.wait()
        await theirs.aclose()
    await ours.close()
    assert b"".join(pieces) == payload


async def test_what_all_connections_hold_ahead_is_bounded_and_freed_with_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Readers that stop after a first piece (a peer's small frames being paced) keep
    what they received ahead: at most READ_AHEAD each, and READ_AHEAD_BUDGET in all;
    past that a read takes what it asks for. A connection's bytes count until it is
    closed or gone."""
    monkeypatch.setattr(flow, "READ_AHEAD_BUDGET", flow.held_ahead() + 3 * flow.READ_AHEAD)
    pairs = [await socket_pair() for _ in range(6)]
    for ours, theirs in pairs:
        # a Unix socket pair: once sent, every byte waits in the reader's socket
        await theirs.send_all(os.urandom(flow.READ_AHEAD + 1000))
        assert len(await ours.read(12)) == 12  # a header, then the reader stops
        assert flow.held_ahead() <= flow.READ_AHEAD_BUDGET
    held = [ours.__dict__["_vd_ahead"].left for ours, _ in pairs]
    assert held[:3] == [flow.READ_AHEAD - 12] * 3  # a whole read-ahead each, then
    assert held[3:] == [0, 0, 0]  # only the 12 bytes asked for
    for ours, _ in pairs[3:]:
        assert len(await ours.read(100)) == 100  # unread bytes are still there
    before = flow.held_ahead()
    ours, theirs = pairs[0]
    await ours.close()  # closed: what it held is dropped at once
    await theirs.aclose()
    assert flow.held_ahead() == before - (flow.READ_AHEAD - 12)
    assert await ours.read(100) == b""
    ours, theirs = pairs[1]
    await ours.stream.aclose()  # its socket closed under it: the wrapper is only dropped
    await theirs.aclose()
    assert flow.held_ahead() == before - (flow.READ_AHEAD - 12)
    del pairs[:2], ours, theirs
    gc.collect()
    assert flow.held_ahead() == before - 2 * (flow.READ_AHEAD - 12)
    for ours, theirs in pairs:
        await ours.close()
        await theirs.aclose()
