"""The RPC client caps a reply's body by what its call can use, from the reply's prefix:
a peer cannot make it read more than was asked for (wire.max_body_bytes is 256 MiB).
Over the in-memory network, in virtual time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from volunteerd.config import Config, LimitsConfig
from volunteerd.errors import FrameTooLarge, PeerError, ReplyTooLarge
from volunteerd.net import Verb
from volunteerd.net.records import FindReply, FindRequest
from volunteerd.net.rpc import Handler, Reply, Request, RpcClient, RpcServer
from volunteerd.net.throttle import Throttle
from volunteerd.testing.memnet import MemoryHost, MemoryNetwork
from volunteerd.wire import TensorMeta
from volunteerd.wire.messages import ParamsReply, ParamsRequest

CONFIG = Config()
HUGE = 8 << 20  # a reply body far over what any call below asks for
PREFIX_BYTES = 16


async def huge_params(request: Request) -> Reply:
    """A replica answering ``params`` with one float32 tensor of 8 MiB, whatever the
    expert's size."""
    meta = TensorMeta(dtype="float32", shape=(HUGE // 4,))
    header = ParamsReply(uid=request.header.uid, updates=0, names=["w"], tensors=[meta])
    return Reply(header, [bytes(HUGE)])


async def find_with_a_body(request: Request) -> Reply:
    """A DHT peer whose ``dht-find`` reply (a header alone) carries 8 MiB behind it."""
    return Reply(FindReply(records=[]), [bytes(HUGE)])


@asynccontextmanager
async def hostile_server(
    handlers: dict[Verb, Handler],
) -> AsyncIterator[tuple[MemoryHost, RpcClient, Throttle]]:
    """A server with ``handlers``, and a client whose throttle counts the bytes it read."""
    network = MemoryNetwork()
    async with network.open_host() as server_host, network.open_host() as client_host:
        server = RpcServer(server_host, handlers, CONFIG.wire, CONFIG.timeouts, CONFIG.peer_limits)
        server.install()
        throttle = Throttle(LimitsConfig())
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts, throttle=throttle)
        try:
            yield server_host, client, throttle
        finally:
            await client.aclose()


async def test_a_reply_over_the_calls_cap_is_refused_from_its_prefix(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with hostile_server({Verb.PARAMS: huge_params}) as (host, client, throttle):
        with pytest.raises(ReplyTooLarge, match=r"cap of 33000\b") as caught:
            await client.call(
                host.address, Verb.PARAMS, ParamsRequest(uid="ffn.0.0"), max_body_bytes=33_000
            )
        # A peer failing as any other: callers catching PeerError or FrameTooLarge see it.
        assert isinstance(caught.value, PeerError)
        assert isinstance(caught.value, FrameTooLarge)
        assert caught.value.code == "too_large"
        assert throttle.bytes_down == PREFIX_BYTES  # the body was never read

        # The out-of-step stream was not pooled: a call with room for the reply works.
        reply, tensors = await client.call(
            host.address, Verb.PARAMS, ParamsRequest(uid="ffn.0.0"), max_body_bytes=HUGE
        )
        assert reply.names == ["w"]
        assert tensors[0].data.nbytes == HUGE


async def test_a_body_on_a_reply_that_carries_none_is_refused_from_its_prefix(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with hostile_server({Verb.DHT_FIND: find_with_a_body}) as (host, client, throttle):
        with pytest.raises(ReplyTooLarge, match="cap of 0"):
            await client.call(host.address, Verb.DHT_FIND, FindRequest(keys=["ffn.0.0"]))
        assert throttle.bytes_down == PREFIX_BYTES
