"""A client closes a connection that stopped answering, so the next call dials afresh.

Probed from outside (2026-12-05): after a volunteer's address changed, a trainer kept
its connection to the old address, whose other end was gone, and every call took it
and timed out until the kernel gave up on the socket, ~16 minutes later, though the
volunteer's record named its new address all along.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from libp2p.host.exceptions import StreamFailure
from libp2p.protocol_muxer.exceptions import MultiselectClientError

from volunteerd.config import Config
from volunteerd.errors import PeerUnreachable, RemoteError, RequestTimeout
from volunteerd.net import PeerAddress, Verb
from volunteerd.net.host import _timed_out
from volunteerd.net.rpc import SILENCES_BEFORE_HANG_UP, Reply, Request, RpcClient, RpcServer
from volunteerd.net.transport import Stream
from volunteerd.testing.memnet import MemoryHost, MemoryNetwork
from volunteerd.wire import InfoRequest
from volunteerd.wire.messages import ErrorReply, ParamsRequest

CONFIG = Config()


class Void:
    """A stream on a connection whose other end is gone: writes vanish, nothing comes."""

    remote_peer_id = "gone"
    remote_host = None

    async def read(self, n: int) -> bytes:
        await trio.sleep_forever()
        raise AssertionError  # unreachable

    async def write(self, data: bytes) -> None:
        pass

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass


class HalfOpen:
    """A client's host whose connection to every peer is dead until it hangs up."""

    def __init__(self, host: MemoryHost) -> None:
        self._host = host
        self.peer_id = host.peer_id
        self.dead = True
        self.hang_ups: list[str] = []

    async def connect(self, peer: PeerAddress) -> None:
        if not self.dead:
            await self._host.connect(peer)

    async def open_stream(self, peer: PeerAddress, protocol: str) -> Stream:
        if self.dead:
            return Void()
        return await self._host.open_stream(peer, protocol)

    async def hang_up(self, peer_id: str) -> None:
        self.hang_ups.append(peer_id)
        self.dead = False  # the next stream dials: the address the peer announces now

    def set_stream_handler(self, protocol: str, handler: Any) -> None:
        self._host.set_stream_handler(protocol, handler)


async def answer(request: Request) -> Reply:
    return Reply(ErrorReply(code="unknown_expert", message="no such expert"))


@asynccontextmanager
async def half_open_client() -> AsyncIterator[tuple[MemoryHost, HalfOpen, RpcClient]]:
    """A server answering ``info``, and a client whose connection to it is dead."""
    network = MemoryNetwork()
    async with network.open_host() as server_host, network.open_host() as client_host:
        RpcServer(
            server_host, {Verb.INFO: answer}, CONFIG.wire, CONFIG.timeouts, CONFIG.peer_limits
        ).install()
        host = HalfOpen(client_host)
        client = RpcClient(host, CONFIG.wire, CONFIG.timeouts)  # type: ignore[arg-type]
        try:
            yield server_host, host, client
        finally:
            await client.aclose()


async def test_a_connection_that_stopped_answering_is_closed_and_the_next_call_dials(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with half_open_client() as (server_host, host, client):
        for _ in range(SILENCES_BEFORE_HANG_UP):
            with pytest.raises(RequestTimeout):
                await client.call(server_host.address, Verb.INFO, InfoRequest(uid="ffn.0.0"))
        assert host.hang_ups == [server_host.peer_id]
        assert client.hung_up == 1
        with pytest.raises(RemoteError, match="no such expert"):  # an answer, at once
            with trio.fail_after(1):
                await client.call(server_host.address, Verb.INFO, InfoRequest(uid="ffn.0.0"))


async def test_calls_cut_off_by_their_callers_deadline_count_as_unanswered(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The DHT gives each request its own deadline (timeouts.dht_rpc_s, 5 s), far below
    # request_s: such calls never counted, and a connection from an address this
    # computer no longer had stayed open for 15 minutes (an outside probe, 2026-12-07).
    async with half_open_client() as (server_host, host, client):
        for _ in range(SILENCES_BEFORE_HANG_UP):
            with pytest.raises(trio.TooSlowError):
                with trio.fail_after(CONFIG.timeouts.dht_rpc_s):
                    await client.call(server_host.address, Verb.INFO, InfoRequest(uid="ffn.0.0"))
        assert host.hang_ups == [server_host.peer_id]


async def test_a_call_cancelled_with_no_deadline_passed_counts_as_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with half_open_client() as (server_host, host, client):
        for _ in range(3):  # another peer answered first: the rest are cancelled
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    client.call, server_host.address, Verb.INFO, InfoRequest(uid="ffn.0.0")
                )
                await trio.sleep(CONFIG.timeouts.dht_rpc_s)
                nursery.cancel_scope.cancel()
        for _ in range(3):  # a caller with a moment left
            with trio.move_on_after(0.5):
                await client.call(server_host.address, Verb.INFO, InfoRequest(uid="ffn.0.0"))
        assert host.hang_ups == []


async def test_one_unanswered_call_between_answers_closes_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with half_open_client() as (server_host, host, client):
        for _ in range(3):  # a slow call now and then: the connection is alive
            client.forget(server_host.peer_id)  # (no pooled stream: a new one is silent)
            host.dead = True
            with pytest.raises(RequestTimeout):
                await client.call(server_host.address, Verb.INFO, InfoRequest(uid="ffn.0.0"))
            host.dead = False
            with pytest.raises(RemoteError):
                await client.call(server_host.address, Verb.INFO, InfoRequest(uid="ffn.0.0"))
        assert host.hang_ups == []


async def test_a_refusal_is_an_answer_and_closes_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    # A peer that does not serve a verb refuses its streams at once: a live connection
    # (the DHT stores on every connected peer, bare clients included, each round).
    async with half_open_client() as (server_host, host, client):
        host.dead = False
        for _ in range(3):
            with pytest.raises(PeerUnreachable, match="not supported"):
                await client.call(server_host.address, Verb.PARAMS, ParamsRequest(uid="ffn.0.0"))
        assert host.hang_ups == []


def test_py_libp2ps_negotiation_timeout_is_told_from_a_refusal() -> None:
    def failure(cause: str) -> Exception:
        try:
            try:
                raise MultiselectClientError(cause)
            except MultiselectClientError as error:
                raise StreamFailure("failed to open a stream to peer x") from error
        except StreamFailure as exc:
            return exc

    assert _timed_out(failure("response timed out after 10s, protocols tried: [...]"))
    assert not _timed_out(failure("protocol not supported"))
    assert _timed_out(trio.TooSlowError())
