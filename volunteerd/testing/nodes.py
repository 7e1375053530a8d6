"""Factories for real local swarms on 127.0.0.1 (port 0), used by tests and benchmarks.

Everything here is real: libp2p hosts, Kademlia, torch experts. Each node lives inside
the caller's ``async with``, so nothing outlives a test.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from volunteerd.config import Config
from volunteerd.daemon import Daemon, Running
from volunteerd.identity import Identity
from volunteerd.net import Node, open_node
from volunteerd.paths import Paths

if TYPE_CHECKING:
    from trio_typing import TaskStatus

__all__ = ["Restartable", "local_config", "open_daemon", "open_node_and_peers", "open_peer"]


def local_config(
    *, bootstrap: Sequence[str] = (), uids: str = "ffn.[0:2].[0:2]", **sections: dict[str, Any]
) -> Config:
    """A config for loopback tests: 127.0.0.1, port 0, short DHT periods, small experts.

    ``sections`` override whole sections' keys, e.g. ``dht={"record_ttl_s": 3}``.
    """
    data: dict[str, Any] = {
        "network": {"listen_host": "127.0.0.1", "port": 0, "bootstrap_peers": list(bootstrap)},
        "dht": {"announce_period_s": 1.0, "record_ttl_s": 2.5, "replication": 5},
        "experts": {"uids": uids, "hidden_dim": 32},
        "runtime": {"device": "cpu", "max_batch_wait_s": 0.002},
        "timeouts": {
            "connect_s": 5,
            "request_s": 20,
            "dht_rpc_s": 3,
            "dht_lookup_s": 5,
            "shutdown_grace_s": 2,
        },
        "logging": {"level": "INFO"},
        "control": {"port": 0},
        "stats": {"flush_s": 0.5},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return Config.model_validate(data)


@asynccontextmanager
async def open_daemon(
    config: Config, data_dir: Path, identity: Identity | None = None
) -> AsyncIterator[Running]:
    """A real daemon in this trio run; stopped gracefully when the block exits."""
    paths = Paths(config_file=data_dir / "config.toml", data_dir=data_dir, cache_dir=data_dir)
    daemon = Daemon(config, paths, identity=identity or Identity.generate())
    async with trio.open_nursery() as nursery:
        running: Running = await nursery.start(daemon.serve)
        try:
            yield running
        finally:
            daemon.request_stop()


@asynccontextmanager
async def open_peer(config: Config, identity: Identity | None = None) -> AsyncIterator[Node]:
    """A node with no experts (a bootstrap peer, or a client)."""
    async with open_node(identity or Identity.generate(), config) as node:
        yield node


@asynccontextmanager
async def open_node_and_peers(
    peer_limits: dict[str, Any], peers: int = 2
) -> AsyncIterator[tuple[Node, ...]]:
    """A node with these ``peer_limits`` and ``peers`` peers connected to it (default
    limits): ``(node, peer, peer, ...)``, for tests of what a node lets one peer do."""
    async with AsyncExitStack() as stack:
        node = await stack.enter_async_context(open_peer(local_config(peer_limits=peer_limits)))
        others = [await stack.enter_async_context(open_peer(local_config())) for _ in range(peers)]
        for other in others:
            await other.rpc.connect(node.address)
        yield (node, *others)


class Restartable:
    """A node (a relay with ``relay``) that a test stops and starts again at the same
    port and identity, as a bootstrap node or a relay restarts, run in ``nursery``."""

    def __init__(self, nursery: trio.Nursery, *, relay: bool = False) -> None:
        with socket.socket() as probe:  # a free port, released for the node
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        self.identity = Identity.generate()
        self.config = local_config(network={"listen_host": "127.0.0.1", "port": port})
        self._nursery, self._relay = nursery, relay
        self._stop = trio.Event()

    async def start(self) -> Node:
        """Start it (again); returns the running node."""
        self._stop = trio.Event()
        node: Node = await self._nursery.start(self._run, self._stop)
        return node

    def stop(self) -> None:
        """Stop it (it closes in the background)."""
        self._stop.set()

    async def _run(self, stop: trio.Event, *, task_status: TaskStatus[Node]) -> None:
        async with open_node(self.identity, self.config, relay=self._relay) as node:
            task_status.started(node)
            await stop.wait()
