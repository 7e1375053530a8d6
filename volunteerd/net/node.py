"""A running libp2p node: host, Kademlia routing, our RPC server and client, the DHT.

Our verbs reach the network through ``streams`` (the host seen as a
``net/transport.StreamHost``); Kademlia, reachability and connection trimming use
py-libp2p's ``host`` itself.

``open_node`` is the one way to get one; the node lives inside its ``async with``.
Daemons and trainers both run their DHT in server mode: py-libp2p's client-mode
nodes pollute the routing tables of servers (docs/decisions/0002).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from libp2p.abc import IHost
from libp2p.host.ping import ID as PING_ID
from libp2p.host.ping import perform_ping_roundtrip
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.tools.anyio_service import background_trio_service

from volunteerd.config import Config, TimeoutsConfig
from volunteerd.identity import Identity
from volunteerd.net.connections import AddressSlots, IdleTrimmer
from volunteerd.net.dht import ExpertDHT
from volunteerd.net.host import Libp2pStreamHost, listen_multiaddr, open_host, transport_addrs
from volunteerd.net.kademlia import serve_kademlia
from volunteerd.net.limits import MessagePacer
from volunteerd.net.lookup import PeerLookup
from volunteerd.net.open_files import FD_RESERVE, connection_cap, open_file_limit
from volunteerd.net.paced import pace_services, pace_streams
from volunteerd.net.peers import PeerAddress, parse_peer_multiaddr, short
from volunteerd.net.protocols import Verb
from volunteerd.net.reachability import DialBackServer, Reachability, Relaying
from volunteerd.net.rpc import Handler, RpcClient, RpcServer
from volunteerd.net.throttle import Throttle

__all__ = ["REJOIN_CHECK_S", "REJOIN_EVERY_S", "REJOIN_MAX_WAIT_S", "Node", "open_node"]

logger = logging.getLogger(__name__)

_EXPIRE_EVERY_S = 10.0
# Staying joined (``_stay_joined``): how often a node checks that it is, the longest it
# waits between tries while the bootstrap peers do not answer, and how often a node
# connected to none of them but to others joins through them again anyway.
REJOIN_CHECK_S = 15.0
REJOIN_MAX_WAIT_S = 300.0
REJOIN_EVERY_S = 120.0
# How often ``_stay_joined`` looks at this computer's addresses while it waits.
_WATCH_ADDRS_S = 10.0


@dataclass(slots=True)
class Node:
    host: IHost
    streams: Libp2pStreamHost
    identity: Identity
    peer_id: str
    rpc: RpcClient
    server: RpcServer
    dht: ExpertDHT
    throttle: Throttle
    connections: IdleTrimmer
    reachability: Reachability | None = None
    # Inbound connections per IP address, and how many were refused for it.
    address_slots: AddressSlots | None = None
    # Kademlia messages answered for others, and how often one had to wait its turn.
    kademlia: MessagePacer | None = None
    # Identify and ping streams (and pings) answered for others, and the waits.
    services: MessagePacer | None = None
    # Inbound streams (any protocol) negotiated for others, and the waits.
    negotiations: MessagePacer | None = None
    # Small Yamux frames read from others, and the waits.
    small_frames: MessagePacer | None = None

    @property
    def addrs(self) -> list[str]:
        """Dialable addresses (announce addresses if configured; circuit addresses
        through a relay when peers cannot dial this node)."""
        if self.reachability is not None:
            return self.reachability.announce_addrs
        return transport_addrs(self.host)

    @property
    def address(self) -> PeerAddress:
        return PeerAddress(self.peer_id, tuple(self.addrs))

    @property
    def multiaddrs(self) -> list[str]:
        return [f"{a}/p2p/{self.peer_id}" for a in self.addrs]

    def connected_peers(self) -> list[str]:
        """The peers this node has an open connection with now."""
        return [str(p) for p in self.host.get_connected_peers()]


@asynccontextmanager
async def open_node(
    identity: Identity,
    config: Config,
    handlers: Mapping[Verb, Handler] | None = None,
    throttle: Throttle | None = None,
    *,
    relay: bool = False,
) -> AsyncIterator[Node]:
    """Start a node, join the swarm through ``config.network.bootstrap_peers``, and
    serve ``handlers`` next to the DHT's own verbs. Every RPC stream passes through
    ``throttle`` (default: one made from ``config.limits``, counting in memory)."""
    throttle = throttle or Throttle(config.limits)
    network = config.network
    bootstrap = [parse_peer_multiaddr(a) for a in network.bootstrap_peers]
    # relay: serve as a circuit relay (bootstrap nodes); see net/reachability.py.
    listen = (
        listen_multiaddr(network.listen_host, network.port) if config.reachability.listen else None
    )
    per_address = AddressSlots(
        config.peer_limits.max_connections_per_address,
        limit_loopback=config.peer_limits.limit_loopback,
    )
    limits = config.peer_limits
    small_frames = MessagePacer.for_peers(
        limits.small_frames_per_s, limits.small_frame_burst, limits
    )
    relaying: Relaying | None = None

    def our_relay(peer_id: ID) -> bool:
        """Whether ``peer_id`` is a relay this node holds a reservation with."""
        return relaying is not None and relaying.reserved_with(peer_id)

    # as many as the open files allow, some kept for our own (net/open_files.py)
    file_limit = open_file_limit()
    max_connections = connection_cap(network.max_connections, file_limit)
    if max_connections < network.max_connections:
        logger.info(
            "at most %d connections, not network.max_connections (%d): the open-file "
            "limit is %s, %d of them kept for this process's own files (a higher hard "
            "limit allows more)",
            max_connections,
            network.max_connections,
            file_limit,
            FD_RESERVE,
        )
    async with open_host(
        identity,
        listen,
        network.announce_addrs,
        max_connections,
        per_address,
        small_frames,
        unpaced=our_relay,
        wire=throttle.wire_meter(),  # the quotas count every byte through the sockets
    ) as host:
        kad = KadDHT(host, DHTMode.SERVER, enable_random_walk=False)
        kademlia = serve_kademlia(host, kad, config)
        services = pace_services(host, config)
        negotiations = pace_streams(host, config, keep_connection=our_relay)
        # Lookups that believe only peers that answer (net/lookup.py), for ours and
        # for KadDHT's own refreshes alike.
        lookup = PeerLookup(host, kad.routing_table, config.timeouts.dht_rpc_s)
        kad.peer_routing.find_closest_peers_network = lookup.closest  # type: ignore[method-assign]
        async with background_trio_service(kad), trio.open_nursery() as nursery:
            streams = Libp2pStreamHost(host)
            rpc = RpcClient(streams, config.wire, config.timeouts, throttle=throttle)
            dht = ExpertDHT(
                host,
                kad,
                rpc,
                config.dht,
                config.timeouts,
                trusted_owners=config.experiments.trusted_owners,
            )
            server = RpcServer(
                streams,
                {**dht.handlers(), **DialBackServer(host).handlers(), **(handlers or {})},
                config.wire,
                config.timeouts,
                config.peer_limits,
                throttle,
            )
            server.install()
            trimmer = IdleTrimmer(host, config.timeouts.connection_idle_s)
            server.crowded = trimmer.crowded
            node = Node(
                host,
                streams,
                identity,
                streams.peer_id,
                rpc,
                server,
                dht,
                throttle,
                trimmer,
                address_slots=per_address,
                kademlia=kademlia,
                services=services,
                negotiations=negotiations,
                small_frames=small_frames,
            )
            nursery.start_soon(_expire_records, dht)
            nursery.start_soon(trimmer.serve)
            nursery.start_soon(throttle.serve)
            relaying = Relaying(
                host,
                hop=relay or config.reachability.act_as_relay,
                hole_punching=config.reachability.hole_punching,
                on_direct=rpc.forget,
                throttle=throttle,
                # never shorter than a request may wait for its answer
                circuit_idle_s=max(
                    config.timeouts.connection_idle_s, 1.5 * config.timeouts.request_s
                ),
                limit_loopback=config.peer_limits.limit_loopback,
                clock=dht.clock.now,
            )
            await nursery.start(relaying.serve)
            streams.connect_circuit = relaying.connect
            if bootstrap:
                joined = await dht.bootstrap(bootstrap)
                logger.info(
                    "joined the swarm through %d of %d bootstrap peers", joined, len(bootstrap)
                )
                nursery.start_soon(
                    _stay_joined, dht, host, rpc, tuple(bootstrap), joined > 0, config.timeouts
                )
            reach = Reachability(
                host,
                rpc,
                relaying,
                config.reachability,
                config.timeouts,
                bootstrap=tuple(bootstrap),
                port=network.port,
            )
            await reach.start()
            node.reachability = reach
            nursery.start_soon(reach.serve)
            try:
                yield node
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await rpc.aclose()


async def _stay_joined(
    dht: ExpertDHT,
    host: IHost,
    rpc: RpcClient,
    bootstrap: tuple[PeerAddress, ...],
    joined: bool,
    timeouts: TimeoutsConfig,
) -> None:
    """Join through ``bootstrap`` again whenever the node has lost the swarm.

    Joining once at start is not enough for a node that runs for weeks: a network that
    went away for minutes, a new address, a laptop's sleep or a restarted bootstrap node
    left nodes with no connection, or with one another but unknown to the bootstrap
    nodes, where newcomers look first: nobody found their experts until a human
    restarted them. Every ``REJOIN_CHECK_S`` (jittered), a node connected to none of its
    bootstrap peers joins through them again when it has no connection at all or none
    of them is in its routing table, and at least every ``REJOIN_EVERY_S`` otherwise; a
    node whose connections to its bootstrap peers were all replaced since the last check
    (one restarted) joins through them again at once;
    while they do not answer it waits twice as long each time, up to
    ``REJOIN_MAX_WAIT_S``.

    A connection counts only while it answers: one to a bootstrap peer whose last call
    or DHT request went unanswered, and each of them every ``REJOIN_EVERY_S`` and when
    this computer's addresses change, is pinged (within ``timeouts.connect_s``); one
    that gives no pong is closed, and the node joins again at once when none is left.
    A connection merely open stood for "joined": after this computer's address changed,
    its sockets from the vanished address stayed open and answered nothing, and the
    node stayed cut off until the kernel gave up on them (some 15 minutes; an outside
    probe with network namespaces). With no connection to them, a node whose addresses
    changed joins again at once, however long it was waiting: a laptop back on a network
    after an hour without waited up to ``REJOIN_MAX_WAIT_S``."""
    others = tuple(p for p in bootstrap if p.peer_id != str(host.get_id()))
    if not others:
        return
    ids = [ID.from_base58(p.peer_id) for p in others]
    last_joined = trio.current_time() if joined else -math.inf
    pinged = trio.current_time()
    wait = REJOIN_CHECK_S

    def open_now() -> list[object]:
        connections = host.get_network().connections
        return [c for p in ids for c in (connections.get(p) or [])]

    seen = open_now()  # the connections to bootstrap peers last seen
    while True:
        moved = await _nap(host, wait * random.uniform(0.8, 1.2))
        if moved:
            wait = REJOIN_CHECK_S  # a new network: its tries start afresh
        connections = host.get_network().connections
        now_open = open_now()
        # A connection opened since the last check (not by joining) may be to a
        # bootstrap node that restarted and knows nobody: a relayed node reserves again
        # on its restarted relay first, and then counted as joined to it, announced to
        # nobody and newcomers found none of its experts.
        reconnected = bool(now_open) and not any(c in seen for c in now_open)
        seen = now_open or seen
        open_ = [p for p in ids if connections.get(p)]
        if open_ and not reconnected:
            due = moved or trio.current_time() - pinged >= REJOIN_EVERY_S
            if due:
                pinged = trio.current_time()
            doubted = [
                p
                for p in open_
                if due or rpc.unanswered(p.to_base58()) or dht.silent(p.to_base58())
            ]
            silent = await _not_answering(host, doubted, timeouts.connect_s)
            for peer_id in silent:
                logger.info(
                    "bootstrap peer %s: its connection gives no pong; closing it",
                    short(peer_id.to_base58()),
                )
                await rpc.hang_up(peer_id.to_base58())
            if len(silent) < len(open_):
                last_joined, wait = trio.current_time(), REJOIN_CHECK_S
                continue
            lost = True
        else:
            lost = (
                moved
                or reconnected
                or not connections
                or not any(dht.knows(p.peer_id) for p in others)
            )
            if not lost and trio.current_time() - last_joined < REJOIN_EVERY_S:
                continue
        # py-libp2p refuses dials to a peer whose addresses all failed in the last 60 s
        # (its negative cache): these tries are spaced out already.
        unblock = getattr(host.get_network(), "unblock_peer", None)
        if unblock is not None:
            for peer_id in ids:
                unblock(peer_id)
        joined_now = await dht.bootstrap(others)
        seen = open_now() or seen
        if joined_now:
            logger.info(
                "joined the swarm again through %d of %d bootstrap peers%s",
                joined_now,
                len(others),
                " (it had lost it)" if lost else "",
            )
            last_joined, wait = trio.current_time(), REJOIN_CHECK_S
        else:
            wait = min(2 * wait, REJOIN_MAX_WAIT_S)


async def _not_answering(host: IHost, peer_ids: list[ID], within_s: float) -> list[ID]:
    """Those of ``peer_ids`` whose connection gives no pong (libp2p ping) within
    ``within_s``, asked together."""
    silent: list[ID] = []

    async def ping(peer_id: ID) -> None:
        try:
            with trio.fail_after(within_s):
                stream = await host.new_stream(peer_id, [PING_ID])
                try:
                    await perform_ping_roundtrip(stream)
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(1):
                        await stream.reset()
        except Exception as exc:  # no stream, no pong, a wrong pong: the same to us
            if not _refused(exc):
                silent.append(peer_id)

    async with trio.open_nursery() as nursery:
        for peer_id in peer_ids:
            nursery.start_soon(ping, peer_id)
    return silent


def _refused(exc: BaseException) -> bool:
    """Whether a stream failed because the peer refused its protocol: an answer (a peer
    that does not serve ping is alive)."""
    seen: BaseException | None = exc
    for _ in range(8):  # the chain of causes, bounded
        if seen is None:
            return False
        if isinstance(seen, MultiselectClientError) and "not supported" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def _nap(host: IHost, seconds: float) -> bool:
    """Sleep ``seconds``, looking at this computer's addresses every
    ``_WATCH_ADDRS_S``; True, at once, when they changed (another network, a new
    address from the router, the network back after a time without)."""
    addrs = transport_addrs(host)
    with trio.move_on_after(seconds):
        while True:
            await trio.sleep(_WATCH_ADDRS_S)
            if transport_addrs(host) != addrs:
                return True
    return False


async def _expire_records(dht: ExpertDHT) -> None:
    while True:
        await trio.sleep(_EXPIRE_EVERY_S)
        dht.expire()
