"""What a peer can make a connection hold or wait for, with ``net/flow.py``'s and
``net/host.py``'s patches, on the library's real Yamux over a real socket pair whose
other end the test writes by hand (a peer that ignores the rules).

Probed from outside (2026-12): a server that kept streaming on a stream past its
receive window grew a trainer's memory at line rate (the library only logged it); and
one that stopped reading its socket while sending pings blocked the trainer's
connection reader (answering each ping) and then, forever, every shielded cleanup
that writes (a stream's reset, the connection's close, a hang-up).

Deadlines are in virtual time (``autojump_clock``: the clock jumps while every task
waits on the socket), so the bounds are exact and a load on the machine cannot make
them flaky; the real-time bounds are generous and only end a test that would hang."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio
from libp2p.io.trio import TrioTCPStream
from libp2p.peer.id import ID
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.stream_muxer.yamux import yamux as _yamux
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream

from volunteerd.config import Config
from volunteerd.net import flow
from volunteerd.net import host as _host  # noqa: F401 - the close's patch
from volunteerd.net.rpc import RpcClient

PEER = ID(b"\x00\x24\x08\x01\x12\x20" + bytes(32))
WINDOW = _yamux.DEFAULT_WINDOW_SIZE


def frame(kind: int, flags: int, stream_id: int, length: int, payload: bytes = b"") -> bytes:
    return struct.pack(_yamux.YAMUX_HEADER_FORMAT, 0, kind, flags, stream_id, length) + payload


@asynccontextmanager
async def yamux_and_raw_peer(
    small_buffers: bool = False,
) -> AsyncIterator[tuple[Yamux, trio.SocketStream, trio.Nursery]]:
    """Our Yamux (the dialer) over one end of a socket pair; the other end raw."""
    ours, theirs = trio.socket.socketpair()
    if small_buffers:  # the peer's socket fills after a few KiB nobody reads
        for sock in (ours, theirs):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    muxed = Yamux(TrioTCPStream(trio.SocketStream(ours)), PEER, is_initiator=True)  # type: ignore[arg-type]
    peer = trio.SocketStream(theirs)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(muxed.start)
        await muxed.event_started.wait()
        try:
            yield muxed, peer, nursery
        finally:
            nursery.cancel_scope.cancel()
    await muxed.secured_conn.close()
    await peer.aclose()


# --- data past the receive window -------------------------------------------------


async def test_data_past_the_receive_window_resets_the_stream_and_closes_the_connection() -> None:
    before = flow.counts()["window_overruns"]
    async with yamux_and_raw_peer() as (muxed, peer, _):
        stream = await muxed.open_stream()  # its SYN goes to the peer, never read
        chunk = 60 * 1024
        flood = b"".join(
            frame(_yamux.TYPE_DATA, 0, stream.stream_id, chunk, os.urandom(chunk))
            for _ in range(WINDOW // chunk + 2)  # one frame and a bit past the window
        )
        with trio.fail_after(20):  # real time: only ends a hang
            await peer.send_all(flood)
            await muxed.event_closed.wait()  # closed by us, not by the peer
        assert flow.counts()["window_overruns"] == before + 1
        assert stream.closed
        assert stream.reset_received
        assert not muxed.stream_buffers  # nothing of it kept
        with pytest.raises(MuxedStreamError):
            await stream.read(1)


async def test_data_within_the_window_is_kept_and_read() -> None:
    before = flow.counts()["window_overruns"]
    async with yamux_and_raw_peer() as (muxed, peer, _):
        stream = await muxed.open_stream()
        payload = os.urandom(WINDOW)  # exactly the window: allowed
        await peer.send_all(frame(_yamux.TYPE_DATA, 0, stream.stream_id, WINDOW, payload))
        with trio.fail_after(30):
            got = bytearray()
            while len(got) < WINDOW:
                got += await stream.read(WINDOW - len(got))
        assert bytes(got) == payload
        assert not muxed.event_closed.is_set()
        assert flow.counts()["window_overruns"] == before


# --- a peer that stops reading its socket ------------------------------------------


async def test_pings_into_a_socket_nobody_reads_do_not_stop_the_reader() -> None:
    """The peer sends pings and never reads: their answers fill its socket. The reader
    must go on reading (the library's wrote each answer itself and blocked for good),
    here seen by data the peer sends after the pings reaching the stream's reader."""
    before = flow.counts()["pings_unanswered"]
    async with yamux_and_raw_peer(small_buffers=True) as (muxed, peer, _):
        stream = await muxed.open_stream()  # its SYN: 12 bytes, room for them yet
        pings = b"".join(frame(_yamux.TYPE_PING, _yamux.FLAG_SYN, 0, i) for i in range(20_000))
        with trio.fail_after(15):  # real time: only ends a hang (the stall bound is 20 s)
            await peer.send_all(pings)  # 240 KB: all read only if the reader keeps reading
            await peer.send_all(frame(_yamux.TYPE_DATA, 0, stream.stream_id, 5, b"after"))
            assert await stream.read(5) == b"after"
        assert flow.counts()["pings_unanswered"] > before
        assert not muxed.event_closed.is_set()


async def stuck_writer(
    muxed: Yamux, peer: trio.SocketStream, nursery: trio.Nursery
) -> tuple[YamuxStream, list[BaseException], trio.Event]:
    """A stream whose peer granted 1 GiB of window and reads nothing: its write of
    4 MiB fills the socket and blocks, holding the connection's write lock."""
    stream: YamuxStream = await muxed.open_stream()
    await peer.send_all(
        frame(_yamux.TYPE_WINDOW_UPDATE, _yamux.FLAG_ACK, stream.stream_id, 1 << 30)
    )
    while stream.send_window < 1 << 30:  # noqa: ASYNC110 - the reader sets it
        await trio.sleep(0.001)
    failed: list[BaseException] = []
    ended = trio.Event()

    async def write() -> None:
        try:
            await stream.write(bytes(4 << 20))
        except Exception as exc:
            failed.append(exc)
        ended.set()

    nursery.start_soon(write)
    await trio.sleep(0.5)
    assert not ended.is_set(), "the socket should be full"
    return stream, failed, ended


async def test_a_write_that_moves_nothing_closes_the_connection_after_the_stall_bound(
    autojump_clock: trio.abc.Clock,
) -> None:
    before = flow.counts()["stalled_writes"]
    async with yamux_and_raw_peer(small_buffers=True) as (muxed, peer, nursery):
        started = trio.current_time()
        _, failed, ended = await stuck_writer(muxed, peer, nursery)
        with trio.fail_after(flow.WRITE_STALL_S * 3):
            await ended.wait()
            await muxed.event_closed.wait()  # the reader saw the socket closed
        assert failed, "the blocked write must fail, not return"
        # the watchdog looks every WATCH_PERIOD_S; the write started after 0.5 s
        assert trio.current_time() - started <= flow.WRITE_STALL_S + flow.WATCH_PERIOD_S + 0.5
        assert flow.counts()["stalled_writes"] == before + 1


async def test_a_process_that_did_not_run_does_not_blame_its_peers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Time that passed while this process was stopped (a laptop's SIGSTOP, a paused
    VM: the clock jumps past every deadline at once) is not a peer's stall: the count
    starts again, and a peer that still reads nothing is cut WRITE_STALL_S later."""
    before = flow.counts()["stalled_writes"]
    async with yamux_and_raw_peer(small_buffers=True) as (muxed, peer, nursery):
        _, failed, ended = await stuck_writer(muxed, peer, nursery)
        autojump_clock.jump(flow.WRITE_STALL_S * 3)  # stopped for a minute
        await trio.sleep(flow.WATCH_PERIOD_S * 2)
        assert not ended.is_set()
        assert flow.counts()["stalled_writes"] == before
        resumed = trio.current_time()
        with trio.fail_after(flow.WRITE_STALL_S * 3):
            await ended.wait()
        assert failed
        assert trio.current_time() - resumed <= flow.WRITE_STALL_S + flow.WATCH_PERIOD_S
        assert flow.counts()["stalled_writes"] == before + 1


async def test_a_slow_reader_is_not_cut_off_while_bytes_move(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The stall bound is on progress, not on the whole write: a peer that takes a few
    KiB every WRITE_STALL_S * 0.75 gets a message ten bound-times long to send. The
    run's watchdog ends once no write is pending."""
    tcp, peer = small_socket_pair()
    message = os.urandom(256 * 1024)
    stalled_before = flow.counts()["stalled_writes"]
    got = bytearray()

    async def read_slowly() -> None:
        while len(got) < len(message):
            await trio.sleep(flow.WRITE_STALL_S * 0.75)
            got.extend(await peer.receive_some(16 * 1024))

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_slowly)
        await tcp.write(message)
    assert bytes(got) == message
    assert trio.current_time() - started > flow.WRITE_STALL_S * 10
    assert flow.counts()["stalled_writes"] == stalled_before
    assert tcp.stream.socket.fileno() >= 0
    await trio.sleep(flow.WATCH_PERIOD_S * 2)
    assert not flow._watch().running
    assert not flow._watch().pending
    await tcp.close()
    await peer.aclose()


async def within_its_bound(cleanup: Callable[[], Awaitable[None]]) -> float:
    """How long ``cleanup`` took, in an outer scope that never fires when the cleanup
    has a bound of its own (no shield: one without would fail the test, not hang it)."""
    started = trio.current_time()
    with trio.move_on_after(flow.WRITE_STALL_S / 2) as unbounded:
        await cleanup()
    assert not unbounded.cancelled_caught
    return trio.current_time() - started


async def test_shielded_cleanups_on_a_stuck_connection_end_within_their_bounds(
    autojump_clock: trio.abc.Clock,
) -> None:
    """While a write is stuck (the peer reads nothing), a stream's reset and close and
    the connection's close, shielded as py-libp2p and the RPC client await them, each
    end within their own bound, long before the stall bound."""
    async with yamux_and_raw_peer(small_buffers=True) as (muxed, peer, nursery):
        await stuck_writer(muxed, peer, nursery)
        reset_me = YamuxStream(99, muxed, True)  # a stream whose RST must wait its turn
        muxed.streams[99] = reset_me
        muxed.stream_buffers[99] = bytearray()
        muxed.stream_events[99] = trio.Event()
        close_me = YamuxStream(101, muxed, True)
        muxed.streams[101] = close_me
        muxed.stream_buffers[101] = bytearray()
        muxed.stream_events[101] = trio.Event()

        assert await within_its_bound(reset_me.reset) == pytest.approx(flow.STREAM_CLEANUP_S)
        assert reset_me.closed
        assert await within_its_bound(close_me.close) == pytest.approx(flow.STREAM_CLEANUP_S)
        assert close_me.send_closed
        await within_its_bound(muxed.close)  # its GO_AWAY cannot go: the socket is cut
        assert muxed.is_closed


def small_socket_pair() -> tuple[TrioTCPStream, trio.SocketStream]:
    ours, theirs = trio.socket.socketpair()
    for sock in (ours, theirs):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return TrioTCPStream(trio.SocketStream(ours)), trio.SocketStream(theirs)


@pytest.mark.parametrize("peer_reads_after", [0.7, None])
async def test_a_write_cancelled_half_way_is_finished_or_the_connection_closed(
    autojump_clock: trio.abc.Clock, peer_reads_after: float | None
) -> None:
    """A write's bytes are one message the peer expects whole (Noise counted it). Cut
    by a cancellation, it is finished, shielded, if the peer takes it within the grace
    (0.7 s); if not, the connection is closed: the peer never reads a part of it
    followed by anything else."""
    tcp, peer = small_socket_pair()
    message = os.urandom(64 * 1024)
    cut_before = flow.counts()["cut_writes"]
    got = bytearray()

    async def read_later() -> None:
        if peer_reads_after is None:
            return
        await trio.sleep(peer_reads_after)
        with trio.move_on_after(5):  # a message cut short never ends
            while len(got) < len(message):
                got.extend(await peer.receive_some(65536))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_later)
        with trio.move_on_after(0.5) as cancelled:
            await tcp.write(message)  # nobody reads yet: the write blocks
        assert cancelled.cancelled_caught
    if peer_reads_after is not None:
        assert bytes(got) == message
        assert flow.counts()["cut_writes"] == cut_before
        assert tcp.stream.socket.fileno() >= 0  # still open, in step
    else:
        assert flow.counts()["cut_writes"] == cut_before + 1
        assert tcp.stream.socket.fileno() < 0  # closed: what was sent is never continued
        assert trio.current_time() == pytest.approx(0.5 + flow.CANCELLED_WRITE_GRACE_S)
    await tcp.close()
    await peer.aclose()


# --- the RPC client's hang-up ------------------------------------------------------


class StuckHangUp:
    """A host whose close of a connection never ends."""

    peer_id = "client"

    async def hang_up(self, peer_id: str) -> None:
        await trio.sleep(1000)  # virtual: as good as forever


async def test_a_hang_up_whose_close_never_ends_gives_up(autojump_clock: trio.abc.Clock) -> None:
    config = Config()
    client = RpcClient(StuckHangUp(), config.wire, config.timeouts)  # type: ignore[arg-type]
    started = trio.current_time()
    with trio.fail_after(60):
        await client.hang_up("peer")
    assert 0 < trio.current_time() - started <= 10
    assert client.hung_up == 1


async def test_streams_a_peer_opens_and_resets_leave_nothing_behind_on_the_connection() -> None:
    """The library's stream reader put a fresh wake-up event back after the stream was
    finalized: one event per refused or reset stream stayed until the connection
    closed (an outside probe: 2,000 refused requests, 2,000 events, 0 streams)."""
    async with yamux_and_raw_peer() as (muxed, peer, nursery):
        for n in range(50):
            stream_id = 2 * (n + 1)  # the listener's side opens even ids
            await peer.send_all(frame(_yamux.TYPE_DATA, _yamux.FLAG_SYN, stream_id, 2, b"hi"))
            stream = await muxed.accept_stream()
            assert await stream.read(2) == b"hi"
            failed = trio.Event()

            async def read_on(stream: YamuxStream = stream, failed: trio.Event = failed) -> None:
                with pytest.raises((MuxedStreamError, EOFError)):
                    await stream.read(2)
                failed.set()

            nursery.start_soon(read_on)
            await trio.sleep(0.001)  # the reader waits for data
            await peer.send_all(frame(_yamux.TYPE_DATA, _yamux.FLAG_RST, stream_id, 0))
            with trio.fail_after(5):
                await failed.wait()
        await trio.sleep(0.01)
        assert len(muxed.streams) == 0
        assert len(muxed.stream_events) == 0
