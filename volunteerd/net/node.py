"""A running libp2p node: host, Kademlia routing, our RPC server and client, the DHT.

Our verbs reach the network through ``streams`` (the host seen as a
``net/transport.StreamHost``); Kademlia, reachability and connection trimming use
py-libp2p's ``host`` itself.

``open_node`` is the one way to get one; the node lives inside its ``async with``.
Daemons and trainers both run their DHT in server mode: py-libp2p's client-mode
nodes pollute the routing tables of servers (docs/decisions/0002).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream
from libp2p.kad_dht.common import PROTOCOL_ID
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.tools.anyio_service import background_trio_service

from volunteerd.config import Config
from volunteerd.identity import Identity
from volunteerd.net.connections import AddressSlots, IdleTrimmer
from volunteerd.net.dht import ExpertDHT
from volunteerd.net.host import (
    Libp2pStreamHost,
    listen_multiaddr,
    open_host,
    remote_host,
    transport_addrs,
)
from volunteerd.net.limits import address_key
from volunteerd.net.lookup import PeerLookup
from volunteerd.net.peers import PeerAddress, parse_peer_multiaddr
from volunteerd.net.protocols import Verb
from volunteerd.net.reachability import DialBackServer, Reachability, Relaying
from volunteerd.net.rpc import Handler, RpcClient, RpcServer
from volunteerd.net.throttle import Throttle

__all__ = ["Node", "open_node"]

logger = logging.getLogger(__name__)

_EXPIRE_EVERY_S = 10.0


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


def _routing_only(kad: KadDHT) -> None:
    """Make ``kad`` keep nothing for others: volunteerd uses Kademlia for routing
    alone (FIND_NODE, PING; records go through ``ExpertDHT``'s own verbs).

    py-libp2p serves ADD_PROVIDER and PUT_VALUE in server mode whatever the caller
    uses, and keeps what they carry for 48 h and 24 h: provider entries with no cap on
    keys or on addresses (about 37 MiB held per 4 MiB message, from identities that
    cost nothing), values up to 50,000 entries. Here an ADD_PROVIDER is refused like
    one over py-libp2p's rate limit (the stream is reset, before its providers are
    read), and neither store takes an entry from any other path."""

    def refuse_providers(peer_id: object) -> bool:
        return False

    def keep_no_provider(key: bytes, provider: object) -> None:
        return None

    def keep_no_value(key: bytes, record: object) -> None:
        return None

    kad._check_provider_rate_limit = refuse_providers  # type: ignore[method-assign,assignment]
    kad.provider_store.add_provider = keep_no_provider  # type: ignore[method-assign,assignment]
    kad.value_store.put_record = keep_no_value  # type: ignore[method-assign,assignment]


# Inbound Kademlia streams served at once: in all (py-libp2p's 12, raised: a handler
# waiting on a peer costs nothing), from one peer (a node runs at most 4 lookups at once,
# each asking a peer one FIND_NODE per stream: ``ExpertDHT._lookups``), and from one
# address's peers together.
_KADEMLIA_STREAMS = 32
_KADEMLIA_STREAMS_PER_PEER = 4
_KADEMLIA_STREAMS_PER_ADDRESS = 8


def _bound_kademlia_streams(host: IHost, kad: KadDHT, config: Config) -> None:
    """Keep one peer from taking every Kademlia handler of this node.

    py-libp2p serves at most 12 inbound Kademlia streams at once, resets any beyond,
    and waits on each for its next message without a deadline: one peer holding 12
    streams open without a word made the node answer no FIND_NODE to anyone. Here
    ``_KADEMLIA_STREAMS`` are served in all, a peer has at most
    ``_KADEMLIA_STREAMS_PER_PEER`` of them and the peers of one address
    (``limits.address_key``; none for loopback and relayed peers) at most
    ``_KADEMLIA_STREAMS_PER_ADDRESS``, the rest reset before they reach py-libp2p's
    handler; and a stream is served for at most twice ``timeouts.dht_rpc_s``, then
    reset."""
    limits = config.peer_limits
    lifetime_s = 2 * config.timeouts.dht_rpc_s
    kad._inbound_limiter = trio.CapacityLimiter(_KADEMLIA_STREAMS)
    serving: Counter[str] = Counter()

    async def handle(stream: INetStream) -> None:
        peer = f"peer:{stream.muxed_conn.peer_id}"
        address = address_key(remote_host(stream), loopback=limits.limit_loopback)
        sources = [peer] if address is None else [peer, address]
        if serving[peer] >= _KADEMLIA_STREAMS_PER_PEER or (
            address is not None and serving[address] >= _KADEMLIA_STREAMS_PER_ADDRESS
        ):
            with contextlib.suppress(Exception):
                await stream.reset()
            return
        serving.update(sources)
        try:
            with trio.move_on_after(lifetime_s) as deadline:
                await kad.handle_stream(stream)
            if deadline.cancelled_caught:
                with contextlib.suppress(Exception):
                    await stream.reset()
        finally:
            serving.subtract(sources)
            for source in sources:
                if serving[source] <= 0:
                    del serving[source]

    host.set_stream_handler(PROTOCOL_ID, handle)


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
    async with open_host(
        identity, listen, network.announce_addrs, network.max_connections, per_address
    ) as host:
        kad = KadDHT(host, DHTMode.SERVER, enable_random_walk=False)
        _routing_only(kad)
        _bound_kademlia_streams(host, kad, config)
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
            )
            nursery.start_soon(_expire_records, dht)
            nursery.start_soon(trimmer.serve)
            nursery.start_soon(throttle.serve)
            relaying = Relaying(
                host,
                hop=relay or config.reachability.act_as_relay,
                hole_punching=config.reachability.hole_punching,
                on_direct=rpc.forget,
            )
            await nursery.start(relaying.serve)
            streams.connect_circuit = relaying.connect
            if bootstrap:
                joined = await dht.bootstrap(bootstrap)
                logger.info(
                    "joined the swarm through %d of %d bootstrap peers", joined, len(bootstrap)
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


async def _expire_records(dht: ExpertDHT) -> None:
    while True:
        await trio.sleep(_EXPIRE_EVERY_S)
        dht.expire()
