"""The transport seam: what the RPC layer needs from a network, and nothing more.

``RpcServer`` and ``RpcClient`` (and through them every verb: the DHT's, shard, params,
dial-back) open and accept streams only through a ``StreamHost``. Two implementations:

* ``volunteerd.net.host.Libp2pStreamHost``: py-libp2p's host (TCP, Noise, Yamux, relay
  circuits), the only one a daemon or trainer ever runs;
* ``volunteerd.testing.memnet.MemoryHost``: in-memory links with latency, bandwidth,
  jitter, loss and partitions on trio's clock, for tests (virtual time under
  ``trio.testing.MockClock``).

Kademlia routing and reachability (NAT probing, relay reservations) are about real
sockets and stay on py-libp2p's own host (docs/decisions/0010).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from volunteerd.net.peers import PeerAddress

__all__ = ["Stream", "StreamHandler", "StreamHost", "StreamReset"]


class StreamReset(Exception):
    """The stream was reset (by either side) or its connection went away. Reads and
    writes on it raise this; the RPC layer turns it into a ``PeerError`` for callers."""


class Stream(Protocol):
    """One bidirectional byte stream to one peer, negotiated for one protocol."""

    @property
    def remote_peer_id(self) -> str:
        """The peer at the other end, as authenticated by the transport."""
        ...

    @property
    def remote_host(self) -> str | None:
        """The IP address the peer's connection comes from; None when it is not known
        (a relayed connection: that is the relay's)."""
        ...

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (at least one), or ``b""`` once the peer closed its side.
        Raises an exception (``StreamReset`` or the transport's own) on a reset."""
        ...

    async def write(self, data: bytes) -> None:
        """Send ``data``; returns when the transport took it (backpressure waits here)."""
        ...

    async def close(self) -> None:
        """Close our side for writing: the peer reads ``b""`` after the data sent."""
        ...

    async def reset(self) -> None:
        """Abort both directions at once; unread and unsent data is dropped."""
        ...


StreamHandler = Callable[[Stream], Awaitable[None]]


class StreamHost(Protocol):
    """A node's endpoint: opens streams to peers and serves protocols.

    Timeouts are the caller's (``with trio.fail_after(...)`` at the call site): a host
    may wait as long as the network makes it (a dropped connection attempt)."""

    @property
    def peer_id(self) -> str: ...

    async def connect(self, peer: PeerAddress) -> None:
        """Open a connection to ``peer`` unless one is open (connections are reused by
        every stream to that peer). Raises ``PeerUnreachable``."""
        ...

    async def open_stream(self, peer: PeerAddress, protocol: str) -> Stream:
        """A new stream to ``peer`` for ``protocol``, connecting first if needed.
        Raises ``PeerUnreachable`` when no connection or no stream opens (the peer
        is down, refuses the protocol, or a dial fails)."""
        ...

    async def hang_up(self, peer_id: str) -> None:
        """Close every connection to ``peer_id`` (streams on them break); the next
        stream dials afresh. Nothing happens when there is none."""
        ...

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve ``protocol``: each inbound stream runs ``await handler(stream)`` in a
        task of its own; the handler owns the stream (closes or resets it)."""
        ...
