"""SwarmClient: a trainer's connection to the swarm.

A libp2p node running in a background thread (``BackgroundNode``) plus the expert
directory that caches the DHT for the training loop. Use it as a context manager and
hand it to ``RemoteMixtureOfExperts`` layers; they share its connections and cache.

What a layer uses of it is ``TrainerClient``: a way into the network's trio loop from
the torch thread, the RPC client and the directory living there. ``SwarmClient`` is
the real one; ``volunteerd.testing.inprocess`` builds one on a test's own loop and
memory links.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, TypeVar

from volunteerd.config import Config
from volunteerd.identity import Identity
from volunteerd.moe.directory import BAN_GROWTH_MAX, Children, ExpertDirectory, info_verifier
from volunteerd.net import RpcClient
from volunteerd.net.background import BackgroundNode

__all__ = ["SwarmClient", "TrainerClient"]

T = TypeVar("T")


class TrainerClient(ABC):
    """The swarm as a layer sees it. ``run`` is called from a thread that is not the
    network's loop (the torch thread); ``rpc`` and ``directory`` live on that loop."""

    @abstractmethod
    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` on the network's loop, from the calling (torch) thread."""

    @property
    @abstractmethod
    def rpc(self) -> RpcClient: ...

    @property
    @abstractmethod
    def directory(self) -> ExpertDirectory: ...

    def children(self, prefixes: Iterable[str]) -> dict[str, Children]:
        return self.run(self.directory.children, list(prefixes))

    def look_again(self, prefixes: Iterable[str]) -> dict[str, Children]:
        """``children`` from a fresh DHT lookup (see ExpertDirectory.look_again)."""
        return self.run(self.directory.look_again, list(prefixes))

    def ban(
        self,
        peer_id: str,
        reason: str,
        seconds: float | None = None,
        *,
        grow: bool = True,
        most: int = BAN_GROWTH_MAX,
    ) -> None:
        """Choose none of ``peer_id``'s experts for a while (see ExpertDirectory.ban)."""

        async def ban() -> None:
            self.directory.ban(peer_id, reason, seconds, grow=grow, most=most)

        self.run(ban)

    def hang_up(self, peer_id: str) -> None:
        """Close the connection to ``peer_id``: the next call dials its announced
        address afresh (see RpcClient.hang_up)."""
        self.run(self.rpc.hang_up, peer_id)


class SwarmClient(TrainerClient):
    def __init__(
        self,
        config: Config,
        identity: Identity | None = None,
        *,
        refresh_s: float = 5.0,
        ban_s: float = 60.0,
        verify_servers: bool = True,
    ) -> None:
        """``verify_servers=False`` offers every announced server without asking it
        first: only for benchmarks that show what the verification is worth."""
        self.node = BackgroundNode(identity or Identity.generate(), config)
        self._config = config
        self._refresh_s = refresh_s
        self._ban_s = ban_s
        self._verify_servers = verify_servers
        self._directory: ExpertDirectory | None = None

    def __enter__(self) -> SwarmClient:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        self.node.start()
        node = self.node.node
        timeouts = self._config.timeouts
        verify_s = timeouts.connect_s + timeouts.dht_rpc_s
        self._directory = ExpertDirectory(
            node.dht,
            refresh_s=self._refresh_s,
            ban_s=self._ban_s,
            # An announced server is offered once it answered (issue 12: Sybil floods).
            verify=info_verifier(node.rpc, verify_s) if self._verify_servers else None,
            # A first lookup waits for every answer that can still come: on a loaded
            # machine a server's first `info` (a new connection) can take seconds, and
            # a layer that starts without it routes around an expert that is there.
            verify_wait_s=verify_s,
        )
        self.node.start_service(self._directory.serve)

    def close(self) -> None:
        self.node.close()

    @property
    def directory(self) -> ExpertDirectory:
        if self._directory is None:
            raise RuntimeError("the swarm client is not started")
        return self._directory

    @property
    def rpc(self) -> RpcClient:
        return self.node.node.rpc

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self.node.run(fn, *args)
