"""Bare clients for tests and benchmarks: a host with no listener, no DHT and no
experts, holding one RpcClient -- the cheapest stranger that can call a node."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from volunteerd.config import Config
from volunteerd.identity import Identity
from volunteerd.net.host import Libp2pStreamHost, open_host
from volunteerd.net.rpc import RpcClient

__all__ = ["open_bare_client"]


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
