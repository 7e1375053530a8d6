"""Per-peer limits of the real RpcServer on memory links: slow senders are dropped after
``frame_read_s``, a peer's streams are capped, floods and byte hogs get ``rate_limited``,
and a well-behaved peer is served all the while. The server answers from a stub (no
compute), so the stream tests run in virtual time. The rate and byte buckets refill on
the wall clock: those tests run in real time and bound only what the attacker got."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from volunteerd.config import Config
from volunteerd.errors import PeerError, RemoteError
from volunteerd.net import PROTOCOLS, Handler, Reply, Request, RpcClient, RpcServer, Verb
from volunteerd.net.throttle import BYTES_PER_MBIT, Throttle
from volunteerd.testing.clients import read_reply, trickle
from volunteerd.testing.memnet import MemoryHost, MemoryNetwork
from volunteerd.wire import ForwardRequest, TensorMeta, TensorReply, encode_frame

FORWARD = PROTOCOLS[Verb.FORWARD].protocol_id


async def echo(request: Request) -> Reply:
    return Reply(TensorReply(tensors=[request.header.tensors[0]]), [request.tensors[0].data])


@dataclass
class Setup:
    server: RpcServer
    server_host: MemoryHost
    good: RpcClient
    attacker_host: MemoryHost
    attacker: RpcClient


@asynccontextmanager
async def serving(**sections: dict[str, Any]) -> AsyncIterator[Setup]:
    """A server answering forwards at once, a good client and an attacker."""
    config = Config.model_validate(sections)
    network = MemoryNetwork()
    async with (
        network.open_host() as server_host,
        network.open_host() as good_host,
        network.open_host() as attacker_host,
    ):
        server = RpcServer(
            server_host,
            {Verb.FORWARD: echo},
            config.wire,
            config.timeouts,
            config.peer_limits,
            Throttle(config.limits) if "limits" in sections else None,
        )
        server.install()
        good = RpcClient(good_host, config.wire, config.timeouts)
        attacker = RpcClient(attacker_host, config.wire, config.timeouts)
        try:
            yield Setup(server, server_host, good, attacker_host, attacker)
        finally:
            await good.aclose()
            await attacker.aclose()


def forward_frame(rows: int = 2) -> tuple[ForwardRequest, bytes]:
    meta = TensorMeta(dtype="float32", shape=(rows, 32))
    return ForwardRequest(uid="ffn.0.0", tensors=[meta]), bytes(meta.nbytes)


async def forward(client: RpcClient, setup: Setup, rows: int = 2) -> None:
    header, data = forward_frame(rows)
    reply, _ = await client.call(setup.server_host.address, Verb.FORWARD, header, [data])
    assert reply.tensors[0].shape == (rows, 32)


async def test_slow_senders_are_dropped_and_streams_capped_while_a_good_client_is_served(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with serving(timeouts={"frame_read_s": 1.0}, peer_limits={"max_streams": 8}) as setup:
        address = setup.server_host.address
        header, data = forward_frame()
        frame = encode_frame(header, [data])
        idle = [await setup.attacker_host.open_stream(address, FORWARD) for _ in range(4)]
        drop_after_s: list[float] = []
        served = 0

        async def loris() -> None:
            stream = await setup.attacker_host.open_stream(address, FORWARD)
            drop_after_s.append(await trickle(stream, frame, every_s=0.2))

        async def good_client() -> None:
            nonlocal served
            with trio.move_on_after(4.0):
                while True:
                    await forward(setup.good, setup)
                    served += 1
                    await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(loris)
            nursery.start_soon(good_client)
            await trio.sleep(0.3)  # 4 idle + 4 trickling streams: the attacker's cap
            for _ in range(2):
                stream = await setup.attacker_host.open_stream(address, FORWARD)
                reply = await read_reply(stream, Config().wire)
                assert reply["code"] == "rate_limited"
                assert "streams" in reply["message"]

        assert drop_after_s == [pytest.approx(1.0)] * 4, "frame_read_s after the first byte"
        assert served >= 40
        stats = setup.server.stats
        assert stats.errors["slow_sender"] == 4
        assert stats.refused == {(setup.attacker_host.peer_id, "streams"): 2}
        for stream in idle:
            await stream.reset()
        await forward(setup.good, setup)


async def test_a_peer_that_does_not_take_its_reply_gives_back_the_budget(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A peer that stops reading once its request is in (here: a cable pulled out; in
    the wild, a reader that grants Yamux a few bytes of window now and then) holds its
    reply, and its request's and reply's bytes in flight, for at most frame_read_s per
    64 KiB piece: then the stream is reset and other peers get the room."""
    sections = {"wire": {"max_inflight_mib": 1}, "timeouts": {"frame_read_s": 1.0}}
    async with serving(**sections) as setup:  # type: ignore[arg-type]
        address = setup.server_host.address
        header, data = forward_frame(rows=6144)  # 768 KiB, and as much again for the reply
        stream = await setup.attacker_host.open_stream(address, FORWARD)
        await stream.write(encode_frame(header, [data]))
        network = setup.server_host.network
        network.partition([setup.attacker_host], [setup.server_host])
        with trio.fail_after(0.5):
            while setup.server.inflight_bytes < len(data):  # noqa: ASYNC110 - polling
                await trio.sleep(0.01)
        await trio.sleep(0.1)  # answered: the reply's bytes count too while it waits
        assert setup.server.inflight_bytes > 2 * len(data)
        with pytest.raises(RemoteError) as busy:
            await forward(setup.good, setup, rows=4096)  # 512 KiB: over the budget now
        assert busy.value.code == "busy"
        stalled_at = trio.current_time()
        refusals: list[str] = []
        with trio.fail_after(5):
            while True:
                try:
                    await forward(setup.good, setup, rows=4096)
                    break
                except RemoteError as exc:
                    refusals.append(exc.code)
                    await trio.sleep(0.1)
        assert set(refusals) <= {"busy"}
        assert trio.current_time() - stalled_at == pytest.approx(1.0, abs=0.2)
        assert setup.server.stats.errors["slow_reader"] == 1
        assert setup.server.inflight_bytes == 0
        network.heal()


async def test_replies_queued_behind_the_own_upload_limit_are_not_slow_readers(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A volunteer with a low upload limit answering many calls at once: each 64 KiB
    piece of a reply waits its turn in the node's own upload bucket, here for up to
    ~40 s, far past frame_read_s. That wait is this node's queue, not the reader's
    slowness: every caller, reading promptly, gets its whole reply (the server used to
    reset their streams as slow readers)."""
    sections = {
        "limits": {"upload_mbit": 0.1},  # 12.5 kB/s
        "timeouts": {"frame_read_s": 1.0, "request_s": 300.0},
    }
    async with serving(**sections) as setup:  # type: ignore[arg-type]
        rows = 512  # 64 KiB each way: one piece per reply
        done: list[float] = []
        started = trio.current_time()

        async def caller() -> None:
            await forward(setup.good, setup, rows=rows)
            done.append(trio.current_time() - started)

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(caller)
        assert len(done) == 8
        assert setup.server.stats.errors.get("slow_reader", 0) == 0
        # paced by the limit all the same: 8 pieces of 64 KiB at 12.5 kB/s (the first
        # passes on the bucket's burst)
        assert max(done) == pytest.approx(7 * 64 * 1024 / (0.1 * BYTES_PER_MBIT), rel=0.05)


RATE, BURST = 8, 8


async def test_a_flooding_peer_is_rate_limited_while_a_good_client_is_served() -> None:
    limits = {"requests_per_s": RATE, "request_burst": BURST, "max_streams": 4}
    async with serving(peer_limits=limits) as setup:
        outcomes: Counter[str] = Counter()

        async def flood() -> None:
            while True:
                try:
                    await forward(setup.attacker, setup)
                    outcomes["ok"] += 1
                except RemoteError as exc:
                    outcomes[exc.code] += 1
                except PeerError as exc:  # a stream closed under a refusal
                    outcomes[type(exc).__name__] += 1

        started = time.monotonic()  # the buckets' clock
        async with trio.open_nursery() as nursery:
            for _ in range(12):  # beyond the stream cap, far beyond the request rate
                nursery.start_soon(flood)
            for _ in range(10):  # within its own rate, every one of them succeeds
                await forward(setup.good, setup)
                await trio.sleep(1 / RATE)
            nursery.cancel_scope.cancel()
        flood_s = time.monotonic() - started

        stats = setup.server.stats
        attacker = setup.attacker_host.peer_id
        assert outcomes["rate_limited"] > 0, outcomes
        assert outcomes["ok"] <= BURST + RATE * (flood_s + 1), outcomes
        assert stats.refused.get((attacker, "requests"), 0) > 0
        assert stats.refused.get((attacker, "streams"), 0) > 0
        assert stats.errors["rate_limited"] == sum(stats.refused.values())
        assert {peer for peer, _ in stats.refused} == {attacker}
        # The attacker is served again once it slows down.
        with trio.fail_after(30):
            while True:
                await trio.sleep(2 / RATE)
                try:
                    await forward(setup.attacker, setup)
                    break
                except PeerError:
                    pass


async def test_a_peer_over_its_byte_budget_is_rate_limited_and_others_are_not() -> None:
    # A 64 KiB burst refilled at 1 KiB a second; a 64-row request is 8 KiB of tensors.
    budget = {"inbound_mib_per_s": 1 / 1024, "inbound_burst_mib": 1 / 16}
    async with serving(peer_limits=budget) as setup:
        codes: Counter[str] = Counter()
        for _ in range(20):
            try:
                await forward(setup.attacker, setup, rows=64)
                codes["ok"] += 1
            except RemoteError as exc:
                codes[exc.code] += 1
        assert codes["ok"] >= 7, codes  # the burst
        assert codes["rate_limited"] > 0, codes
        assert setup.server.stats.refused[(setup.attacker_host.peer_id, "bytes")] > 0
        await forward(setup.good, setup, rows=64)


async def serve_echo(
    stack: AsyncExitStack, network: MemoryNetwork, config: Config, handler: Handler = echo
) -> tuple[MemoryHost, RpcServer]:
    """An RpcServer answering forwards with ``handler``, on a host at 198.51.100.1 that
    stays up until ``stack`` closes."""
    host = await stack.enter_async_context(network.open_host(ip="198.51.100.1"))
    server = RpcServer(
        host, {Verb.FORWARD: handler}, config.wire, config.timeouts, config.peer_limits
    )
    server.install()
    return host, server


async def test_identities_at_one_address_share_its_budget_and_other_addresses_are_served() -> None:
    """Identities cost nothing: eight of them at one address, each within its own rate,
    together get the address's budget (two peers' worth), not eight; a peer at another
    address is served throughout, and so is one on loopback (exempt by default)."""
    config = Config.model_validate(
        {"peer_limits": {"requests_per_s": RATE, "request_burst": BURST, "per_address": 2}}
    )
    network = MemoryNetwork()
    async with AsyncExitStack() as stack:
        server_host, server = await serve_echo(stack, network, config)
        setup = Setup(server, server_host, None, None, None)  # type: ignore[arg-type]

        async def client(ip: str) -> tuple[MemoryHost, RpcClient]:
            host = await stack.enter_async_context(network.open_host(ip=ip))
            rpc = RpcClient(host, config.wire, config.timeouts)
            stack.push_async_callback(rpc.aclose)
            return host, rpc

        sybils = [await client("203.0.113.7") for _ in range(7)]
        sybils.append(await client("::ffff:203.0.113.7"))  # the same address, IPv4-mapped
        _, good = await client("198.51.100.2")
        _, local = await client("127.0.0.1")
        outcomes: Counter[str] = Counter()

        async def sybil(rpc: RpcClient) -> None:
            while True:
                try:
                    await forward(rpc, setup)
                    outcomes["ok"] += 1
                except RemoteError as exc:
                    outcomes[exc.code] += 1
                except PeerError as exc:  # a stream closed under a refusal
                    outcomes[type(exc).__name__] += 1
                await trio.sleep(1.5 / RATE)  # within its own rate

        started = time.monotonic()  # the buckets' clock
        async with trio.open_nursery() as nursery:
            for _, rpc in sybils:
                nursery.start_soon(sybil, rpc)
            for _ in range(12):  # each within its own rate: every one succeeds
                await forward(good, setup)
                await forward(local, setup)
                await trio.sleep(1 / RATE)
            nursery.cancel_scope.cancel()
        flood_s = time.monotonic() - started

    assert outcomes["ok"] <= 2 * (BURST + RATE * (flood_s + 1)), outcomes
    assert outcomes["rate_limited"] > 0, outcomes
    refused = Counter(reason for _, reason in server.stats.refused)
    assert set(refused) == {"address_requests"}, refused
    assert {peer for peer, _ in server.stats.refused} <= {h.peer_id for h, _ in sybils}


async def test_streams_of_one_address_are_capped_together(
    autojump_clock: trio.abc.Clock,
) -> None:
    config = Config.model_validate({"peer_limits": {"max_streams": 2, "per_address": 2}})
    network = MemoryNetwork()
    async with AsyncExitStack() as stack:
        server_host, server = await serve_echo(stack, network, config)
        address = server_host.address
        hosts = [
            await stack.enter_async_context(network.open_host(ip="2001:db8:1:2::5"))
            for _ in range(3)
        ]
        # Another host in the same IPv6 /64 counts against the same address.
        hosts.append(await stack.enter_async_context(network.open_host(ip="2001:db8:1:2::9")))
        other = await stack.enter_async_context(network.open_host(ip="2001:db8:1:3::5"))
        held = [await h.open_stream(address, FORWARD) for h in hosts[:2] for _ in range(2)]
        await trio.sleep(0.1)  # four streams held open, two identities: the /64's cap
        for host in hosts[2:]:
            stream = await host.open_stream(address, FORWARD)
            reply = await read_reply(stream, config.wire)
            assert reply["code"] == "rate_limited"
            assert "from one address" in reply["message"]
        # Another /64 is not touched by it.
        rpc = RpcClient(other, config.wire, config.timeouts)
        stack.push_async_callback(rpc.aclose)
        header, data = forward_frame()
        reply_header, _ = await rpc.call(address, Verb.FORWARD, header, [data])
        assert reply_header.tensors[0].shape == (2, 32)
        refused = server.stats.refused
        assert refused == {(h.peer_id, "address_streams"): 1 for h in hosts[2:]}
        # Streams closed give the address its slots back.
        for stream in held[:2]:
            await stream.reset()
        await trio.sleep(0.1)
        stream = await hosts[3].open_stream(address, FORWARD)
        await stream.write(encode_frame(header, [data]))
        reply = await read_reply(stream, config.wire)
        assert "code" not in reply, reply


@pytest.mark.parametrize(
    ("ip", "limit_loopback", "address"),
    [
        ("203.0.113.7", False, "203.0.113.7"),
        ("::ffff:203.0.113.7", False, "203.0.113.7"),
        ("2001:db8:1:2:aaaa::5", False, "2001:db8:1:2::/64"),
        ("127.0.0.1", False, None),
        ("::1", False, None),
        ("127.0.0.1", True, "127.0.0.1"),
        (None, True, None),  # unknown: over a relay
    ],
)
async def test_requests_carry_the_address_that_stands_for_their_machine(
    ip: str | None, limit_loopback: bool, address: str | None
) -> None:
    config = Config.model_validate({"peer_limits": {"limit_loopback": limit_loopback}})
    seen: list[str | None] = []

    async def record(request: Request) -> Reply:
        seen.append(request.address)
        return await echo(request)

    network = MemoryNetwork()
    async with AsyncExitStack() as stack:
        server_host, _ = await serve_echo(stack, network, config, record)
        client_host = await stack.enter_async_context(network.open_host(ip=ip))
        client = RpcClient(client_host, config.wire, config.timeouts)
        header, data = forward_frame()
        await client.call(server_host.address, Verb.FORWARD, header, [data])
        await client.aclose()
    assert seen == [address]
