"""Per-peer limits of the real RpcServer on memory links: slow senders are dropped after
``frame_read_s``, a peer's streams are capped, floods and byte hogs get ``rate_limited``,
and a well-behaved peer is served all the while. The server answers from a stub (no
compute), so the stream tests run in virtual time. The rate and byte buckets refill on
the wall clock: those tests run in real time and bound only what the attacker got."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from volunteerd.config import Config
from volunteerd.errors import PeerError, RemoteError
from volunteerd.net import PROTOCOLS, Reply, Request, RpcClient, RpcServer, Verb
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
            server_host, {Verb.FORWARD: echo}, config.wire, config.timeouts, config.peer_limits
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
