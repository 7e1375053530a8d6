"""The libp2p host: TCP, Noise and Yamux only, and its ``StreamHost`` adapter.

py-libp2p's ``new_host()`` offers plaintext and secio next to Noise unless told
otherwise, and mplex next to Yamux; both are slow or unsafe, so the transports are
passed explicitly here and nowhere else.

``Libp2pStreamHost`` is py-libp2p's host seen through ``net/transport.py``: what the
RPC layer uses to open and accept streams (connection reuse, relay circuits and
py-libp2p's dialling quirks stay in here).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import socket
import struct
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import ConnectionType, IHost, INetStream
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io import trio as _io
from libp2p.network import swarm as _swarm_module
from libp2p.network.auto_connector import AutoConnector
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.rcmgr import ResourceManager
from libp2p.rcmgr.connection_limits import ConnectionLimits
from libp2p.rcmgr.manager import ResourceLimits
from libp2p.relay.circuit_v2 import protocol as _relay_protocol
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH as _NOISE_MAX_PLAINTEXT
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux import yamux as _yamux
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from volunteerd.errors import PeerUnreachable, ResourceUnavailable, StreamTimedOut
from volunteerd.identity import Identity
from volunteerd.net import connections
from volunteerd.net import flow as _flow  # patches Yamux's flow and TCP's reads and writes
from volunteerd.net.dialback import tcp_endpoint
from volunteerd.net.interfaces import dialable_addrs
from volunteerd.net.limits import MessagePacer
from volunteerd.net.peers import PeerAddress, is_circuit_addr, key_pair_for, short
from volunteerd.net.peerstore import NodePeerStore
from volunteerd.net.transport import StreamHandler

__all__ = [
    "DIAL_STAGGER_S",
    "Libp2pStream",
    "Libp2pStreamHost",
    "dial_in_turn",
    "listen_multiaddr",
    "open_host",
    "peer_endpoint",
    "transport_addrs",
]

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 3.0


def listen_multiaddr(host: str, port: int) -> str:
    family = "ip6" if ":" in host else "ip4"
    return f"/{family}/{host}/tcp/{port}"


# py-libp2p's Yamux frames are up to 64 KiB + 12 bytes of header, one byte more than a
# Noise message holds (65519 bytes of plaintext), so every full frame became two Noise
# messages, the second 29 bytes long: twice the per-message work of encrypting, framing
# and scheduling. Frames that fit one Noise message move ~40% more data per CPU second
# (docs/decisions/0004). Smaller frames are always valid Yamux, so peers are unaffected.
_yamux.MAX_MESSAGE_SIZE = min(_yamux.MAX_MESSAGE_SIZE, _NOISE_MAX_PLAINTEXT)

# A Yamux data frame's payload, and the most a relayed connection writes at once: such a
# connection is Noise + Yamux inside a Yamux stream of the connection to the relay, so
# each of its Noise messages (frame + 18 bytes) must fit one outer frame's payload, or
# every full inner message crosses each hop as two outer frames, the second tiny.
_NOISE_OVERHEAD = 2 + 16  # a Noise message's length prefix and its AEAD tag
_FRAME_PAYLOAD = _yamux.MAX_MESSAGE_SIZE - _yamux.HEADER_SIZE
_RELAYED_WRITE = _FRAME_PAYLOAD - _yamux.HEADER_SIZE - _NOISE_OVERHEAD


async def _credit_when_half_consumed(stream: _yamux.YamuxStream, *, bytes_read: int = 0) -> None:
    """Yamux receive-window credit, returned once half of the window has been read.

    py-libp2p 0.8.1 sends a WINDOW_UPDATE after every read, however small: a small RPC
    costs a window update per read on each side, and over a relay each update is itself
    data on the outer connections (which answer with updates of their own): ~35 TCP
    writes for one small relayed RPC instead of 4, five times its latency. Credit
    returned in halves of the window is what go-yamux does; the sender still has at
    least half a window in hand, so nothing stalls, and the window still grows (the
    library's auto-tuning runs whenever credit is sent)."""
    del bytes_read  # what was read is what the window lacks: counted below
    async with stream.window_lock:
        buffered = len(stream.conn.stream_buffers.get(stream.stream_id, b""))
        consumed = stream.target_recv_window - (stream.recv_window + buffered)
        if consumed < stream._grow_threshold():
            return
        credit = stream._grow_to_delta(buffered) + stream._apply_autotune_epoch(buffered)
    if credit > 0:
        await stream.send_window_update(credit, skip_lock=True)


_yamux.YamuxStream._auto_tune_and_send_window_update = _credit_when_half_consumed  # type: ignore[method-assign,assignment]


# py-libp2p 0.8.1's Yamux.close ends with a 0.1 s sleep, after the socket is closed and
# its on_close callback has run: nothing is left to wait for. Every close paid it (a
# dial-back probe's reply waited for it; so did each connection closed at shutdown,
# one after another). The callback is the close's last step before that sleep, so a
# hook around it ends the close there. Its multistream selector builds the library's
# class itself (not the one given in muxer_opt), hence a patch rather than a subclass.
# tests/unit/test_yamux_close.py checks the library's close still ends as assumed.
#
# The close is also bounded: until its callback starts (the GO_AWAY written, the socket
# closed) it may take _CLOSE_STUCK_S. A peer that stopped reading its socket held the
# GO_AWAY's write, and so every close and hang-up of the connection, all of them in
# shielded scopes, forever. Past the bound the socket is closed under it (flow.abort:
# what was blocked fails at once) and the close runs again, to its end.
_library_yamux_close = Yamux.close
_CLOSE_STUCK_S = 1.0


@dataclass(eq=False, slots=True)
class _Closing:
    """One task's close of a connection: the scope its trailing nap is cut with, and
    the bound on the steps before its callback."""

    nap: trio.CancelScope
    stuck: trio.CancelScope


async def _close_without_nap(self: Yamux, error_code: int = _yamux.GO_AWAY_NORMAL) -> None:
    closing: dict[Any, _Closing] | None = getattr(self, "_volunteerd_closing", None)
    if closing is None:
        closing = self._volunteerd_closing = {}  # type: ignore[attr-defined]
        callback = self.on_close

        async def then_stop() -> None:
            entry = closing.get(trio.lowlevel.current_task())
            if entry is not None:
                entry.stuck.deadline = math.inf  # the callback takes what it takes
            try:
                if callback is not None:
                    await callback()
            finally:
                if entry is not None:
                    entry.nap.cancel()  # only the trailing sleep is left

        self.on_close = then_stop
    task = trio.lowlevel.current_task()
    with trio.CancelScope() as nap:
        try:
            with trio.move_on_after(_CLOSE_STUCK_S) as stuck:
                closing[task] = _Closing(nap, stuck)
                await _library_yamux_close(self, error_code)
            if stuck.cancelled_caught:
                logger.info("%s: its connection's close is stuck; cut", short(str(self.peer_id)))
                _flow.abort(self)
                closing[task] = _Closing(nap, trio.CancelScope())
                await _library_yamux_close(self, error_code)
        finally:
            closing.pop(task, None)


Yamux.close = _close_without_nap  # type: ignore[method-assign]


# py-libp2p 0.8.1's TrioTCPStream.get_remote_address gives None unless the socket's
# getpeername() is a 2-tuple, and an IPv6 socket's is (host, port, flowinfo, scope_id):
# no IPv6 peer had an address, so every limit kept by address let it by (connection
# slots, per_address budgets, the pacers, relay reservations, the DHT store's /48
# quota, the swarm clock's vote by /48: 100 identities from one IPv6 address kept 100
# connections where one IPv4 address keeps 64), and its calls were taken for relayed
# ones. Everything here and in the library reads a peer's address through this one
# method (remote_host, direct_ips, the slots per address, the relay's reservations),
# so it is mended once, here: an IPv6 peer's (host, port) is the first two, and an
# IPv4 peer of a "::" listener ('::ffff:a.b.c.d') is the IPv4 address it is.
# tests/integration/test_ipv6.py checks both on real sockets.
def peer_endpoint(peer: object) -> tuple[str, int] | None:
    """``(host, port)`` of a socket's ``getpeername()`` of either family; an
    IPv4-mapped IPv6 host as its IPv4 address, a link-local one without its scope."""
    if not isinstance(peer, tuple) or len(peer) < 2:
        return None
    host = str(peer[0]).split("%", 1)[0]
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            host = str(ip.ipv4_mapped)
    return host, int(peer[1])


def _remote_address(self: _io.TrioTCPStream) -> tuple[str, int] | None:
    if self._cached_remote_address is None:
        try:
            self._cached_remote_address = peer_endpoint(self.stream.socket.getpeername())
        except (AttributeError, OSError):  # no socket, or a closed one: not known
            return None
    return self._cached_remote_address


_io.TrioTCPStream.get_remote_address = _remote_address  # type: ignore[method-assign]


# A relay copies each circuit's bytes in reads of up to 65535 bytes, each written on in
# one piece: a full read left as a full Yamux frame and a 28-byte one. Reads of one
# frame's payload leave as one frame.
_relay_protocol.MAX_READ_LEN = _FRAME_PAYLOAD


# py-libp2p dials a peer's addresses "happy eyeballs" style: after starting each dial it
# waits 250 ms (or until that dial fails) before the next, and it waits after the last
# one too, success or not, so every new connection took at least 250 ms (7 ms on
# loopback without it): each first contact of a lookup, a join, a trainer's dispatch.
# It picks one address per transport class and this host has one class (TCP), so there
# is no second dial to give a head start to; where a peer's addresses do fall in two
# classes, both are dialled at once instead of 250 ms apart. That one is the first the
# peer store holds: a lookup dials the addresses referrers give for a stranger itself,
# each in turn (net/lookup.py, PeerLookup._dial), so a stranger's cannot hide another's.
_swarm_module._HAPPY_EYEBALLS_DELAY = 0.0


class _NoAutoConnect(AutoConnector):
    """py-libp2p's swarm dials peers from its peerstore until it holds ~200 connections.
    A volunteer's home connection should carry only the connections we use, so the
    auto-connector never starts (Kademlia lookups and our verbs dial what they need)."""

    async def start(self) -> None:
        self._started = False

    def record_disconnect(self, peer_id: Any) -> None:
        """Nothing: the swarm noted every peer that ever disconnected, for a back-off
        only the auto-connector reads, and only its rounds pruned the note (~130 KiB
        per 1,000 strangers, for as long as the node ran)."""


def unlimited_resource_manager() -> ResourceManager:
    """py-libp2p's resource manager with none of its limits: this node keeps its own
    (inbound slots and slots per address in ``net/connections.py``, each peer's and
    address's budgets and pacers, ``wire.max_inflight_mib``).

    ``new_host()`` makes one with defaults when given none, and those broke a busy
    node: at most 256 established inbound connections (whatever
    ``network.max_connections`` says; the 257th peer's connection was closed after its
    handshake), and each connection it turned away kept two of the 1,000 connections
    it counts in all, for good: after a few hundred turned away it refused almost every
    newcomer, until restarted. Its other defaults would refuse connections above 90 %
    of the computer's memory in use (a volunteer's desktop gets there) and more than 10
    connections a second from one peer."""
    unlimited = 1 << 62
    return ResourceManager(
        limits=ResourceLimits(
            max_connections=unlimited, max_memory_mb=unlimited, max_streams=unlimited
        ),
        connection_limits=ConnectionLimits(),  # None everywhere: no limit
        enable_metrics=False,
        enable_connection_tracking=False,
        enable_memory_limits=False,
        enable_circuit_breaker=False,
        enable_graceful_degradation=False,
        enable_rate_limiting=False,
    )


def build_host(
    identity: Identity,
    announce_addrs: Sequence[str] = (),
    max_connections: int = 1000,
    per_address: connections.AddressSlots | None = None,
    small_frames: MessagePacer | None = None,
    unpaced: Callable[[ID], bool] = lambda peer_id: False,
    wire: _flow.WireMeter | None = None,
) -> IHost:
    """A host that is not yet running; ``max_connections`` bounds inbound and outbound
    connections together (a tenth of them, at least 8, stay free for our own dials),
    ``per_address`` the inbound connections of each IP address (default: 64),
    ``small_frames`` paces the small Yamux frames each peer sends (default: unpaced),
    except from the peers ``unpaced`` names (our relays: their connection carries
    every circuit's frames); ``wire`` counts every byte through the socket of every
    TCP connection, its payload (``_meter_connections``; default: none counted)."""
    key_pair = key_pair_for(identity)
    noise = NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
    reserve = max(8, max_connections // 10)
    peerstore = NodePeerStore(ID.from_pubkey(key_pair.public_key))
    host = new_host(
        resource_manager=unlimited_resource_manager(),
        peerstore_opt=peerstore,
        key_pair=key_pair,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        announce_addrs=[multiaddr.Multiaddr(a) for a in announce_addrs] or None,
        addrs_factory=None if announce_addrs else dialable_addrs,
        # py-libp2p's own pruner starts above high_watermark; idle connections are
        # trimmed by net/connections.py instead, so it never runs.
        connection_config=ConnectionConfig(
            max_connections=max_connections,
            min_connections=reserve,
            low_watermark=reserve,
            high_watermark=max_connections,
        ),
    )
    swarm = host.get_network()
    if not isinstance(swarm, Swarm):  # new_host always builds a Swarm
        raise TypeError(f"unexpected network {type(swarm).__name__}")
    peerstore.connected = lambda peer_id: bool(swarm.connections.get(peer_id))
    connections.install(swarm, per_address)
    if small_frames is not None:
        _pace_small_frames(swarm, small_frames, unpaced)
    swarm.auto_connector = _NoAutoConnect(swarm)  # type: ignore[attr-defined]
    # The default retries a refused dial three times with backoff (0.7 s per dead peer,
    # paid again by every lookup that meets it). Refused is refused: retry once, soon.
    swarm.retry_config = RetryConfig(max_retries=1, initial_delay=0.05)  # type: ignore[attr-defined]
    _keep_own_dials(host, peerstore)
    if wire is not None:
        _meter_connections(swarm, wire)
    return host


def _meter_connections(swarm: Swarm, wire: _flow.WireMeter) -> None:
    """Every raw connection the swarm secures, inbound or outbound (a reachability
    probe's own dial too), has its TCP bytes counted into ``wire`` from before its
    security negotiation (``flow.meter``): the quotas count what crosses the wire, not
    only the RPC streams' payload. A relayed connection has no socket of its own: its
    bytes are counted on the connection to the relay, once."""
    upgrader = swarm.upgrader
    upgrade_security = upgrader.upgrade_security

    async def metered(raw_conn: Any, is_initiator: bool, peer_id: ID | None = None) -> Any:
        _flow.meter(raw_conn, wire)
        return await upgrade_security(raw_conn, is_initiator, peer_id)

    upgrader.upgrade_security = metered  # type: ignore[method-assign]


def _direct_addrs(addrs: Iterable[str]) -> list[str]:
    """Those of a peer's announced ``addrs`` to dial in turn when it has several: its
    direct TCP addresses, once each and at most ``_DIAL_AT_MOST``, loopback ones left
    out when it has others (as py-libp2p's swarm does: a remote peer's 127.0.0.1 is this
    computer). Several are common: a volunteer announces the public address peers
    dialled back first, then its own (a LAN address, an IPv6 one); a trainer on the
    same LAN, or one without IPv6, reaches only a later one."""
    endpoints = {a: e for a in addrs if (e := tcp_endpoint(a)) is not None}
    remote = [a for a, (ip, _) in endpoints.items() if not ipaddress.ip_address(ip).is_loopback]
    return (remote or list(endpoints))[:_DIAL_AT_MOST]


# py-libp2p's connect keeps the addresses it is given for this long before dialling them.
_CONNECT_ADDR_TTL_S = 120


def _keep_own_dials(host: IHost, peerstore: NodePeerStore) -> None:
    """``host.connect`` keeps the addresses it is given, a DNS name included, before
    py-libp2p's own connect stores them (through the peer store's bounds, which drop
    names) and dials what the peer store holds: this node's own choice of address (a
    bootstrap peer's ``/dns4/...``) is dialled, a name a stranger claims is not."""
    connect = host.connect

    async def connect_to_own_choice(peer_info: PeerInfo) -> None:
        peerstore.add_own_addrs(peer_info.peer_id, list(peer_info.addrs), _CONNECT_ADDR_TTL_S)
        await connect(peer_info)

    host.connect = connect_to_own_choice  # type: ignore[method-assign]


# A frame carrying fewer bytes than this is "small": a control frame (window update,
# ping, a stream's SYN, FIN or RST) or a data frame with little in it.
_SMALL_FRAME = 1024
# Small frames are charged this many at a time: a flood then costs one sleep per
# batch, not one per frame (a trio sleep costs more than the frame).
_SMALL_FRAMES_CHARGED = 16


def _pace_small_frames(swarm: Swarm, pacer: MessagePacer, unpaced: Callable[[ID], bool]) -> None:
    """Each small Yamux frame a peer sends waits for a token of ``pacer`` (its peer's
    and its address's) before the next frame is read.

    py-libp2p handles a Yamux frame in Python (~7 µs each, most of it log messages
    formatted whether logged or not): one peer sending 12-byte window updates for a
    stream that does not exist, 1.7 MB/s, took a daemon's whole core. Honest traffic
    is mostly frames of up to 64 KiB; its small frames (a window update per 128 KiB
    read, a few per stream opened) come far below the rate. Waiting stops reading the
    connection, so TCP slows the sender down; nothing is refused."""
    muxers = swarm.upgrader.muxer_multistream
    new_conn = muxers.new_conn

    async def paced(conn: Any, peer_id: ID) -> Any:
        return await new_conn(_SmallFramesPaced(conn, pacer, peer_id, unpaced), peer_id)

    muxers.new_conn = paced  # type: ignore[method-assign]


class _SmallFramesPaced:
    """A secured connection as Yamux reads it: after the header of every
    ``_SMALL_FRAMES_CHARGED``-th small frame, the read waits for the peer's turn for
    that many. Everything else is the connection's own."""

    def __init__(
        self, conn: Any, pacer: MessagePacer, peer_id: ID, unpaced: Callable[[ID], bool]
    ) -> None:
        self._conn = conn
        self._pacer = pacer
        self._peer = peer_id
        self._peer_id = str(peer_id)
        self._ip = _connection_host(conn)
        self._unpaced = unpaced
        self._uncharged = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def read(self, n: int | None = None) -> bytes:
        data: bytes = await self._conn.read(n)
        if n == _yamux.HEADER_SIZE and len(data) == n:  # Yamux reads a header whole
            _, kind, _, _, length = struct.unpack(_yamux.YAMUX_HEADER_FORMAT, data)
            if kind != _yamux.TYPE_DATA or length < _SMALL_FRAME:
                self._uncharged += 1
                if self._uncharged >= _SMALL_FRAMES_CHARGED:
                    self._uncharged = 0
                    if not self._unpaced(self._peer):
                        await self._pacer.wait(self._peer_id, self._ip, _SMALL_FRAMES_CHARGED)
        return data

    async def write(self, data: bytes) -> None:
        await self._conn.write(data)


def check_port_free(host: str, port: int) -> None:
    """Raise ResourceUnavailable if another process listens on ``host:port``.

    py-libp2p listens with SO_REUSEPORT (for hole punching), so a second daemon on the
    same port would start without error and silently share its connections. A bind
    without that option fails while another socket listens on the port. It sets
    SO_REUSEADDR, as every listener should: the connections of a daemon that just
    stopped linger in TIME-WAIT for a minute, and must not keep its restart from
    binding (a second daemon on one data folder is caught by its lock file).
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if os.name != "nt":  # on Windows the option would let us steal a live port
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ResourceUnavailable(
                f"cannot listen on {host}:{port}: {exc.strerror} (is another volunteerd "
                "running? choose another port with --port)"
            ) from None


@asynccontextmanager
async def open_host(
    identity: Identity,
    listen_addr: str | None,
    announce_addrs: Sequence[str] = (),
    max_connections: int = 1000,
    per_address: connections.AddressSlots | None = None,
    small_frames: MessagePacer | None = None,
    unpaced: Callable[[ID], bool] = lambda peer_id: False,
    wire: _flow.WireMeter | None = None,
) -> AsyncIterator[IHost]:
    """A running host listening on ``listen_addr`` (None: on nothing, a relay-only
    node); closed when the block exits. ``max_connections``, ``per_address``,
    ``small_frames``, ``unpaced`` and ``wire`` as for ``build_host``.

    Raises ResourceUnavailable when the port is taken."""
    listen = []
    if listen_addr is not None:
        address = multiaddr.Multiaddr(listen_addr)
        ip = address.value_for_protocol("ip6" if "/ip6/" in listen_addr else "ip4")
        check_port_free(str(ip), int(address.value_for_protocol("tcp")))
        listen.append(address)
    host = build_host(
        identity, announce_addrs, max_connections, per_address, small_frames, unpaced, wire
    )
    made = _track_connections(host)
    async with host.run(listen):
        logger.info("listening on %s", ", ".join(transport_addrs(host)))
        try:
            yield host
        finally:
            # py-libp2p's own shutdown path closes sockets while already cancelled, so
            # they leak and peers keep dialling a listener nobody serves. Close them
            # first, shielded and bounded; then every connection the swarm has let go
            # of without closing (one trimmed as a duplicate, whose close was left to
            # a background task that shutting down cancels). The swarm closes its
            # connections one after another, each ≥ 0.1 s (a pause for stream
            # handlers): a node with a few dozen peers would reach the time limit with
            # most of them still open, so they are closed all at once first.
            with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT_S):
                swarm = host.get_network()
                await _close_all(c for conns in swarm.connections.values() for c in conns)
                await swarm.close()
                await _close_all(m for m in made if not m.is_closed)


async def _close_all(closeables: Iterable[Any]) -> None:
    """Close every one of ``closeables`` (connections) at once; failures are ignored."""

    async def close(closeable: Any) -> None:
        with contextlib.suppress(Exception):
            await closeable.close()

    async with trio.open_nursery() as nursery:
        for closeable in list(closeables):
            nursery.start_soon(close, closeable)


def _track_connections(host: IHost) -> weakref.WeakSet[Any]:
    """Every muxed connection ``host``'s swarm takes in, while it lives."""
    swarm = host.get_network()
    made: weakref.WeakSet[Any] = weakref.WeakSet()
    add_conn = swarm.add_conn  # type: ignore[attr-defined]

    async def tracked(muxed_conn: Any, *args: Any, **kwargs: Any) -> Any:
        made.add(muxed_conn)
        return await add_conn(muxed_conn, *args, **kwargs)

    swarm.add_conn = tracked  # type: ignore[attr-defined]
    return made


def transport_addrs(host: IHost) -> list[str]:
    """The host's dialable addresses without the /p2p/ suffix."""
    return list(dict.fromkeys(str(addr).split("/p2p/")[0] for addr in host.get_addrs()))


class Libp2pStream:
    """A py-libp2p stream as a ``transport.Stream``: EOF is ``b""``, not ``StreamEOF``.

    On a relayed connection writes go out in pieces that each cross the relay's
    connections as one Yamux frame (``_RELAYED_WRITE``)."""

    __slots__ = ("_max_write", "_stream", "remote_host", "remote_peer_id")

    def __init__(self, stream: INetStream) -> None:
        self._stream = stream
        self.remote_peer_id = str(stream.muxed_conn.peer_id)
        self._max_write = _RELAYED_WRITE if _is_relayed(stream.muxed_conn) else 0
        self.remote_host = remote_host(stream)

    async def read(self, n: int) -> bytes:
        try:
            return await self._stream.read(n)
        except StreamEOF:
            return b""

    async def write(self, data: bytes) -> None:
        if not self._max_write or len(data) <= self._max_write:
            await self._stream.write(data)
            return
        view = memoryview(data)
        for start in range(0, len(view), self._max_write):
            await self._stream.write(bytes(view[start : start + self._max_write]))

    async def close(self) -> None:
        await self._stream.close()

    async def reset(self) -> None:
        await self._stream.reset()


def remote_host(stream: INetStream) -> str | None:
    """The IP address ``stream``'s connection comes from; None when relayed (that
    would be the relay's) or not known."""
    return _connection_host(stream.muxed_conn)


def _connection_host(connection: Any) -> str | None:
    """The IP address a connection (muxed or secured) comes from, as ``remote_host``."""
    if _is_relayed(connection):
        return None
    try:
        remote = connection.get_remote_address()
    except Exception:  # a connection that does not say, or a closing one
        return None
    return str(remote[0]) if remote else None


def _is_relayed(connection: Any) -> bool:
    try:
        return bool(connection.get_connection_type() == ConnectionType.RELAYED)
    except Exception:  # a connection that does not say: treat it as direct
        return False


def _broke_in_handshake(exc: BaseException) -> bool:
    """Whether py-libp2p's failure to open a stream was the multistream handshake's
    write or read failing (the stream broke), not a refusal or a timeout."""
    seen: BaseException | None = exc
    for _ in range(8):  # the chain of causes, bounded
        if seen is None:
            return False
        text = str(seen)
        if "handshake write failed" in text or "handshake read failed" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _timed_out(exc: BaseException) -> bool:
    """Whether py-libp2p's failure to open a stream came from waiting in vain (its
    protocol negotiation's "response timed out"), not from a refusal."""
    seen: BaseException | None = exc
    for _ in range(8):  # the chain of causes, bounded
        if seen is None:
            return False
        if isinstance(seen, TimeoutError | trio.TooSlowError) or "timed out" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# A peer's addresses are dialled one after another this far apart (or sooner, as each
# fails) until one connects: py-libp2p's swarm dials only the first of them.
DIAL_STAGGER_S = 0.25
# At most this many of a peer's direct addresses are dialled for one connection.
_DIAL_AT_MOST = 4


async def dial_in_turn(
    host: IHost, peer: ID, addrs: Sequence[str], within_s: float, stagger_s: float
) -> tuple[str | None, tuple[str, ...]]:
    """Dial ``addrs`` in their order, each started ``stagger_s`` after the one before or
    as soon as it failed, all within ``within_s``; the first connection wins and the
    dials still under way stop. The address that connected (None: none did), and those
    that failed or were still under way at the end.

    py-libp2p's swarm dials one address of a peer (one per transport class, and
    volunteerd has one: TCP), the first in its peer store: the others were never tried
    however dead the first was."""
    network: Any = host.get_network()
    started: list[str] = []
    failed: list[str] = []
    won: list[str] = []

    async def attempt(addr: str, done: trio.Event) -> None:
        try:
            await network._dial_addr_single_attempt(multiaddr.Multiaddr(addr), peer)
        except Exception as exc:  # refused, timed out, another peer's key
            logger.debug("%s at %s: %s", short(str(peer)), addr, exc or type(exc).__name__)
            failed.append(addr)
            done.set()
            return
        won.append(addr)
        nursery.cancel_scope.cancel()

    with trio.move_on_after(within_s):
        async with trio.open_nursery() as nursery:
            for addr in addrs:
                done = trio.Event()
                started.append(addr)
                nursery.start_soon(attempt, addr, done)
                with trio.move_on_after(stagger_s):
                    await done.wait()
    if won:
        return won[0], tuple(failed)
    return None, tuple(a for a in started if a not in failed) + tuple(failed)


@dataclass(eq=False, slots=True)
class _Dialing:
    """The dial of one peer: its lock, and how many callers hold or await it."""

    lock: trio.Lock = field(default_factory=trio.Lock)
    users: int = 0


class Libp2pStreamHost:
    """py-libp2p's ``host`` as a ``transport.StreamHost``.

    One connection per peer, reused by every stream. ``connect_circuit`` (set by
    ``open_node``) connects to a peer whose addresses include relay circuits."""

    def __init__(self, host: IHost) -> None:
        self._host = host
        self.peer_id = str(host.get_id())
        self.connect_circuit: Callable[[PeerAddress], Awaitable[None]] | None = None
        # One dial at a time per peer, held only while someone dials it: a node that
        # dials thousands of peers over weeks (the DHT names them) keeps none of these.
        self._connecting: dict[str, _Dialing] = {}

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        async def on_stream(stream: INetStream) -> None:
            await handler(Libp2pStream(stream))

        self._host.set_stream_handler(TProtocol(protocol), on_stream)

    async def open_stream(self, peer: PeerAddress, protocol: str) -> Libp2pStream:
        """A new stream to ``peer`` for ``protocol``, connecting first if need be.

        A stream that broke before its protocol was negotiated (py-libp2p could not
        write or read the multistream handshake: the stream was reset, or the connection
        was closing) is tried once more, on a new connection if the old one is gone:
        a CI run saw a client's call fail so beside a healthy server. A refusal or a
        timeout is not tried again."""
        try:
            peer_id = ID.from_base58(peer.peer_id)
            for tries_left in (1, 0):
                await self._ensure_connected(peer, peer_id)
                try:
                    stream = await self._host.new_stream(peer_id, [TProtocol(protocol)])
                    break
                except Exception as exc:
                    if not tries_left or not _broke_in_handshake(exc):
                        raise
                    logger.debug("%s: a new stream broke (%s); once more", short(peer.peer_id), exc)
        except (trio.Cancelled, KeyboardInterrupt, PeerUnreachable):
            raise
        except Exception as exc:
            kind = StreamTimedOut if _timed_out(exc) else PeerUnreachable
            raise kind(f"{short(peer.peer_id)}: {str(exc) or type(exc).__name__}") from None
        return Libp2pStream(stream)

    async def connect(self, peer: PeerAddress) -> None:
        try:
            await self._ensure_connected(peer, ID.from_base58(peer.peer_id))
        except (trio.Cancelled, KeyboardInterrupt, PeerUnreachable):
            raise
        except Exception as exc:
            raise PeerUnreachable(
                f"{short(peer.peer_id)}: {str(exc) or type(exc).__name__}"
            ) from None

    async def hang_up(self, peer_id: str) -> None:
        try:
            pid = ID.from_base58(peer_id)
        except Exception:  # a malformed peer id has no connection
            return
        with contextlib.suppress(Exception):  # already gone, or closing: nothing to do
            await self._host.disconnect(pid)

    async def _ensure_connected(self, peer: PeerAddress, peer_id: ID) -> None:
        if self._host.get_network().connections.get(peer_id):
            return
        dialing = self._connecting.setdefault(peer.peer_id, _Dialing())
        dialing.users += 1
        try:
            async with dialing.lock:
                if self._host.get_network().connections.get(peer_id):
                    return
                if self.connect_circuit is not None and any(is_circuit_addr(a) for a in peer.addrs):
                    await self.connect_circuit(peer)
                    return
                info = peer.peer_info()
                self._prefer_announced(peer_id, list(info.addrs))
                direct = _direct_addrs(peer.addrs)
                if len(direct) < 2:
                    await self._host.connect(PeerInfo(peer_id, list(info.addrs)))
                    return
                won, _ = await dial_in_turn(self._host, peer_id, direct, math.inf, DIAL_STAGGER_S)
                if won is None:
                    raise PeerUnreachable(
                        f"{short(peer.peer_id)}: none of its {len(direct)} addresses connected"
                    )
                self._host.get_peerstore().add_addrs(
                    peer_id, [multiaddr.Multiaddr(won)], _CONNECT_ADDR_TTL_S
                )
        finally:
            dialing.users -= 1
            if not dialing.users:
                del self._connecting[peer.peer_id]

    def dials_under_way(self) -> int:
        """Peers being dialled now (for tests and diagnostics)."""
        return len(self._connecting)

    def _prefer_announced(self, peer_id: ID, addrs: list[Any]) -> None:
        """Dial the addresses the peer announces now, not older ones.

        py-libp2p dials the addresses it already knows for a peer, first ones first, and
        after a failed dial refuses to dial that peer again for 60 s. A volunteer that
        restarted on a new port would stay unreachable for that long; so when the
        announced addresses differ from the known ones, the known ones are replaced and
        the failure forgotten."""
        if not addrs:
            return
        peerstore = self._host.get_peerstore()
        try:
            known = set(peerstore.addrs(peer_id))
        except Exception:  # py-libp2p raises when it knows none
            known = set()
        if known == set(addrs):
            return
        peerstore.clear_addrs(peer_id)
        failed = getattr(self._host.get_network(), "_negative_peer_cache", None)
        if failed is not None and hasattr(failed, "evict"):
            failed.evict(str(peer_id))
