"""The in-memory network (volunteerd/testing/memnet.py): its links keep the latency,
bandwidth, jitter, loss and partitions they are given, in virtual time, under the real
RpcServer and RpcClient. Every duration asserted here is trio's (mock) clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import torch
import trio

from volunteerd.config import Config, TimeoutsConfig
from volunteerd.errors import PeerError, PeerUnreachable, RequestTimeout
from volunteerd.experts import from_wire, to_wire
from volunteerd.net.peers import PeerAddress
from volunteerd.net.protocols import Verb
from volunteerd.net.rpc import Reply, Request, RpcClient, RpcServer
from volunteerd.net.throttle import BYTES_PER_MBIT
from volunteerd.net.transport import Stream, StreamReset
from volunteerd.testing.memnet import Link, MemoryHost, MemoryNetwork, MemoryStream
from volunteerd.wire import BackwardRequest, ForwardRequest, TensorMeta, TensorReply

CONFIG = Config()
TINY = TensorMeta(dtype="float32", shape=(1,))


async def answer_tiny(request: Request) -> Reply:
    """A forward that answers one float whatever it is sent."""
    return Reply(TensorReply(tensors=[TINY]), [bytes(4)])


@asynccontextmanager
async def server_and_client(
    network: MemoryNetwork, link: Link
) -> AsyncIterator[tuple[MemoryHost, MemoryHost, RpcClient]]:
    async with network.open_host() as server_host, network.open_host() as client_host:
        network.set_link(server_host, client_host, link)
        server = RpcServer(
            server_host,
            {Verb.FORWARD: answer_tiny},
            CONFIG.wire,
            CONFIG.timeouts,
            CONFIG.peer_limits,
        )
        server.install()
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        try:
            yield server_host, client_host, client
        finally:
            await client.aclose()


async def forward(
    client: RpcClient, host: MemoryHost | PeerAddress, payload_bytes: int = 4
) -> float:
    """Seconds (virtual) one forward of ``payload_bytes`` takes."""
    meta = TensorMeta(dtype="float32", shape=(payload_bytes // 4,))
    address = host if isinstance(host, PeerAddress) else host.address
    started = trio.current_time()
    reply, _ = await client.call(
        address, Verb.FORWARD, ForwardRequest(uid="ffn.0", tensors=[meta]), [bytes(meta.nbytes)]
    )
    assert reply.tensors == [TINY]
    return trio.current_time() - started


async def test_a_100ms_link_gives_a_200ms_round_trip(autojump_clock: trio.abc.Clock) -> None:
    async with server_and_client(MemoryNetwork(), Link(latency_s=0.1)) as (host, _, client):
        # The first call also connects: one more round trip.
        assert await forward(client, host) == pytest.approx(0.4)
        assert await forward(client, host) == pytest.approx(0.2)
        assert await forward(client, host) == pytest.approx(0.2)


async def test_ten_megabits_move_1_25_megabytes_a_second(autojump_clock: trio.abc.Clock) -> None:
    link = Link(bytes_per_s=10 * BYTES_PER_MBIT)
    async with server_and_client(MemoryNetwork(), link) as (host, _, client):
        await forward(client, host)  # connected
        took = await forward(client, host, 2_500_000)
        assert 2.0 <= took <= 2.001  # 2.5 MB, and a few hundred bytes of headers


async def test_streams_of_one_link_share_its_bandwidth(autojump_clock: trio.abc.Clock) -> None:
    link = Link(bytes_per_s=10 * BYTES_PER_MBIT)
    async with server_and_client(MemoryNetwork(), link) as (host, _, client):
        await forward(client, host)
        took: list[float] = []

        async def one() -> None:
            took.append(await forward(client, host, 1_250_000))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
        # 2.5 MB in all over one 1.25 MB/s wire: the later one ends after 2 s, and
        # the earlier one no sooner than a 64 KiB segment before it (they interleave).
        assert 2.0 <= max(took) <= 2.001
        assert min(took) >= 2.0 - 2 * 65536 / link.bytes_per_s


async def test_a_partition_fails_calls_with_typed_errors_until_healed(
    autojump_clock: trio.abc.Clock,
) -> None:
    network = MemoryNetwork(default=Link(latency_s=0.01))
    timeouts = CONFIG.timeouts
    async with (
        server_and_client(network, Link(latency_s=0.01)) as (host, client_host, client),
        network.open_host() as stranger_host,
    ):
        stranger = RpcClient(stranger_host, CONFIG.wire, timeouts)
        await forward(client, host)
        network.partition([host], [client_host, stranger_host])
        # Connected before: the request stalls, and no reply comes within request_s.
        started = trio.current_time()
        with pytest.raises(RequestTimeout):
            await forward(client, host)
        assert trio.current_time() - started == pytest.approx(timeouts.request_s)
        # Not connected: the connection attempt goes unanswered for connect_s.
        started = trio.current_time()
        with pytest.raises(PeerUnreachable):
            await forward(stranger, host)
        assert trio.current_time() - started == pytest.approx(timeouts.connect_s)
        network.heal()
        assert await forward(client, host) == pytest.approx(0.02)
        assert await forward(stranger, host) == pytest.approx(0.04)  # connects first
        await stranger.aclose()


async def test_a_host_that_left_is_refused_at_once(autojump_clock: trio.abc.Clock) -> None:
    network = MemoryNetwork()
    async with network.open_host() as client_host:
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        async with network.open_host() as server_host:
            RpcServer(
                server_host,
                {Verb.FORWARD: answer_tiny},
                CONFIG.wire,
                CONFIG.timeouts,
                CONFIG.peer_limits,
            ).install()
            await forward(client, server_host)
            address = server_host.address
        started = trio.current_time()
        with pytest.raises(PeerError):  # the pooled stream was reset
            await forward(client, address)
        with pytest.raises(PeerUnreachable, match="refused"):
            await forward(client, address)
        assert trio.current_time() == started
        assert not client_host.connected(address.peer_id)


async def test_an_unserved_protocol_is_unreachable(autojump_clock: trio.abc.Clock) -> None:
    network = MemoryNetwork()
    async with network.open_host() as a, network.open_host() as b:
        with pytest.raises(PeerUnreachable, match="not supported"):
            await a.open_stream(b.address, "/volunteerd/forward/1")


async def raw_pair(
    network: MemoryNetwork, a: MemoryHost, b: MemoryHost
) -> tuple[Stream, trio.MemoryReceiveChannel[Stream]]:
    send, receive = trio.open_memory_channel[Stream](1)

    async def accept(stream: Stream) -> None:
        await send.send(stream)

    b.set_stream_handler("/test/1", accept)
    return await a.open_stream(b.address, "/test/1"), receive


async def read_all(stream: Stream) -> bytes:
    out = bytearray()
    while chunk := await stream.read(1 << 20):
        out += chunk
    return bytes(out)


async def test_loss_delays_but_delivers_every_byte_in_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    data = bytes(i % 251 for i in range(200 * 1024))
    took = {}
    for loss in (0.0, 0.3):
        network = MemoryNetwork(seed=7, segment_bytes=1024)
        async with network.open_host() as a, network.open_host() as b:
            network.set_link(a, b, Link(latency_s=0.01, loss=loss, retransmit_s=0.2))
            stream, accepted = await raw_pair(network, a, b)
            started = trio.current_time()
            await stream.write(data)
            await stream.close()
            assert await read_all(await accepted.receive()) == data
            took[loss] = trio.current_time() - started
    assert took[0.0] == pytest.approx(0.01)
    assert took[0.3] >= took[0.0] + 0.2  # at least one of 200 segments was re-sent


async def test_jitter_never_reorders_a_streams_bytes(autojump_clock: trio.abc.Clock) -> None:
    network = MemoryNetwork(seed=3)
    async with network.open_host() as a, network.open_host() as b:
        network.set_link(a, b, Link(latency_s=0.05, jitter_s=0.05))
        stream, accepted = await raw_pair(network, a, b)
        for i in range(500):
            await stream.write(i.to_bytes(2, "big"))
        await stream.close()
        got = await read_all(await accepted.receive())
    assert [int.from_bytes(got[i : i + 2], "big") for i in range(0, len(got), 2)] == list(
        range(500)
    )


async def test_the_same_seed_gives_the_same_timings(autojump_clock: trio.abc.Clock) -> None:
    async def run(seed: int) -> list[float]:
        network = MemoryNetwork(seed=seed, segment_bytes=512)
        async with network.open_host() as a, network.open_host() as b:
            network.set_link(a, b, Link(latency_s=0.02, jitter_s=0.03, loss=0.1))
            stream, accepted = await raw_pair(network, a, b)
            await stream.write(bytes(64 * 1024))
            await stream.close()
            inbound = await accepted.receive()
            started, arrivals = trio.current_time(), []
            while await inbound.read(512):
                arrivals.append(trio.current_time() - started)
            return arrivals

    assert await run(5) == pytest.approx(await run(5))
    assert await run(5) != pytest.approx(await run(6))


async def test_a_reset_reaches_the_peer_and_breaks_both_ends(
    autojump_clock: trio.abc.Clock,
) -> None:
    network = MemoryNetwork(default=Link(latency_s=0.1))
    async with network.open_host() as a, network.open_host() as b:
        stream, accepted = await raw_pair(network, a, b)
        await stream.write(b"hello")
        inbound = await accepted.receive()
        await stream.reset()
        with pytest.raises(StreamReset):
            await inbound.read(10)  # the reset overtakes the data still in flight
        with pytest.raises(StreamReset):
            await stream.write(b"more")


async def test_tensors_survive_the_trip(autojump_clock: trio.abc.Clock) -> None:
    """Bytes are not only timed right but delivered intact through the RPC layer."""

    async def echo(request: Request) -> Reply:
        return Reply(
            TensorReply(tensors=[t.meta for t in request.tensors]),
            [t.data for t in request.tensors],
        )

    network = MemoryNetwork(default=Link(latency_s=0.003, bytes_per_s=5e6, jitter_s=0.002))
    async with network.open_host() as server_host, network.open_host() as client_host:
        RpcServer(
            server_host, {Verb.FORWARD: echo}, CONFIG.wire, CONFIG.timeouts, CONFIG.peer_limits
        ).install()
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        x = torch.randn(300, 257)
        meta, data = to_wire(x)
        _, tensors = await client.call(
            server_host.address, Verb.FORWARD, ForwardRequest(uid="ffn.0", tensors=[meta]), [data]
        )
        assert torch.equal(from_wire(tensors[0]), x)
        await client.aclose()


async def _client_and_servers(
    stack: AsyncExitStack, count: int
) -> tuple[MemoryHost, RpcClient, list[MemoryHost]]:
    """A client's host and RpcClient, and ``count`` hosts answering forwards, on one
    memory network, closed with ``stack``."""
    network = MemoryNetwork()
    client_host = await stack.enter_async_context(network.open_host())
    servers = [await stack.enter_async_context(network.open_host()) for _ in range(count)]
    for host in servers:
        RpcServer(
            host, {Verb.FORWARD: answer_tiny}, CONFIG.wire, CONFIG.timeouts, CONFIG.peer_limits
        ).install()
    client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
    stack.push_async_callback(client.aclose)
    return client_host, client, servers


async def test_stale_pooled_streams_go_together_on_the_next_call_to_anyone(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client keeps a pooled stream per peer it called; those idle for
    ``pool_idle_s`` are closed on its next call to any peer, all at once: twenty peers
    whose close never completes cost that call about a second (each close's own limit),
    not twenty."""
    async with AsyncExitStack() as stack:
        _, client, servers = await _client_and_servers(stack, 21)
        for host in servers[:20]:
            await forward(client, host)
        assert client.pooled_streams() == 20

        async def never(self: MemoryStream) -> None:
            await trio.sleep_forever()

        monkeypatch.setattr(MemoryStream, "close", never)
        await trio.sleep(CONFIG.timeouts.pool_idle_s + 1)
        took = await forward(client, servers[20])
        assert client.pooled_streams() == 1
        assert took < 3.0


async def test_pooled_streams_a_client_forgets_are_closed_by_its_next_call(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``forget`` (a peer believed gone, or now reached directly) dropped its pooled
    streams unclosed: they stayed open on both sides for as long as the connection lived
    on. The next call, to anyone, closes them."""
    async with AsyncExitStack() as stack:
        client_host, client, servers = await _client_and_servers(stack, 2)

        def open_to(host: MemoryHost) -> int:
            return sum(s.remote_peer_id == host.peer_id for s in client_host._streams)

        await forward(client, servers[0])
        assert open_to(servers[0]) == 1  # pooled
        client.forget(servers[0].peer_id)
        assert client.pooled_streams() == 0
        await forward(client, servers[1])
        assert open_to(servers[0]) == 0


@pytest.mark.parametrize("crowded", [False, True])
async def test_a_parked_stream_waits_less_for_its_next_request_while_slots_are_short(
    autojump_clock: trio.testing.MockClock, crowded: bool
) -> None:
    # An open stream keeps its connection from counting as idle: strangers that made one
    # request each and kept the stream held their slots for stream_idle_s (120 s) before
    # trimming could start; an honest newcomer waited 2.5 minutes (an outside probe).
    network = MemoryNetwork(default=Link(latency_s=0.001))
    async with network.open_host() as server_host, network.open_host() as client_host:
        server = RpcServer(
            server_host,
            {Verb.FORWARD: answer_tiny},
            CONFIG.wire,
            CONFIG.timeouts,
            CONFIG.peer_limits,
        )
        server.crowded = lambda: crowded
        server.install()
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        try:
            await forward(client, server_host)
            peer = client_host.peer_id
            assert server.open_streams(peer) == 1  # kept by the client's pool
            await trio.sleep(CONFIG.timeouts.connection_idle_s + 1)
            assert server.open_streams(peer) == (0 if crowded else 1)
            await trio.sleep(CONFIG.timeouts.stream_idle_s)
            assert server.open_streams(peer) == 0
        finally:
            await client.aclose()


@asynccontextmanager
async def backwards_to(
    server_timeouts: TimeoutsConfig, *, crowded: bool = False, takes_s: float = 0.0
) -> AsyncIterator[tuple[Callable[[], Awaitable[TensorReply]], list[float]]]:
    """A server of ``server_timeouts`` answering backwards (each takes ``takes_s``), and
    a client of the default timeouts: (send one backward, when each one ran)."""
    ran: list[float] = []

    async def backward(request: Request) -> Reply:
        await trio.sleep(takes_s)  # a backward waiting for its batch, then computing
        ran.append(trio.current_time())
        return await answer_tiny(request)

    network = MemoryNetwork(default=Link(latency_s=0.001))
    async with network.open_host() as server_host, network.open_host() as client_host:
        server = RpcServer(
            server_host, {Verb.BACKWARD: backward}, CONFIG.wire, server_timeouts, CONFIG.peer_limits
        )
        server.crowded = lambda: crowded
        server.install()
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        header = BackwardRequest(uid="ffn.0", tensors=[TINY])

        async def send() -> TensorReply:
            reply, _ = await client.call(server_host.address, Verb.BACKWARD, header, [bytes(4)])
            return reply  # type: ignore[no-any-return]

        try:
            yield send, ran
        finally:
            await client.aclose()


async def test_a_request_sent_late_in_its_streams_idle_time_is_answered_in_full(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The server's idle timeout bounded the whole request, not only the wait for its
    first byte: a backward sent on a pooled stream shortly before that timeout was cut
    while it ran (its gradients were in, its caller told "stream closed")."""
    short = CONFIG.timeouts.model_copy(update={"stream_idle_s": 16.0, "pool_idle_s": 15.0})
    async with backwards_to(short, takes_s=2.0) as (send, ran):
        await send()
        await trio.sleep(14.5)  # still fresh for the client (15 s), 1.5 s to the idle end
        assert (await send()).tensors == [TINY]
        assert len(ran) == 2


async def test_a_crowded_server_never_closes_a_stream_the_client_still_reuses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """While its inbound slots are short a server closes streams idle for
    connection_idle_s (30 s), less than the pool's 60 s: a backward (not tried again on
    a fresh stream) sent after 31 s failed "stream closed" and its gradients were lost."""
    async with backwards_to(CONFIG.timeouts, crowded=True) as (send, ran):
        for idle in (1.0, CONFIG.timeouts.connection_idle_s / 2 - 1, 31.0, 59.0):
            await send()
            await trio.sleep(idle)
        assert (await send()).tensors == [TINY]
        assert len(ran) == 5


async def test_a_backward_on_a_stream_a_server_of_shorter_idle_times_closed_goes_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The pool reckons with this client's own idle times: a crowded server that closes
    streams idle for 10 s (its connection_idle_s) closed the stream before the backward
    sent on it after 12 s was read, and the backward failed "stream closed" (a backward
    is not sent twice). A stream the server closed cleanly before any reply byte carried
    no request it read: it is sent once more on a fresh stream, and answered once."""
    hasty = CONFIG.timeouts.model_copy(update={"connection_idle_s": 10.0})
    async with backwards_to(hasty, crowded=True) as (send, ran):
        await send()
        await trio.sleep(12.0)  # fresh for this client (15 s), closed by the server
        assert (await send()).tensors == [TINY]
        assert len(ran) == 2
