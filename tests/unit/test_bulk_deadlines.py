"""How long a bulk reply (``params``, ``shard``) is waited for, on both ends: its caller
waits ``request_s`` for it to begin and then its size at ``BULK_MIN_RATE``; its server
keeps sending as long, longer where its own upload limit shared by ``BULK_AT_ONCE``
replies is slower. A reply cut while it was arriving is ``ReplyTooSlow``, saying how
much came. And a ``params`` reply's body is capped by the caller's own expert's size,
over ``wire.max_body_bytes`` if need be. Over the in-memory network, in virtual time."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from volunteerd.config import Config, LimitsConfig, WireLimits
from volunteerd.errors import RemoteError, ReplyTooLarge, ReplyTooSlow, RequestTimeout
from volunteerd.net import PROTOCOLS, Verb
from volunteerd.net.rpc import (
    BULK_AT_ONCE,
    BULK_MIN_RATE,
    RELAYED_BULK_AT_ONCE,
    Handler,
    Reply,
    Request,
    RpcClient,
    RpcServer,
)
from volunteerd.net.throttle import Throttle
from volunteerd.net.transport import Stream, StreamReset
from volunteerd.testing.memnet import Link, MemoryHost, MemoryNetwork
from volunteerd.wire import TensorMeta, encode_frame
from volunteerd.wire.messages import ParamsReply, ParamsRequest

CONFIG = Config()
REQUEST_S = CONFIG.timeouts.request_s
PREFIX_BYTES = 16
PARAMS = PROTOCOLS[Verb.PARAMS].protocol_id


def params_of(nbytes: int) -> Handler:
    """A ``params`` handler answering one float32 tensor of ``nbytes``."""

    async def params(request: Request) -> Reply:
        meta = TensorMeta(dtype="float32", shape=(nbytes // 4,))
        header = ParamsReply(uid=request.header.uid, updates=0, names=["w"], tensors=[meta])
        return Reply(header, [bytes(nbytes)])

    return params


def params_server(host: MemoryHost, handler: Handler, throttle: Throttle) -> RpcServer:
    """An installed RPC server of ``params`` on ``host``, under ``throttle``."""
    server = RpcServer(
        host, {Verb.PARAMS: handler}, CONFIG.wire, CONFIG.timeouts, CONFIG.peer_limits, throttle
    )
    server.install()
    return server


async def never_answers(request: Request) -> Reply:
    await trio.sleep_forever()
    raise AssertionError


@asynccontextmanager
async def served(
    handler: Handler,
    *,
    link_bytes_per_s: int = 0,
    upload_mbit: float = 0.0,
    client_wire: WireLimits = CONFIG.wire,
) -> AsyncIterator[tuple[MemoryHost, RpcClient, Throttle]]:
    """A server answering ``params`` with ``handler`` under an upload limit of
    ``upload_mbit``, over a link of ``link_bytes_per_s`` to a client whose throttle
    counts what it read."""
    network = MemoryNetwork()
    async with network.open_host() as server_host, network.open_host() as client_host:
        network.set_link(server_host, client_host, Link(bytes_per_s=link_bytes_per_s))
        params_server(server_host, handler, Throttle(LimitsConfig(upload_mbit=upload_mbit)))
        throttle = Throttle(LimitsConfig())
        client = RpcClient(client_host, client_wire, CONFIG.timeouts, throttle=throttle)
        try:
            yield server_host, client, throttle
        finally:
            await client.aclose()


async def test_parameters_slower_than_request_s_arrive_whole(
    autojump_clock: trio.abc.Clock,
) -> None:
    """8 MiB of parameters over a 64 KiB/s uplink take 128 s, twice ``request_s``: they
    arrive whole. Before, the call was cut at ``request_s`` whatever the reply's size
    (an outside audit: 33.5 MB at 2 Mbit/s never arrived)."""
    size = 8 << 20
    async with served(params_of(size), link_bytes_per_s=64 << 10) as (host, client, _):
        started = trio.current_time()
        _, tensors = await client.call(
            host.address, Verb.PARAMS, ParamsRequest(uid="ffn.0.0"), max_body_bytes=size
        )
        took_s = trio.current_time() - started
    assert tensors[0].data.nbytes == size
    assert took_s > 2 * REQUEST_S


async def test_a_reply_below_the_bulk_rate_is_too_slow_and_says_how_much_came(
    autojump_clock: trio.abc.Clock,
) -> None:
    """1 MiB from a server whose upload is limited to 64 kbit/s (8 kB/s) would take 131 s;
    its caller waits ``request_s`` and the reply's size at ``BULK_MIN_RATE`` (32 s):
    ReplyTooSlow then, with what had arrived. (The server, whose own limit is the slow
    part, would have gone on: a reader that slow itself is cut by the server, below.)"""
    size = 1 << 20
    async with served(params_of(size), upload_mbit=0.064) as (host, client, throttle):
        started = trio.current_time()
        with pytest.raises(ReplyTooSlow) as caught:
            await client.call(host.address, Verb.PARAMS, ParamsRequest(uid="ffn.0.0"))
        took_s = trio.current_time() - started
        received = throttle.bytes_down
    assert isinstance(caught.value, RequestTimeout)  # callers that catch that see it
    assert took_s == pytest.approx(REQUEST_S + size / BULK_MIN_RATE, abs=1)
    assert caught.value.received == received
    assert size // 2 < caught.value.received < size < caught.value.declared


async def test_a_callers_own_deadline_cuts_a_reply_but_not_its_start(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``timeout_s``: a reply still arriving then is ReplyTooSlow; one that has not begun
    within ``request_s`` is a RequestTimeout, however long the caller would wait."""
    size = 1 << 20
    async with served(params_of(size), link_bytes_per_s=64 << 10) as (host, client, _):
        started = trio.current_time()
        with pytest.raises(ReplyTooSlow):
            await client.call(
                host.address, Verb.PARAMS, ParamsRequest(uid="ffn.0.0"), timeout_s=10.0
            )
        assert trio.current_time() - started == pytest.approx(10.0, abs=0.5)
    for timeout_s, waited_s in ((3.0, 3.0), (10 * REQUEST_S, REQUEST_S)):
        async with served(never_answers) as (host, client, _):
            started = trio.current_time()
            with pytest.raises(RequestTimeout) as caught:
                await client.call(
                    host.address, Verb.PARAMS, ParamsRequest(uid="ffn.0.0"), timeout_s=timeout_s
                )
            assert not isinstance(caught.value, ReplyTooSlow)
            assert trio.current_time() - started == pytest.approx(waited_s, abs=0.5)


async def test_replies_going_out_at_the_servers_own_limit_are_not_cut(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A server whose upload is limited to 0.5 Mbit/s sends four 4 MiB replies at once,
    ~15.6 KB/s each (268 s), to callers that wait 400 s: all arrive whole. The server
    keeps a bulk reply going for its size at the rate its own limit gives it, below
    BULK_MIN_RATE here; cut at ``request_s`` (before) or at BULK_MIN_RATE, none did."""
    size = 4 << 20
    got: list[int] = []
    network = MemoryNetwork()
    async with network.open_host() as server_host:
        server = params_server(
            server_host, params_of(size), Throttle(LimitsConfig(upload_mbit=0.5))
        )

        async def caller(i: int) -> None:
            async with network.open_host(ip=f"10.0.0.{i}") as host:
                client = RpcClient(host, CONFIG.wire, CONFIG.timeouts)
                _, tensors = await client.call(
                    server_host.address,
                    Verb.PARAMS,
                    ParamsRequest(uid="ffn.0.0"),
                    max_body_bytes=size,
                    timeout_s=400.0,
                )
                got.append(tensors[0].data.nbytes)
                await client.aclose()

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(BULK_AT_ONCE):
                nursery.start_soon(caller, i)
        took_s = trio.current_time() - started
    assert got == [size] * BULK_AT_ONCE
    assert REQUEST_S + size / BULK_MIN_RATE < took_s < 400
    assert "caller_gone" not in server.stats.errors


async def test_a_params_reply_is_capped_by_the_callers_own_size_not_the_wires(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A hidden-4096 expert's 537 MB are over the wire's 256 MiB: its replicas refused
    each other's parameters every round (an outside audit). The cap of a ``params``
    reply is the caller's own size when it gives one; a reply declaring more than that
    is still refused from its prefix. Here the wire's cap is 1 MiB, the expert 2 MiB."""
    size = 2 << 20
    small_wire = WireLimits(max_body_bytes=1 << 20)
    async with served(params_of(size), client_wire=small_wire) as (host, client, throttle):
        _, tensors = await client.call(
            host.address, Verb.PARAMS, ParamsRequest(uid="ffn.0.0"), max_body_bytes=size
        )
        assert tensors[0].data.nbytes == size

        before = throttle.bytes_down
        with pytest.raises(ReplyTooLarge, match=rf"cap of {size - 4}\b"):
            await client.call(
                host.address, Verb.PARAMS, ParamsRequest(uid="ffn.0.0"), max_body_bytes=size - 4
            )
        assert throttle.bytes_down - before == PREFIX_BYTES  # refused from its prefix
        # A caller that gives no size of its own keeps the wire's cap.
        with pytest.raises(ReplyTooLarge, match=rf"cap of {1 << 20}\b"):
            await client.call(host.address, Verb.PARAMS, ParamsRequest(uid="ffn.0.0"))


async def _read_until_cut(stream: Stream) -> int:
    """Read ``stream`` until it ends or is reset; the bytes that came."""
    got = 0
    with contextlib.suppress(StreamReset):
        while data := await stream.read(1 << 20):
            got += len(data)
    return got


async def test_a_reader_far_below_the_bulk_rate_is_cut_and_its_slot_goes_to_the_next(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Four strangers from four addresses hold every bulk slot, each taking its 8 MiB of
    parameters at a tenth of ``BULK_MIN_RATE``: a piece every 20 s, within
    ``frame_read_s``. Each is cut as a slow reader once it fell behind the rate,
    ``request_s`` (its grace) and a few pieces after its reply began, and an honest
    caller asking meanwhile gets a slot then. Before, the strangers held their slots
    until their replies' deadlines (``request_s`` plus 8 MiB at the rate, 316 s), and
    the honest caller was refused ``busy`` until then."""
    size = 8 << 20
    network = MemoryNetwork()
    async with network.open_host() as server_host:
        server = params_server(server_host, params_of(size), Throttle(LimitsConfig()))
        got: list[int] = []
        cut_at: list[float] = []

        async def stranger(i: int) -> None:
            async with network.open_host(ip=f"10.0.0.{i}") as host:
                network.set_link(server_host, host, Link(bytes_per_s=BULK_MIN_RATE / 10))
                stream = await host.open_stream(server_host.address, PARAMS)
                await stream.write(encode_frame(ParamsRequest(uid="ffn.0.0")))
                got.append(await _read_until_cut(stream))
                cut_at.append(trio.current_time())

        async with (
            network.open_host(ip="10.0.1.1") as honest_host,
            trio.open_nursery() as nursery,
        ):
            for i in range(BULK_AT_ONCE):
                nursery.start_soon(stranger, i)
            await trio.sleep(1)
            assert server._bulk.busy == BULK_AT_ONCE
            client = RpcClient(honest_host, CONFIG.wire, CONFIG.timeouts)
            refused: list[str] = []
            while True:
                try:
                    _, tensors = await client.call(
                        server_host.address,
                        Verb.PARAMS,
                        ParamsRequest(uid="ffn.0.0"),
                        max_body_bytes=size,
                    )
                    break
                except RemoteError as exc:
                    refused.append(exc.code)
            served_at = trio.current_time()
            await client.aclose()
    assert tensors[0].data.nbytes == size
    assert server.stats.errors["slow_reader"] == BULK_AT_ONCE
    assert all(n < size // 10 for n in got)
    # behind the rate once request_s and a few 2-second pieces at it had passed
    assert max(cut_at) < REQUEST_S + 10 < REQUEST_S + size / BULK_MIN_RATE
    assert served_at < 2 * REQUEST_S
    assert refused == ["busy"] * len(refused)
    assert len(refused) <= 2


async def test_readers_at_the_bulk_rate_or_behind_the_servers_own_queue_are_not_cut(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Two callers take 8 MiB of parameters: one over a link at exactly
    ``BULK_MIN_RATE``; one over a fast link from a server whose volunteer lowers its
    upload limit from 2 Mbit/s to 0.1 Mbit/s a second after the reply began, for two
    minutes, so that it falls far behind the rate, then catches up. Both arrive whole: the reader's
    pace is counted without the time a piece waited in this node's own queue."""
    size = 8 << 20
    network = MemoryNetwork()
    throttle = Throttle(LimitsConfig(upload_mbit=2.0))
    async with network.open_host() as server_host:
        server = params_server(server_host, params_of(size), throttle)
        took: dict[str, float] = {}

        async def caller(name: str, link: Link) -> None:
            async with network.open_host(ip=f"10.0.1.{len(took) + 1}") as host:
                network.set_link(server_host, host, link)
                client = RpcClient(host, CONFIG.wire, CONFIG.timeouts)
                started = trio.current_time()
                _, tensors = await client.call(
                    server_host.address,
                    Verb.PARAMS,
                    ParamsRequest(uid="ffn.0.0"),
                    max_body_bytes=size,
                )
                assert tensors[0].data.nbytes == size
                took[name] = trio.current_time() - started
                await client.aclose()

        await caller("at the rate", Link(bytes_per_s=BULK_MIN_RATE, latency_s=0.2))
        async with trio.open_nursery() as nursery:
            sent_before = throttle.bytes_up
            nursery.start_soon(caller, "behind the own queue", Link())
            await trio.sleep(1)
            throttle.set_rates(0.1, 0)
            await trio.sleep(119)
            behind_by = BULK_MIN_RATE * 120 - (throttle.bytes_up - sent_before)
            throttle.set_rates(2.0, 0)
    assert "slow_reader" not in server.stats.errors
    assert took["at the rate"] == pytest.approx(size / BULK_MIN_RATE, rel=0.05)
    assert behind_by > BULK_MIN_RATE * REQUEST_S  # counted whole, it fell behind
    assert took["behind the own queue"] < REQUEST_S + size / BULK_MIN_RATE


async def test_the_pace_follows_an_upload_limit_lifted_during_the_reply(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A stranger asks for 8 MiB of parameters while the volunteer's upload limit is
    0.1 Mbit/s (the pace: a quarter of it), the limit is lifted a second later, and the
    stranger reads at 4 KiB/s: it is cut as a slow reader about ``request_s`` after its
    reply began, as on a reply begun without a limit. With the pace taken once, at the
    reply's start, it held its bulk slot 2168 s."""
    size = 8 << 20
    network = MemoryNetwork()
    throttle = Throttle(LimitsConfig(upload_mbit=0.1))
    async with network.open_host() as server_host:
        server = params_server(server_host, params_of(size), throttle)
        async with network.open_host(ip="10.0.0.9") as host, trio.open_nursery() as nursery:
            network.set_link(server_host, host, Link(bytes_per_s=4 << 10))
            began = trio.current_time()
            stream = await host.open_stream(server_host.address, PARAMS)
            await stream.write(encode_frame(ParamsRequest(uid="ffn.0.0")))
            nursery.start_soon(_read_until_cut, stream)
            await trio.sleep(1)
            throttle.set_rates(0, 0)
            with trio.fail_after(3 * REQUEST_S):
                while server._bulk.busy:  # noqa: ASYNC110
                    await trio.sleep(1)
            held_s = trio.current_time() - began
            nursery.cancel_scope.cancel()
    assert server.stats.errors["slow_reader"] == 1
    assert held_s < 2 * REQUEST_S


async def test_relayed_callers_hold_at_most_two_bulk_slots_together(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Four identities of one machine behind a relay (no address: each its own party)
    ask for parameters over a slow link: they hold ``RELAYED_BULK_AT_ONCE`` of the
    slots, and a caller from an address of its own still gets one at once. Before, they
    held all ``BULK_AT_ONCE``, and that caller was refused ``busy``."""
    size = 8 << 20
    network = MemoryNetwork()
    async with network.open_host() as server_host:
        server = params_server(server_host, params_of(size), Throttle(LimitsConfig()))
        async with trio.open_nursery() as nursery:
            for _ in range(BULK_AT_ONCE):
                relayed = await nursery.start(_asks_and_stalls, network, server_host, None)
                assert relayed.ip is None  # its streams come from no known address
            await trio.sleep(1)
            assert server._bulk.busy == RELAYED_BULK_AT_ONCE
            async with network.open_host(ip="10.0.1.1") as honest_host:
                client = RpcClient(honest_host, CONFIG.wire, CONFIG.timeouts)
                with trio.fail_after(5):  # at once, not after a stalled reader is cut
                    _, tensors = await client.call(
                        server_host.address,
                        Verb.PARAMS,
                        ParamsRequest(uid="ffn.0.0"),
                        max_body_bytes=size,
                    )
                await client.aclose()
            nursery.cancel_scope.cancel()
    assert tensors[0].data.nbytes == size


async def _asks_and_stalls(
    network: MemoryNetwork,
    server_host: MemoryHost,
    ip: str | None,
    *,
    task_status: trio.TaskStatus[MemoryHost] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A host at ``ip`` that asks ``server_host`` for parameters over a slow link and
    reads nothing."""
    async with network.open_host(ip=ip) as host:
        network.set_link(server_host, host, Link(bytes_per_s=BULK_MIN_RATE))
        stream = await host.open_stream(server_host.address, PARAMS)
        await stream.write(encode_frame(ParamsRequest(uid="ffn.0.0")))
        task_status.started(host)
        await trio.sleep_forever()
