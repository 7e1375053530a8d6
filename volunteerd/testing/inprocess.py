"""An in-process swarm for tests: expert servers and trainers on the test's own trio
loop, joined by memory links (``testing/memnet.py``) instead of sockets and processes.

A server is what a daemon serves, minus the process: a real ``ExpertRuntime`` behind
the server pipeline's handler map (``server.pipeline.expert_handlers``), through a
``Faults`` switch (``testing/faulty.py``: honest until a test says otherwise), on a real
``RpcServer`` over a ``MemoryHost``. Stopping one (``server.stop()``) is a crash: its
streams are reset and dials to it refused, while its records stay listed.

A trainer is a ``TrainerClient`` on a ``MemoryHost``: a real ``RpcClient`` and a real
``ExpertDirectory`` (cache, verification by ``info``, bans), fed by ``WorldLookup``,
the world's table of who serves what, instead of the Kademlia DHT (which needs real
sockets; docs/decisions/0010). So a test runs the trainer path from the beam search to
the runtime's batcher and back, with every network condition the links can give. ::

    async with open_world(config) as world:
        await world.add_server("ffn.[0:2].[0:2]")
        async with world.open_trainer() as client:
            layer = RemoteMixtureOfExperts(16, (2, 2), "ffn.", k_best=2, client=client)
            y = await trio.to_thread.run_sync(layer, x)

Torch code is synchronous: call layers from a worker thread (``trio.to_thread``), from
which the client reaches the loop. The experts' compute runs in worker threads too, so
tests that compute run in real time (fast all the same: no sockets, no processes);
virtual time (``trio.testing.MockClock``) suits what runs on the loop alone, such as
``moe.dispatch.call_many`` against handler stubs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import trio

from volunteerd import uids as uid_patterns
from volunteerd.config import Config
from volunteerd.identity import Identity
from volunteerd.moe.client import TrainerClient
from volunteerd.moe.directory import ExpertDirectory, info_verifier
from volunteerd.net import (
    ExpertRecord,
    Handler,
    PeerAddress,
    RpcClient,
    RpcServer,
    Throttle,
    Verb,
    children_by_key,
    peer_id_for,
)
from volunteerd.net.records import sign_record
from volunteerd.runtime import ExpertRuntime
from volunteerd.server.pipeline import expert_handlers
from volunteerd.testing.faulty import Faults
from volunteerd.testing.memnet import MemoryHost, MemoryNetwork

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["InProcessClient", "InProcessServer", "Peer", "World", "WorldLookup", "open_world"]

T = TypeVar("T")

# Records in the world's table never expire: a server is listed until the test says.
_RECORD_TTL_S = 24 * 3600.0


class WorldLookup:
    """The world's DHT: every listed server's records, per key, the servers added
    first listed first (as storing nodes list the writers they have seen longest)."""

    def __init__(self) -> None:
        self._records: dict[str, list[ExpertRecord]] = {}

    async def get(self, keys: Sequence[str]) -> dict[str, list[ExpertRecord]]:
        await trio.lowlevel.checkpoint()
        return {key: list(self._records.get(key, [])) for key in keys}

    def announce(self, identity: Identity, peer_id: str, uids: Sequence[str]) -> None:
        """List ``peer_id`` under every key of ``uids`` (signed, as an announcer would)."""
        for key, children in children_by_key(uids).items():
            record = sign_record(
                identity, peer_id, key=key, addrs=(), children=children, ttl_s=_RECORD_TTL_S
            )
            self._records.setdefault(key, []).append(record)


class InProcessServer:
    """One expert server of the world (see the module docstring)."""

    def __init__(self, identity: Identity, runtime: ExpertRuntime, faults: Faults) -> None:
        self.identity = identity
        self.runtime = runtime
        self.faults = faults
        self.host: MemoryHost | None = None
        self.rpc_server: RpcServer | None = None
        self._stop = trio.Event()
        self._stopped = trio.Event()

    @property
    def peer_id(self) -> str:
        return str(peer_id_for(self.identity))

    @property
    def address(self) -> PeerAddress:
        return PeerAddress(self.peer_id, ())

    async def stop(self) -> None:
        """Crash: the host leaves the network (streams reset, dials refused) and the
        runtime stops; returns once it has. The world's table still lists it, as the
        DHT lists a crashed daemon until its records expire. From a worker thread:
        ``client.run(server.stop)``."""
        self._stop.set()
        await self._stopped.wait()

    async def serve(
        self,
        network: MemoryNetwork,
        handlers: Mapping[Verb, Handler],
        config: Config,
        *,
        throttle: Throttle | None = None,
        task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve ``handlers`` until stopped, every stream through ``throttle`` (default:
        none, nothing counted) as a daemon's node passes them."""
        try:
            async with network.open_host(self.identity) as host, trio.open_nursery() as nursery:
                await nursery.start(self.runtime.serve)
                server = RpcServer(
                    host,
                    self.faults.wrap(handlers),
                    config.wire,
                    config.timeouts,
                    config.peer_limits,
                    throttle,
                )
                server.install()
                self.host, self.rpc_server = host, server
                task_status.started()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._stopped.set()


@dataclass(frozen=True, slots=True)
class Peer:
    """A host of the world with an RpcClient on it."""

    host: MemoryHost
    rpc: RpcClient

    @property
    def peer_id(self) -> str:
        return self.host.peer_id


class InProcessClient(TrainerClient):
    """A trainer on the world's loop; call its ``run`` (and layers using it) from a
    worker thread of that loop."""

    def __init__(self, rpc: RpcClient, directory: ExpertDirectory, host: MemoryHost) -> None:
        self._rpc = rpc
        self._directory = directory
        self.host = host
        self._token = trio.lowlevel.current_trio_token()

    @property
    def rpc(self) -> RpcClient:
        return self._rpc

    @property
    def directory(self) -> ExpertDirectory:
        return self._directory

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(fn, *args, trio_token=self._token)


class World:
    """Servers and trainers on one ``MemoryNetwork``; get one from ``open_world``."""

    def __init__(self, config: Config, network: MemoryNetwork, nursery: trio.Nursery) -> None:
        self.config = config
        self.network = network
        self.lookup = WorldLookup()
        self._nursery = nursery

    async def add_server(
        self,
        uids: str | Sequence[str],
        *,
        config: Config | None = None,
        identity: Identity | None = None,
    ) -> InProcessServer:
        """Start a server hosting ``uids`` (a pattern such as ``ffn.[0:2].0``, or a list)
        with ``config``'s experts, runtime, guard and limits (default: the world's),
        and list it in the world's table."""
        config = config or self.config
        hosted = uid_patterns.expand_pattern(uids) if isinstance(uids, str) else list(uids)
        runtime = ExpertRuntime(
            hosted,
            config.experts,
            config.runtime,
            config.wire,
            torch.device("cpu"),
            guard=config.guard,
        )
        server = InProcessServer(identity or Identity.generate(), runtime, Faults())
        await self._nursery.start(server.serve, self.network, expert_handlers(runtime), config)
        self.lookup.announce(server.identity, server.peer_id, hosted)
        return server

    @asynccontextmanager
    async def open_trainer(
        self,
        *,
        refresh_s: float = 5.0,
        ban_s: float = 60.0,
        verify_servers: bool = True,
        identity: Identity | None = None,
    ) -> AsyncIterator[InProcessClient]:
        """A trainer's client on its own memory host, as ``SwarmClient`` builds one
        (the directory's clock is the wall clock: layers ask it from the torch thread)."""
        timeouts = self.config.timeouts
        verify_s = timeouts.connect_s + timeouts.dht_rpc_s
        async with self.network.open_host(identity) as host, trio.open_nursery() as nursery:
            rpc = RpcClient(host, self.config.wire, timeouts)
            directory = ExpertDirectory(
                self.lookup,
                refresh_s=refresh_s,
                ban_s=ban_s,
                verify=info_verifier(rpc, verify_s) if verify_servers else None,
                verify_wait_s=verify_s,
                clock=time.monotonic,
            )
            await nursery.start(directory.serve)
            try:
                yield InProcessClient(rpc, directory, host)
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await rpc.aclose()

    @asynccontextmanager
    async def open_peer(
        self, identity: Identity | None = None, *, ip: str | None = None
    ) -> AsyncIterator[Peer]:
        """A bare peer: a host and an RpcClient, no directory (a stranger, an attacker);
        its streams come from ``ip`` (None: an unknown address)."""
        async with self.network.open_host(identity, ip=ip) as host:
            rpc = RpcClient(host, self.config.wire, self.config.timeouts)
            try:
                yield Peer(host, rpc)
            finally:
                with trio.CancelScope(shield=True):
                    await rpc.aclose()


@asynccontextmanager
async def open_world(config: Config, network: MemoryNetwork | None = None) -> AsyncIterator[World]:
    """A world on ``network`` (default: a fresh one with instant links); every server
    and trainer in it stops when the block exits."""
    async with trio.open_nursery() as nursery:
        world = World(config, network or MemoryNetwork(), nursery)
        try:
            yield world
        finally:
            nursery.cancel_scope.cancel()
