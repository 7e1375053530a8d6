"""Bare clients for tests and benchmarks: a host with no listener, no DHT and no
experts, holding one RpcClient -- the cheapest stranger that can call a node -- and
what a hostile one does on a raw stream (``trickle``, ``read_reply``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from volunteerd.config import Config, WireLimits
from volunteerd.identity import Identity
from volunteerd.net.framing import read_frame_rest, read_prefix
from volunteerd.net.host import Libp2pStreamHost, open_host
from volunteerd.net.peers import PeerAddress
from volunteerd.net.protocols import Verb
from volunteerd.net.rpc import RpcClient
from volunteerd.net.transport import Stream

__all__ = ["call_forward", "open_bare_client", "read_reply", "trickle"]


@asynccontextmanager
async def open_bare_client(
    config: Config, identity: Identity | None = None
) -> AsyncIterator[RpcClient]:
    """An RpcClient of a fresh identity (unless given) that closes all its connections
    on exit."""
    async with open_host(identity or Identity.generate(), None) as host:
        rpc = RpcClient(Libp2pStreamHost(host), config.wire, config.timeouts)
        try:
            yield rpc
        finally:
            await rpc.aclose()


async def trickle(stream: Stream, data: bytes, every_s: float) -> float:
    """Send ``data`` one byte every ``every_s``; returns the seconds (trio's clock: virtual
    on memory links under a MockClock) from the first byte until the server dropped the
    stream (a reset or end seen by a read, or a failed write)."""
    started = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def send() -> None:
            try:
                for i in range(len(data)):
                    await stream.write(data[i : i + 1])
                    await trio.sleep(every_s)
            except Exception:  # dropped by the server: what the caller waits for
                nursery.cancel_scope.cancel()
                return
            await trio.sleep_forever()

        nursery.start_soon(send)
        try:
            while await stream.read(1024):
                pass
        except Exception:  # a reset ends the read like an end of stream
            pass
        nursery.cancel_scope.cancel()
    return trio.current_time() - started


async def read_reply(stream: Stream, wire: WireLimits) -> dict[str, Any]:
    """The header of the next reply frame on ``stream``, as JSON."""
    prefix = await read_prefix(stream)
    if prefix is None:
        raise EOFError("the stream ended before a reply")
    frame = await read_frame_rest(stream, bytes(prefix), wire)
    reply: dict[str, Any] = json.loads(frame.header)
    return reply


async def call_forward(rpc: RpcClient, address: PeerAddress, uid: str, hidden: int) -> None:
    """One forward of 4 random rows of width ``hidden`` to ``uid`` at ``address``;
    raises what the call raises (``paused`` for a held expert)."""
    import torch

    from volunteerd.experts import to_wire
    from volunteerd.wire import ForwardRequest

    meta, data = to_wire(torch.randn(4, hidden))
    await rpc.call(address, Verb.FORWARD, ForwardRequest(uid=uid, tensors=[meta]), [data])
