"""An in-memory network for tests: ``MemoryHost``s joined by links with latency,
bandwidth, jitter, loss and partitions, all on trio's clock.

Each host is a ``net/transport.StreamHost``, so ``RpcServer`` and ``RpcClient`` run
on it unchanged. Nothing here reads the wall clock or starts a thread: time is
``trio.current_time()`` and waiting is ``trio.sleep_until``, so under
``trio.testing.MockClock(autojump_threshold=0)`` (pytest-trio's ``autojump_clock``)
a 100 ms link costs no real time, and every duration a test asserts is exact. ::

    network = MemoryNetwork(seed=1, default=Link(latency_s=0.05))
    async with network.open_host() as server_host, network.open_host() as client_host:
        network.set_link(server_host, client_host, Link(latency_s=0.1, bytes_per_s=1_250_000))
        server = RpcServer(server_host, handlers, wire, timeouts, peer_limits)
        server.install()
        client = RpcClient(client_host, wire, timeouts)
        reply, tensors = await client.call(server_host.address, Verb.FORWARD, request, [data])

The model, per direction of each pair of hosts (a ``Link``):

* **Bandwidth** (``bytes_per_s``, 0 = unlimited) is one wire shared by every stream of
  that direction: a write is cut into segments of ``segment_bytes``, each occupies the
  wire ``len / bytes_per_s`` seconds after the segments before it, and the writer
  waits until its segment is on the wire (a send buffer of zero; the receiver's buffer
  is unbounded). Streams of one link interleave segment by segment.
* **Latency** (``latency_s``, one way) is added to each segment once it left the wire;
  **jitter** adds a uniform ``[0, jitter_s]`` on top. A segment never overtakes an
  earlier one of its stream (arrival times are kept monotonic), so jitter delays but
  never reorders a stream's bytes; different streams may overtake each other.
* **Loss** is modelled as on a reliable stream: a segment is lost with probability
  ``loss`` and re-sent after ``retransmit_s`` (again possibly lost), so loss only adds
  delay; every byte arrives, in order.
* **Connecting** costs one round trip (the two one-way latencies), once per pair of
  hosts: the connection is then reused. Opening a stream on it costs nothing (its
  protocol negotiation rides on its first bytes).
* **Partitions** (``partition(side_a, side_b)``, undone by ``heal()``) behave like a
  cable pulled out: a connection attempt across one is a black hole (no reply until
  healed, so the caller's timeout decides: ``RpcClient`` raises ``PeerUnreachable``
  after ``connect_s``), and a write on an existing stream stalls until healed
  (``RpcClient`` raises ``RequestTimeout`` after ``request_s``). Segments already in
  flight, and a close, still arrive. Connections survive a healed partition.
* **A host that leaves** (its ``open_host`` block exits) resets all its streams at
  once; connecting to it is refused at once (``PeerUnreachable``), like a closed port.
* A **reset** reaches the peer at once; a **close** arrives after the data sent
  before it (the peer then reads ``b""``).

Jitter and loss draw from one ``random.Random`` per stream direction, seeded from the
network's ``seed``, the two hosts' numbers (in the order they were opened) and the
stream's number on that pair: a test is reproducible whatever order trio schedules
its tasks in, and whatever peer ids its hosts have.
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from volunteerd.errors import PeerUnreachable
from volunteerd.identity import Identity
from volunteerd.net.peers import PeerAddress, peer_id_for, short
from volunteerd.net.transport import StreamHandler, StreamReset

__all__ = ["Link", "MemoryHost", "MemoryNetwork", "MemoryStream"]

logger = logging.getLogger(__name__)

_SEGMENT_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Link:
    """One direction of the path between two hosts (module docstring)."""

    latency_s: float = 0.0
    bytes_per_s: float = 0.0  # 0 = unlimited; 10 Mbit/s is 1_250_000
    jitter_s: float = 0.0
    loss: float = 0.0  # probability a segment must be re-sent, 0 <= loss < 1
    retransmit_s: float = 0.2  # what each loss adds (TCP's minimum retransmit timeout)

    def __post_init__(self) -> None:
        if min(self.latency_s, self.bytes_per_s, self.jitter_s, self.retransmit_s) < 0:
            raise ValueError(f"link values must not be negative: {self}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1): {self.loss}")


def _id(host: MemoryHost | str) -> str:
    return host if isinstance(host, str) else host.peer_id


class MemoryNetwork:
    """Hosts and the links between them. Links not set are ``default``."""

    def __init__(
        self, seed: int = 0, default: Link = Link(), segment_bytes: int = _SEGMENT_BYTES
    ) -> None:
        self.seed = seed
        self.default = default
        self.segment_bytes = segment_bytes
        self._links: dict[tuple[str, str], Link] = {}
        self._wire_free_at: dict[tuple[str, str], float] = {}
        self._hosts: dict[str, MemoryHost] = {}
        self._cuts: set[frozenset[str]] = set()
        self._healed: trio.Event | None = None
        self._streams_opened: dict[tuple[str, str], int] = {}
        self._hosts_opened = 0

    # --- configuration ---------------------------------------------------------------

    def set_link(
        self, a: MemoryHost | str, b: MemoryHost | str, link: Link, *, both_ways: bool = True
    ) -> None:
        """Use ``link`` from ``a`` to ``b`` (and from ``b`` to ``a`` unless told not
        to); takes effect for the next segment sent."""
        self._links[(_id(a), _id(b))] = link
        if both_ways:
            self._links[(_id(b), _id(a))] = link

    def link(self, a: MemoryHost | str, b: MemoryHost | str) -> Link:
        return self._links.get((_id(a), _id(b)), self.default)

    def partition(
        self, side_a: Iterable[MemoryHost | str], side_b: Iterable[MemoryHost | str]
    ) -> None:
        """Cut every path between a host of ``side_a`` and a host of ``side_b`` (other
        paths stay), until ``heal``."""
        b_ids = [_id(h) for h in side_b]
        for a in side_a:
            for b in b_ids:
                if _id(a) != b:
                    self._cuts.add(frozenset((_id(a), b)))

    def heal(self) -> None:
        """Undo every partition: stalled writes and connection attempts go on."""
        self._cuts.clear()
        if self._healed is not None:
            self._healed.set()
            self._healed = None

    def reachable(self, a: MemoryHost | str, b: MemoryHost | str) -> bool:
        """Whether no partition separates ``a`` and ``b`` now."""
        return frozenset((_id(a), _id(b))) not in self._cuts

    # --- hosts -------------------------------------------------------------------------

    @asynccontextmanager
    async def open_host(
        self, identity: Identity | None = None, *, ip: str | None = None
    ) -> AsyncIterator[MemoryHost]:
        """A host on this network (peer id from ``identity``, default a fresh one) that
        serves its handlers until the block exits; then its streams are reset and
        connecting to it is refused. ``ip`` is the address its peers see its streams
        come from (``Stream.remote_host``; None: unknown, as over a relay)."""
        identity = identity or Identity.generate()
        host = MemoryHost(self, identity, self._hosts_opened, ip)
        self._hosts_opened += 1
        if host.peer_id in self._hosts:
            raise ValueError(f"{short(host.peer_id)} is already on this network")
        async with trio.open_nursery() as nursery:
            host._nursery = nursery
            self._hosts[host.peer_id] = host
            try:
                yield host
            finally:
                del self._hosts[host.peer_id]
                host._leave()
                nursery.cancel_scope.cancel()

    def host(self, peer_id: str) -> MemoryHost | None:
        """The host of ``peer_id`` while it is on the network."""
        return self._hosts.get(peer_id)

    # --- what streams use --------------------------------------------------------------

    async def _wait_reachable(self, a: str, b: str) -> None:
        while not self.reachable(a, b):
            if self._healed is None:
                self._healed = trio.Event()
            await self._healed.wait()

    def _rng_for(self, a: MemoryHost, b: MemoryHost) -> random.Random:
        n = self._streams_opened.get((a.peer_id, b.peer_id), 0)
        self._streams_opened[(a.peer_id, b.peer_id)] = n + 1
        return random.Random(f"{self.seed}/{a.number}/{b.number}/{n}")

    async def _transmit(self, a: str, b: str, size: int) -> Link:
        """Wait until a segment of ``size`` bytes from ``a`` to ``b`` has left the wire
        (after the segments queued before it); returns the link it crossed."""
        await self._wait_reachable(a, b)
        link = self.link(a, b)
        if link.bytes_per_s > 0:
            start = max(trio.current_time(), self._wire_free_at.get((a, b), -math.inf))
            done = start + size / link.bytes_per_s
            self._wire_free_at[(a, b)] = done
            await trio.sleep_until(done)
        return link


class MemoryHost:
    """A ``StreamHost`` on a ``MemoryNetwork``; get one from ``network.open_host()``."""

    def __init__(
        self, network: MemoryNetwork, identity: Identity, number: int, ip: str | None = None
    ) -> None:
        self.network = network
        self.identity = identity
        self.ip = ip
        self.number = number  # the how-many-th host of its network (from 0)
        self.peer_id = str(peer_id_for(identity))
        self._handlers: dict[str, StreamHandler] = {}
        self._connected: set[str] = set()
        self._streams: set[MemoryStream] = set()
        self._nursery: trio.Nursery | None = None

    @property
    def address(self) -> PeerAddress:
        """What peers dial this host by (memory hosts need no transport address)."""
        return PeerAddress(self.peer_id, ())

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        self._handlers[protocol] = handler

    def connected(self, peer_id: str) -> bool:
        """Whether a connection to ``peer_id`` is open (streams then open at once)."""
        return peer_id in self._connected

    async def connect(self, peer: PeerAddress) -> None:
        await trio.lowlevel.checkpoint()
        self._target(peer.peer_id)
        if peer.peer_id in self._connected:
            return
        network = self.network
        await network._wait_reachable(self.peer_id, peer.peer_id)
        round_trip = (
            network.link(self.peer_id, peer.peer_id).latency_s
            + network.link(peer.peer_id, self.peer_id).latency_s
        )
        await trio.sleep(round_trip)
        target = self._target(peer.peer_id)  # it may have left meanwhile
        self._connected.add(target.peer_id)
        target._connected.add(self.peer_id)

    async def open_stream(self, peer: PeerAddress, protocol: str) -> MemoryStream:
        await self.connect(peer)
        target = self._target(peer.peer_id)
        handler = target._handlers.get(protocol)
        if handler is None or target._nursery is None:
            raise PeerUnreachable(f"{short(peer.peer_id)}: protocol {protocol} not supported")
        network = self.network
        ours = MemoryStream(self, target.peer_id, network._rng_for(self, target), target.ip)
        theirs = MemoryStream(target, self.peer_id, network._rng_for(target, self), self.ip)
        ours._peer, theirs._peer = theirs, ours
        target._nursery.start_soon(handler, theirs)
        return ours

    async def hang_up(self, peer_id: str) -> None:
        self._connected.discard(peer_id)
        other = self.network.host(peer_id)
        if other is not None:
            other._connected.discard(self.peer_id)

    def _target(self, peer_id: str) -> MemoryHost:
        target = self.network.host(peer_id)
        if target is None:
            self._connected.discard(peer_id)
            raise PeerUnreachable(f"{short(peer_id)}: connection refused (not on the network)")
        return target

    def _leave(self) -> None:
        for stream in list(self._streams):
            stream._abort()
        for peer_id in self._connected:
            other = self.network.host(peer_id)
            if other is not None:
                other._connected.discard(self.peer_id)
        self._connected.clear()


@dataclass(slots=True)
class _Segment:
    arrives_at: float
    data: bytes | None  # None: the sender closed


class MemoryStream:
    """One end of an in-memory stream (a ``transport.Stream``)."""

    def __init__(
        self,
        host: MemoryHost,
        remote_peer_id: str,
        rng: random.Random,
        remote_host: str | None = None,
    ) -> None:
        self.remote_peer_id = remote_peer_id
        self.remote_host = remote_host
        self._host = host
        self._rng = rng
        self._peer: MemoryStream | None = None
        self._inbox: deque[_Segment] = deque()
        self._changed = trio.Event()
        self._last_arrival = -math.inf  # of our segments at the peer
        self._closed = False
        self._reset = False
        host._streams.add(self)

    async def read(self, n: int) -> bytes:
        if n <= 0:
            raise ValueError("read needs n > 0")
        while True:
            if self._reset:
                raise StreamReset("stream reset")
            if not self._inbox:
                await self._wait(math.inf)
                continue
            head = self._inbox[0]
            if head.arrives_at > trio.current_time():
                await self._wait(head.arrives_at)
                continue
            await trio.lowlevel.checkpoint()
            if head.data is None:
                return b""
            if len(head.data) <= n:
                self._inbox.popleft()
                return head.data
            head.data, out = head.data[n:], head.data[:n]
            return out

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        view = memoryview(data)
        size = self._host.network.segment_bytes
        for start in range(0, len(view), size):
            self._check_writable()
            piece = bytes(view[start : start + size])
            link = await self._host.network._transmit(
                self._host.peer_id, self.remote_peer_id, len(piece)
            )
            self._check_writable()
            self._send(piece, link.latency_s + self._extra_delay(link))

    def _check_writable(self) -> None:
        if self._reset:
            raise StreamReset("stream reset")
        if self._closed:
            raise StreamReset("write after close")

    def _extra_delay(self, link: Link) -> float:
        delay = self._rng.uniform(0, link.jitter_s) if link.jitter_s else 0.0
        while link.loss and self._rng.random() < link.loss:
            delay += link.retransmit_s
        return delay

    def _send(self, data: bytes | None, delay: float) -> None:
        arrives_at = max(trio.current_time() + delay, self._last_arrival)
        self._last_arrival = arrives_at
        peer = self._peer
        if peer is not None and not peer._reset:
            peer._inbox.append(_Segment(arrives_at, data))
            peer._notify()

    async def close(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._closed or self._reset:
            return
        self._closed = True
        self._send(None, self._host.network.link(self._host.peer_id, self.remote_peer_id).latency_s)
        self._host._streams.discard(self)

    async def reset(self) -> None:
        await trio.lowlevel.checkpoint()
        self._abort()

    def _abort(self) -> None:
        for end in (self, self._peer):
            if end is not None and not end._reset:
                end._reset = True
                end._inbox.clear()
                end._host._streams.discard(end)
                end._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait(self, deadline: float) -> None:
        changed = self._changed
        with trio.move_on_at(deadline):
            await changed.wait()
