"""Reachability: can peers dial this node directly, and the circuit relay fallback.

Three parts, all built by ``open_node``:

* ``DialBackServer`` answers the ``dial-back`` verb (rules in ``net/dialback.py``).
* ``Relaying`` owns py-libp2p's circuit relay v2: the stop handler (accept circuits
  from a relay) on every node, the hop service (relay circuits for others, with
  limits) on bootstrap nodes and on ``act_as_relay`` nodes, and dialling circuit
  addresses for the RPC client. The relay's stream handlers are registered here, and
  reservations are made explicitly: py-libp2p's automatic reservation did not reserve
  (docs/decisions, notes on py-libp2p). It also runs hole punching (DCUtR), bounded in
  what a peer can make it dial (``net/holepunching.py``).
* ``Reachability`` decides the mode (``direct``, ``relayed``, ``unreachable`` or
  ``unknown``) by asking up to three connected peers to dial it back, reserves a relay
  slot when needed and keeps it refreshed, and reports the addresses to announce and
  advice for the person running the node (``report()``).

A relayed node announces ``<relay transport>/p2p/<relay id>/p2p-circuit`` addresses;
a peer dials one by appending ``/p2p/<node id>``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from volunteerd.awake import awake_time
from volunteerd.config import ReachabilityConfig, TimeoutsConfig
from volunteerd.errors import PeerError, PeerUnreachable
from volunteerd.net.dialback import (
    MAX_DIALBACK_ADDRS,
    DialBackReply,
    DialBackRequest,
    believable,
    dialable_addrs,
    tcp_endpoint,
)
from volunteerd.net.holepunching import HolePunching, UpgradeStats, direct_ips
from volunteerd.net.host import DIAL_STAGGER_S, dial_in_turn, transport_addrs
from volunteerd.net.peers import (
    CIRCUIT_SUFFIX,
    PeerAddress,
    is_circuit_addr,
    parse_circuit_addr,
    parse_peer_multiaddr,
    short,
)
from volunteerd.net.protocols import Verb
from volunteerd.net.records import MAX_ADDRS
from volunteerd.net.relay import BoundedRelay, QuietNotifee
from volunteerd.net.rpc import Handler, Reply, Request, RpcClient
from volunteerd.net.throttle import Throttle

if TYPE_CHECKING:
    from trio_typing import TaskStatus

__all__ = [
    "RELAY_LIMITS",
    "DialBackServer",
    "Reachability",
    "ReachabilityReport",
    "Relaying",
    "UpgradeStats",
]

logger = logging.getLogger(__name__)

# What a relay grants each circuit and in total. A circuit that reaches a limit is
# reset; the RPC client dials a new one on the next request.
RELAY_LIMITS = RelayLimits(
    duration=3600,  # seconds per circuit
    data=4 * 1024**3,  # bytes per circuit, both directions together
    max_circuit_conns=16,  # circuits to one reserved peer at once
    max_reservations=64,  # peers holding a slot on this relay
    reservation_ttl=3600,
)
_ASK_PEERS = 3
_DIAL_S = 5.0  # one dial-back attempt (TCP connect + Noise handshake)
_DIALBACKS_AT_ONCE = 2  # a server dials back for at most this many requests at once
# How often this computer's own addresses are compared with the last ones seen.
_WATCH_ADDRS_S = 10.0
_WATCH_RELAY_S = 10.0  # how often a relayed node checks that its relay is connected
# A node left without a relay, or holding fewer than it wants, tries the relays again
# after _WATCH_RELAY_S, doubling up to this, until it holds them.
_RETRY_RELAYS_MAX_S = 60.0
# A check no peer answered (none connected yet: a daemon started offline, or over
# connections gone dead with an old address) is made again this soon, then twice as
# late each time, up to ``check_every_s``.
_UNKNOWN_RECHECK_S = 30.0
# A circuit to a peer that failed is tried after the peer's other circuits this long.
_FAILED_VIA_S = 300.0
_MAX_FAILED_VIA = 4096
_RELAY_ADDR_TTL_S = 3600.0  # how long a relay's address that connected stays in the peer store
_RELAYS_HELD = 2  # relays a relayed node reserves on and announces, where it knows two
_RENEW_BEFORE_S = 120.0  # re-reserve when the reservation has less than this to live
# A relay's reservation says when it ends on the relay's wall clock. A lifetime read on
# this node's clock past this (or none left) means one of the clocks is wrong: the
# reservation is then renewed after _UNSURE_RESERVATION_S.
_LONGEST_RESERVATION_S = 2 * 3600.0
_UNSURE_RESERVATION_S = 600.0
# A relayed node that lost every relay keeps announcing the circuits it had, while it
# tries its relays again, for this long (on the awake clock): its own addresses are
# the ones peers just failed to dial, and trainers that tried them banned it.
_KEEP_CIRCUITS_S = 600.0

Mode = Literal["direct", "relayed", "unreachable", "unknown"]


class DialBackServer:
    """Serves ``dial-back``: a fresh TCP connection and Noise handshake to each
    admissible address of the requester, never through an existing connection."""

    def __init__(self, host: IHost) -> None:
        self._host = host
        self._limit = trio.CapacityLimiter(_DIALBACKS_AT_ONCE)

    def handlers(self) -> dict[Verb, Handler]:
        return {Verb.DIALBACK: self._on_dialback}

    async def _on_dialback(self, request: Request) -> Reply:
        body: DialBackRequest = request.header
        seen = observed_ips(self._host, request.peer_id)
        addrs = dialable_addrs(body.addrs, request.peer_id, seen)
        observed = seen[0] if seen else None
        async with self._limit:
            for addr in addrs:
                if await self._handshake(request.peer_id, addr):
                    return Reply(
                        DialBackReply(reachable=addr, dialled=len(addrs), observed=observed)
                    )
        return Reply(DialBackReply(reachable=None, dialled=len(addrs), observed=observed))

    async def _handshake(self, peer_id: str, addr: str) -> bool:
        swarm = self._host.get_network()
        maddr = multiaddr.Multiaddr(addr)
        transport = swarm.transport_manager.transport_for_dialing(maddr)  # type: ignore[attr-defined]
        if transport is None:
            return False
        raw = muxed = None
        try:
            with trio.fail_after(_DIAL_S):
                raw = await transport.dial(maddr)
                # Noise proves the listener holds the requester's key.
                expected = ID.from_base58(peer_id)
                secured = await swarm.upgrader.upgrade_security(raw, True, expected)  # type: ignore[attr-defined]
            reachable = True
        except (trio.TooSlowError, Exception) as exc:
            logger.debug("dial-back to %s at %s failed: %r", short(peer_id), addr, exc)
            reachable = False
        if reachable:
            # The verdict is in. Agreeing on a muxer as well lets the listener finish
            # the connection it accepted: a probe closed right after Noise reads to
            # py-libp2p there as a failed upgrade, logged as an ERROR on every probe.
            try:
                with trio.move_on_after(_DIAL_S):
                    muxed = await swarm.upgrader.upgrade_connection(secured, expected)  # type: ignore[attr-defined]
            except Exception as exc:
                logger.debug("dial-back to %s: no muxer agreed: %r", short(peer_id), exc)
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            try:
                if muxed is not None:
                    await muxed.close()
                elif raw is not None:
                    await raw.close()
            except Exception:
                pass
        return reachable


def observed_ips(host: IHost, peer_id: str) -> list[str]:
    """The remote IPs of our direct (not relayed) connections to ``peer_id``."""
    return direct_ips(host, ID.from_base58(peer_id))


class _DirectAfterRelayed(QuietNotifee):
    """Calls ``on_direct(peer id)`` when a direct connection opens to a peer this node
    is connected to through a relay (whoever dialled it): the RPC client then stops
    reusing its idle streams, which run over the relayed connection."""

    def __init__(self, on_direct: Callable[[str], object]) -> None:
        self._on_direct = on_direct

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        if _is_circuit(conn):
            return
        peer = conn.muxed_conn.peer_id
        others = network.connections.get(peer) or []  # type: ignore[attr-defined]
        if any(_is_circuit(c) for c in (others if isinstance(others, list) else [others])):
            self._on_direct(str(peer))


def _routable_from(addr: str, peer_ips: list[str]) -> bool:
    """Whether a peer seen at ``peer_ips`` (our direct connections to it) could have
    dialled ``addr``: a loopback address only from this machine, a private one only
    from a loopback or private address (the same LAN), a public one from anywhere. A
    peer we reach only through a relay has dialled nothing we can check: no."""
    ip_text = _ip_of(addr)
    if ip_text is None or not peer_ips:
        return False
    ip = ipaddress.ip_address(ip_text)
    seen = [ipaddress.ip_address(p) for p in peer_ips if _is_ip(p)]
    if ip.is_loopback:
        return any(p.is_loopback for p in seen)
    if ip.is_private:
        return any(p.is_loopback or p.is_private for p in seen)
    return True


def _ip_of(addr: str) -> str | None:
    endpoint = tcp_endpoint(addr)
    return None if endpoint is None else endpoint[0]


def _family(ip: str | None) -> int | None:
    """4 or 6 for an IP address; None for anything else."""
    try:
        return ipaddress.ip_address(ip or "").version
    except ValueError:
        return None


def _by_peer(relays: Sequence[PeerAddress]) -> tuple[PeerAddress, ...]:
    """``relays`` with the addresses of each peer id in one entry, in the order given:
    a relay listed once by its IPv4 and once by its IPv6 address is one relay. Listed
    apart, a node announced the circuit through the first address listed whichever the
    reservation was made over (outside probe verify40b: an IPv6-only node announced
    the relay's IPv4 circuit only)."""
    addrs: dict[str, list[str]] = {}
    for relay in relays:
        known = addrs.setdefault(relay.peer_id, [])
        known.extend(a for a in relay.addrs if a not in known)
    return tuple(PeerAddress(peer_id, tuple(a)) for peer_id, a in addrs.items())


def _is_ip(text: str | None) -> bool:
    try:
        ipaddress.ip_address(text or "")
    except ValueError:
        return False
    return True


def _is_circuit(conn: INetConn) -> bool:
    try:
        return any(CIRCUIT_SUFFIX in str(a) for a in conn.get_transport_addresses())
    except Exception:  # a closing connection: not one to judge
        return False


class Relaying:
    """Circuit relay v2 for this node, and upgrading relayed connections to direct ones
    (DCUtR): run with ``await nursery.start(relaying.serve)``.

    ``on_direct(peer id)`` is called when a peer reached through a relay gains a direct
    connection (the node's RPC client forgets its idle streams to that peer).

    Circuits are accepted only from a relay this node holds a reservation with (the
    relays it announces): py-libp2p accepts a STOP from any peer and upgrades a new
    connection over each, so one peer connected directly could open hundreds of
    "relayed" connections over its one TCP connection, each under an identity made for
    the purpose, none counted against the address's connections or limits. A relay
    this node chose caps the circuits to it (``RELAY_LIMITS.max_circuit_conns``).

    With ``hop``, the circuits relayed for others are bounded (reservations, circuits
    per peer and per address, idle ones closed after ``circuit_idle_s``) and their
    bytes pass through ``throttle``: ``net/relay.py``."""

    def __init__(
        self,
        host: IHost,
        *,
        hop: bool,
        hole_punching: bool = True,
        on_direct: Callable[[str], object] | None = None,
        throttle: Throttle | None = None,
        circuit_idle_s: float = 30.0,
        limit_loopback: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._host = host
        self.hop = hop
        self._clock = clock
        # relay -> when this node's reservation on it ends, on the awake clock (a night
        # asleep counts: the relay's hour ran on while the laptop was closed)
        self._reserved: dict[ID, float] = {}
        # relay -> the connection the reservation was made on: a relay keeps a
        # reservation only while that connection lasts
        self._reserved_on: dict[ID, object] = {}
        # The hop service's bounds, and relayed bytes through ``throttle``: net/relay.py.
        self._protocol = BoundedRelay(
            host,
            RELAY_LIMITS,
            allow_hop=hop,
            throttle=throttle,
            idle_s=circuit_idle_s,
            limit_loopback=limit_loopback,
        )
        if on_direct is not None:
            host.get_network().register_notifee(_DirectAfterRelayed(on_direct))
        # STOP only: with the CLIENT role py-libp2p reserves a slot before every dial.
        self._transport = CircuitV2Transport(
            host, self._protocol, RelayConfig(roles=RelayRole.STOP, limits=RELAY_LIMITS)
        )
        self._hole_punching = (
            HolePunching(host, lambda: tuple(self._reserved)) if hole_punching else None
        )
        self._nursery: trio.Nursery | None = None
        # STOP streams refused: from a peer this node holds no reservation with.
        self.refused_circuits = 0
        # (peer id, circuit address) -> until when circuits to the peer through it are
        # tried after its others (``connect``)
        self._failed_via: dict[tuple[str, str], float] = {}

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self._protocol), trio.open_nursery() as nursery:
            await self._protocol.event_started.wait()
            self._host.set_stream_handler(STOP_PROTOCOL_ID, self._on_stop)
            if self._hole_punching is not None:
                await nursery.start(self._serve_hole_punching)
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def _serve_hole_punching(
        self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        if self._hole_punching is None:
            raise RuntimeError("hole punching is off")
        async with background_trio_service(self._hole_punching):
            await self._hole_punching.event_started.wait()
            task_status.started()
            await trio.sleep_forever()

    async def _on_stop(self, stream: INetStream) -> None:
        relay = stream.muxed_conn.peer_id
        if not self.reserved_with(relay):
            self.refused_circuits += 1
            logger.debug("circuit from %s refused: no reservation with it", short(str(relay)))
            with contextlib.suppress(Exception):
                await stream.reset()
            return
        await self._protocol._handle_stop_stream(stream)

    def _note_failed_via(self, peer_id: str, addr: str) -> None:
        now = time.monotonic()
        if len(self._failed_via) >= _MAX_FAILED_VIA:
            self._failed_via = {k: t for k, t in self._failed_via.items() if t > now}
            while len(self._failed_via) >= _MAX_FAILED_VIA:
                del self._failed_via[next(iter(self._failed_via))]
        self._failed_via[(peer_id, addr)] = now + _FAILED_VIA_S

    def hold_while(self, held: Callable[[], str | None]) -> None:
        """Relay nothing for others while ``held()`` gives a reason (the volunteer
        paused, snoozed, or the schedule): no reservation, no circuit, and the open
        circuits end at their next bytes."""
        self._protocol.held = held

    def reserved_with(self, peer_id: ID) -> bool:
        """Whether this node holds a reservation on relay ``peer_id``."""
        return self._reserved.get(peer_id, 0.0) > awake_time()

    def holds_reservation(self, peer_id: ID) -> bool:
        """Whether this node's reservation on relay ``peer_id`` still stands: unexpired,
        and the connection it was made on still open. A new connection to the relay (a
        restarted relay the node's DHT dialled again) carries no reservation."""
        if not self.reserved_with(peer_id):
            return False
        muxed = self._reserved_on.get(peer_id)
        conns = self._host.get_network().connections.get(peer_id) or []
        return any(
            c.muxed_conn is muxed and not getattr(c, "is_closed", False)
            for c in (conns if isinstance(conns, list) else [conns])
        )

    def upgrades(self) -> UpgradeStats:
        if self._hole_punching is None:
            return UpgradeStats(0, 0, None, None)
        return self._hole_punching.statistics()

    async def reserve(self, relay: PeerAddress) -> float:
        """Reserve a slot on ``relay``; returns the seconds the reservation lasts.

        The relay says when it ends on its own wall clock. py-libp2p's reserve judged
        that on this computer's and dropped the reservation at once when this clock was
        ahead by more than its lifetime (an hour): every circuit to the node was refused
        (an outside probe, a clock 2 h ahead: 0 of 6 calls through the relay), and
        renewed it hours late when this clock was behind. Here the lifetime is read once
        on ``clock`` (the swarm's time) and kept on the awake clock, which counts a
        night asleep (the relay's hour ran on meanwhile); one that reads
        implausible (none, or over 2 h) counts as 10 min.

        Raises PeerUnreachable when the relay cannot be reached or refuses."""
        if self._nursery is None:
            raise RuntimeError("Relaying.serve has not started")
        relay_id = ID.from_base58(relay.peer_id)
        network = self._host.get_network()
        try:
            if not network.connections.get(relay_id):
                # py-libp2p refuses for 60 s to dial a peer whose addresses all failed
                # once: a relay tried while it restarted stayed undialled after it was
                # back. This node chose the relay and paces its tries itself.
                unblock = getattr(network, "unblock_peer", None)
                if unblock is not None:
                    unblock(relay_id)
                await self._dial_relay(relay_id, relay.addrs)
            stream = await self._host.new_stream(relay_id, [HOP_PROTOCOL_ID])
        except Exception as exc:
            raise PeerUnreachable(f"relay {short(relay.peer_id)}: {exc}") from None
        try:
            ok = await self._transport._make_reservation(stream, relay_id)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                try:
                    await stream.close()
                except Exception:
                    pass
        if not ok:
            raise PeerUnreachable(f"relay {short(relay.peer_id)} refused a reservation")
        lasts = self._transport._reservations.pop(relay_id, 0) - self._clock()
        if not 0 < lasts <= _LONGEST_RESERVATION_S:
            logger.info(
                "relay %s: its reservation ends %+.0f s from now by this computer's clock;"
                " renewed in %.0f s",
                short(relay.peer_id),
                lasts,
                _UNSURE_RESERVATION_S,
            )
            lasts = _UNSURE_RESERVATION_S
        now = awake_time()
        for other in [r for r, ends in self._reserved.items() if ends <= now]:
            del self._reserved[other]
            self._reserved_on.pop(other, None)
        self._reserved[relay_id] = now + lasts
        self._reserved_on[relay_id] = stream.muxed_conn
        return lasts

    async def connect(self, peer: PeerAddress) -> None:
        """Connect to ``peer`` through the first of its circuit addresses that works,
        those through relays that failed it lately last, falling back to its direct
        addresses. Raises PeerUnreachable.

        A circuit counts as failed from the moment it is dialled until the connection
        over it is secured and multiplexed: a dial or handshake cut off by the caller's
        timeout (a relay that stalls, or answers OK and then relays nothing) counts
        too, so the next call tries the peer's other relay first."""
        now = time.monotonic()
        circuits = sorted(
            (a for a in peer.addrs if is_circuit_addr(a)),
            key=lambda a: self._failed_via.get((peer.peer_id, a), 0.0) > now,
        )
        errors = []
        for addr in circuits:
            self._note_failed_via(peer.peer_id, addr)
            try:
                await self._dial_circuit(addr, ID.from_base58(peer.peer_id))
            except Exception as exc:
                errors.append(f"{addr}: {exc}")
                continue
            self._failed_via.pop((peer.peer_id, addr), None)
            return
        direct = [a for a in peer.addrs if not is_circuit_addr(a)]
        if direct:
            info = PeerInfo(ID.from_base58(peer.peer_id), [multiaddr.Multiaddr(a) for a in direct])
            await self._host.connect(info)
            return
        raise PeerUnreachable(
            f"{short(peer.peer_id)}: no relay circuit opened ({'; '.join(errors)})"
        )

    async def _dial_relay(self, relay_id: ID, addrs: Sequence[str]) -> None:
        """Connect to relay ``relay_id`` at ``addrs``, in their order, and at no other.

        ``host.connect`` adds the addresses it is given to those the peer store holds
        and py-libp2p dials only the first of them: a caller that had tried a relay's
        IPv4 address (no route from an IPv6-only network) then dialled that one again
        for the relay's IPv6 circuit, and every call failed ("unable to connect"; outside
        probe verify40b: 0 of 8 calls from a fresh IPv6-only caller, 3 of 3 through the
        IPv6 circuit alone)."""
        if not addrs:
            await self._host.connect(PeerInfo(relay_id, []))
            return
        won, failed = await dial_in_turn(self._host, relay_id, addrs, math.inf, DIAL_STAGGER_S)
        if won is None:
            raise PeerUnreachable(f"relay {short(str(relay_id))}: none of {', '.join(failed)}")
        self._host.get_peerstore().add_addrs(
            relay_id, [multiaddr.Multiaddr(won)], _RELAY_ADDR_TTL_S
        )

    def reserved_over(self, relay_id: ID) -> str | None:
        """The relay's IP the reservation on it was made over (None: not known)."""
        get_remote = getattr(self._reserved_on.get(relay_id), "get_remote_address", None)
        try:
            remote = get_remote() if get_remote is not None else None
        except Exception:  # a closing connection, or one that does not say
            return None
        return str(remote[0]) if remote else None

    async def _dial_circuit(self, addr: str, peer_id: ID) -> None:
        """Connect to ``peer_id`` through circuit address ``addr`` and no other.

        py-libp2p's ``CircuitV2Transport.dial`` tries the circuit addresses its peer
        store holds for the peer first, in stored order, and the one it is given only
        after: a caller that chose the honest relay still went through the hostile one
        stored first. A relay that answered the CONNECT with OK and then relayed nothing
        so broke every call (outside probe s4 "okdrop": 12 of 12 calls failed).

        py-libp2p refuses for 60 s to dial a peer whose addresses all failed once (any
        dial: the DHT's too): a relay that restarted stayed undialled after it was back
        and its volunteer had reserved on it again, and when the volunteer's other relay
        died calls found no way through (outside probe s6v: 10.6 s without its experts).
        The caller orders its circuits by their failures itself (``connect``)."""
        circuit = multiaddr.Multiaddr(f"{addr}/p2p/{peer_id}")
        relay_ma, _ = self._transport.parse_circuit_ma(circuit)
        relay_id = ID.from_base58(str(relay_ma.get_peer_id()))
        network = self._host.get_network()
        if not network.connections.get(relay_id):
            unblock = getattr(network, "unblock_peer", None)
            if unblock is not None:
                unblock(relay_id)
            await self._dial_relay(relay_id, [str(relay_ma).split("/p2p/")[0]])
        raw = await self._transport._dial_via_circuit_addr(circuit, PeerInfo(peer_id, [circuit]))
        try:
            await self._host.upgrade_outbound_connection(raw, peer_id)
        except BaseException:
            # py-libp2p leaves the relayed stream open when the handshake is cancelled
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(1),
                contextlib.suppress(Exception),
            ):
                await raw.close()
            raise


@dataclass(frozen=True, slots=True)
class ReachabilityReport:
    """What ``volunteerd status`` shows about reachability."""

    mode: Mode
    # Addresses peers could dial directly (empty unless direct).
    direct_addrs: tuple[str, ...]
    # Addresses announced in expert records (direct or circuit).
    announce_addrs: tuple[str, ...]
    relay: str | None
    advice: str
    checked_at: float | None
    peers_asked: int
    # The IPs peers saw this node's dial-back requests come from: behind NAT, the
    # router's public address (the one to forward a port on).
    observed_ips: tuple[str, ...]
    upgrades: UpgradeStats


class Reachability:
    """Decides and maintains how peers reach this node. ``await start()`` once (before
    announcing), then ``serve`` re-checks every ``check_every_s`` and keeps the relay
    reservation fresh."""

    def __init__(
        self,
        host: IHost,
        rpc: RpcClient,
        relaying: Relaying,
        config: ReachabilityConfig,
        timeouts: TimeoutsConfig,
        *,
        bootstrap: tuple[PeerAddress, ...] = (),
        port: int = 0,
    ) -> None:
        self._host = host
        self._rpc = rpc
        self._relaying = relaying
        self._config = config
        self._timeouts = timeouts
        self._relays = _by_peer([parse_peer_multiaddr(a) for a in config.relays] or bootstrap)
        self._port = port
        self._mode: Mode = "unknown"
        self._direct: tuple[str, ...] = ()
        self._circuit: tuple[str, ...] = ()
        # The circuits announced before the last relay was lost, and when it was lost
        # (``_KEEP_CIRCUITS_S``).
        self._lost_circuit: tuple[str, ...] = ()
        self._lost_at = -float("inf")
        # the relays holding a reservation for this node, the longest held first
        self._held: tuple[PeerAddress, ...] = ()
        self._renew_at = 0.0  # on the awake clock
        self._checked_at: float | None = None
        self._asked = 0
        self._observed: tuple[str, ...] = ()
        self._watchers: list[Callable[[list[str]], None]] = []
        # What the watchers were last told (see ``_notify_if_changed``).
        self._notified: list[str] = []
        self._mode_watchers: list[Callable[[Mode], object]] = []

    # -- state ------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def relaying(self) -> Relaying:
        return self._relaying

    @property
    def _relay(self) -> PeerAddress | None:
        return self._held[0] if self._held else None

    @property
    def announce_addrs(self) -> list[str]:
        """The addresses to put in expert records: circuit addresses when relayed;
        otherwise the addresses peers dialled back (e.g. the router's public address
        with a forwarded port) before the ones this node knows itself.

        A relayed node that lost its relays (a relay restart) and is trying them again
        announces the circuits it had for up to ``_KEEP_CIRCUITS_S``: peers found its own
        addresses undialable, and a trainer calling them banned the node as
        unreachable, growing on each restart, while a call through a circuit whose
        relay is down holds that circuit back for seconds and bans nobody (outside
        probe mini1: its 10 experts in use again 52 s after the relay was back, 113 s
        in a soak; 24 s with this). The same circuit is announced again once the relay takes the
        reservation back. A node that found no relay for that long announces its own
        addresses again, as one that never had a relay does (on a LAN, those work)."""
        if self._mode == "relayed":
            return list(self._circuit)
        if self._keeps_circuit():
            return list(self._lost_circuit)
        own = transport_addrs(self._host)
        return list(dict.fromkeys([*self._direct, *own]))[:MAX_ADDRS]

    def _keeps_circuit(self) -> bool:
        """Relayed until lately, and seeking a relay again (``announce_addrs``)."""
        return (
            bool(self._lost_circuit)
            and self._mode in ("unreachable", "unknown")
            and self._config.mode != "direct"
            and awake_time() - self._lost_at < _KEEP_CIRCUITS_S
        )

    def watch_addrs(self, callback: Callable[[list[str]], None]) -> None:
        """Call ``callback(announce_addrs)`` whenever the addresses to announce change
        (the daemon's announcer re-announces at once). The callback is taken to hold
        the current ``announce_addrs`` already (the announcer starts from them)."""
        self._notified = self.announce_addrs
        self._watchers.append(callback)

    def watch_mode(self, callback: Callable[[Mode], object]) -> None:
        """Call ``callback(mode)`` whenever the mode changes (the daemon posts an event)."""
        self._mode_watchers.append(callback)

    def report(self) -> ReachabilityReport:
        return ReachabilityReport(
            mode=self._mode,
            direct_addrs=self._direct,
            announce_addrs=tuple(self.announce_addrs),
            relay=str(self._relay) if self._relay else None,
            advice=self._advice(),
            checked_at=self._checked_at,
            peers_asked=self._asked,
            observed_ips=self._observed,
            upgrades=self._relaying.upgrades(),
        )

    def _relays_text(self) -> str:
        return " or ".join(str(r) for r in self._held)

    def _listen_port(self) -> int:
        """The port this node really listens on (not an announced one)."""
        for addr in self._host.get_transport_addrs():
            endpoint = tcp_endpoint(str(addr).split("/p2p/")[0])
            if endpoint is not None:
                return endpoint[1]
        return self._port

    def _advice(self) -> str:
        port = self._listen_port() or 38400
        seen = f" (peers see it at {', '.join(self._observed)})" if self._observed else ""
        forward = (
            f"forward TCP port {port} on your router to this machine{seen} (and allow it "
            "through the firewall), or set network.announce_addrs to the address peers "
            "can reach"
        )
        if self._mode == "direct":
            return f"peers reach this node directly at {', '.join(self._direct)}; nothing to do"
        if self._mode == "relayed":
            if not self._config.listen:
                return (
                    f"relay-only (reachability.listen = false): peers reach this node through "
                    f"relay {self._relays_text()} (a longer path than direct), or directly where "
                    "it can dial them (hole punching)"
                )
            return (
                f"peers could not dial this node, so they reach it through relay "
                f"{self._relays_text()} "
                "(a longer path than direct; hole punching makes some of those connections "
                f"direct where the NATs allow). To be reached directly by all: {forward}"
            )
        if self._mode == "unreachable":
            return (
                f"peers could not dial this node and no relay took a reservation "
                f"(relays: {', '.join(str(r) for r in self._relays) or 'none configured'}). "
                f"To be reached directly: {forward}; or set reachability.relays"
            )
        return "no peer has answered a dial-back yet; reachability is not known"

    # -- checking ---------------------------------------------------------------------

    async def check(self) -> Mode:
        """Ask up to three connected peers to dial this node back; update the mode."""
        addrs = [a for a in transport_addrs(self._host) if tcp_endpoint(a) is not None]
        peers = self._peers_to_ask()
        sent = addrs[:MAX_DIALBACK_ADDRS]
        reports: dict[str, set[str]] = {}  # address reached -> the peers that say so
        observed: list[str] = []
        answered = 0

        async def ask(peer_id: str) -> None:
            nonlocal answered
            try:
                with trio.fail_after(_DIAL_S * 2 + self._timeouts.connect_s):
                    reply, _ = await self._rpc.call(
                        PeerAddress(peer_id, ()), Verb.DIALBACK, DialBackRequest(addrs=sent)
                    )
            except (PeerError, trio.TooSlowError) as exc:
                logger.debug("dial-back by %s failed: %s", short(peer_id), exc)
                return
            if not reply.dialled:  # it saw no IP to dial (over a relay): it says nothing
                return
            answered += 1
            if _is_ip(reply.observed):
                observed.append(str(reply.observed))
            reached = believable(reply, sent)
            if reached is not None and _routable_from(reached, observed_ips(self._host, peer_id)):
                reports.setdefault(reached, set()).add(peer_id)
                return
            if reply.reachable is not None:
                logger.info(
                    "dial-back by %s: it could not have reached this node at %a; ignored",
                    short(peer_id),
                    reply.reachable[:80],
                )

        if addrs and peers:
            async with trio.open_nursery() as nursery:
                for peer_id in peers:
                    nursery.start_soon(ask, peer_id)
        self._asked = len(peers)
        self._checked_at = time.time()
        # A peer's word alone put a stranger's address first in this node's signed
        # records. So: an address at one of this node's own IPs counts on one peer's
        # word (if that peer could have reached it at all: a peer on the internet
        # cannot have reached a private address behind NAT; the node would then announce
        # it and take no relay), one at another IP (the router's, behind NAT) when two
        # of the peers that dialled agree on it (one, if only one dialled).
        own_ips = {e[0] for e in map(tcp_endpoint, sent) if e is not None}
        worked = [
            a for a, who in reports.items() if _ip_of(a) in own_ips or len(who) >= min(2, answered)
        ]
        self._direct = tuple(worked)
        self._observed = tuple(dict.fromkeys(observed))
        if worked:
            await self._set_mode("direct")
        elif answered or (not addrs and peers):
            await self._set_mode("relayed")  # falls to "unreachable" without a relay
        elif self._mode != "unknown":
            self._mode = "unknown"
            for watcher in self._mode_watchers:
                watcher(self._mode)
        self._notify_if_changed()
        return self._mode

    def _addrs_changed(self, before: set[str], now: set[str]) -> None:
        """This computer's own addresses changed (another network, a new DHCP lease):
        addresses verified at an IP it no longer has are dropped from what it announces
        at once, and the caller checks again. Before, the dead address stayed first in
        its records until the next check (``check_every_s``, 10 minutes), and trainers
        that dialled it failed and banned the node."""
        logger.info(
            "this computer's addresses changed (%s): checking reachability again",
            ", ".join(sorted(now)) or "none",
        )
        gone = {e[0] for e in map(tcp_endpoint, before - now) if e is not None}
        kept = {e[0] for e in map(tcp_endpoint, now) if e is not None}
        self._direct = tuple(a for a in self._direct if _ip_of(a) not in gone - kept)
        self._notify_if_changed()

    def _peers_to_ask(self) -> list[str]:
        """Connected peers, bootstrap peers first, at most three."""
        me = str(self._host.get_id())
        connected = [str(p) for p in self._host.get_network().connections if str(p) != me]
        known = {r.peer_id for r in self._relays}
        connected.sort(key=lambda p: p not in known)
        return connected[:_ASK_PEERS]

    async def _set_mode(self, wanted: Mode) -> None:
        previous = self._mode
        if wanted == "direct" or self._config.mode == "direct":
            self._mode = wanted if wanted == "direct" else "unreachable"
            self._lost_circuit = ()  # reached directly: no circuit to keep
        else:
            self._mode = "relayed" if await self._ensure_reservation() else "unreachable"
        if self._mode != previous:
            log = logger.warning if self._mode in ("relayed", "unreachable") else logger.info
            log("reachability: %s. %s", self._mode, self._advice())
            for watcher in self._mode_watchers:
                watcher(self._mode)
        self._notify_if_changed()

    def _notify_if_changed(self) -> None:
        """Tell the watchers ``announce_addrs`` when it differs from what they were last
        told. Compared with a snapshot taken before a change, it never did outside relayed
        mode: the list is read live from the host, whose listen addresses follow the
        machine's, so "before" already held a new address by the time it was noticed and
        the records kept the old one (127.0.0.1 after starting offline) until a restart."""
        now = self.announce_addrs
        if now != self._notified:
            self._notified = now
            for callback in self._watchers:
                callback(now)

    async def _ensure_reservation(self) -> bool:
        """Hold reservations on up to ``_RELAYS_HELD`` relays, those held before first,
        and announce a circuit through each; True when one is held. With one relay, a
        relay that went down, or one that takes reservations and then fails circuits,
        left trainers no way to the node; with two, a trainer that cannot get through one
        circuit tries the other (outside probes: a hostile relay listed first failed
        every call while the honest one beside it was never used)."""
        before = self._held
        candidates = [*before, *(r for r in self._relays if r not in before)]
        held, renew_at = await self._reserve_on(candidates, [], [])
        self._hold(held, renew_at)
        if before and held and {r.peer_id for r in held} != {r.peer_id for r in before}:
            logger.info(
                "relays: now %s (before: %s)",
                ", ".join(short(r.peer_id) for r in held),
                ", ".join(short(r.peer_id) for r in before),
            )
        return bool(self._circuit)

    async def _reserve_missing(self) -> None:
        """Reserve on relays not held, keeping the reservations held, until this node
        holds as many as it wants. After one of its two relays restarted, a node held
        the other alone until that one failed too (outside probe s6v: its experts went
        unused for 9 s when the second relay died 38 s after the first came back)."""
        before = self._held
        held, renew_at = await self._reserve_on(
            [r for r in self._relays if r not in before], list(before), [self._renew_at]
        )
        self._hold(held, renew_at)
        if len(held) > len(before):
            logger.info("relays: now %s", ", ".join(short(r.peer_id) for r in held))

    async def _reserve_on(
        self, relays: list[PeerAddress], held: list[PeerAddress], renew_at: list[float]
    ) -> tuple[list[PeerAddress], list[float]]:
        """Reserve on ``relays`` in order, after ``held``, until ``_RELAYS_HELD`` are
        held; returns the relays held and ``renew_at`` with the time each new
        reservation is to be renewed added (the soonest of them counts)."""
        me = str(self._host.get_id())
        for relay in relays:
            if len(held) >= _RELAYS_HELD:
                break
            if relay.peer_id == me or any(r.peer_id == relay.peer_id for r in held):
                continue
            try:
                with trio.fail_after(self._timeouts.connect_s * 2):
                    lasts = await self._relaying.reserve(relay)
            except (PeerUnreachable, trio.TooSlowError) as exc:
                logger.info("relay %s: %s", short(relay.peer_id), str(exc) or "timed out")
                continue
            held.append(relay)
            renew_at.append(awake_time() + lasts - _RENEW_BEFORE_S)
        return held, renew_at

    def _hold(self, held: list[PeerAddress], renew_at: list[float]) -> None:
        """Announce a circuit through each relay in ``held``; with none, keep the
        circuits announced before for a while (``announce_addrs``)."""
        if self._circuit and not held and self._mode == "relayed":
            self._lost_circuit, self._lost_at = self._circuit, awake_time()
        elif held:
            self._lost_circuit = ()
        self._held = tuple(held)
        self._renew_at = min(renew_at, default=0.0)
        self._circuit = tuple(
            circuit
            for relay in held
            for a in self._reserved_first(relay)
            if parse_circuit_addr(circuit := f"{a}/p2p/{relay.peer_id}{CIRCUIT_SUFFIX}")
        )[:MAX_ADDRS]

    def _reserved_first(self, relay: PeerAddress) -> list[str]:
        """``relay``'s addresses, those in the address family its reservation was made
        over first: that one is known to reach it. Each address is a circuit a caller of
        its family can use (the relay bridges the families), so the others stay."""
        over = self._relaying.reserved_over(ID.from_base58(relay.peer_id))
        family = _family(over)
        return sorted(
            relay.addrs, key=lambda a: family is not None and _family(_ip_of(a)) != family
        )

    def _wants_relay(self) -> bool:
        """Unreachable for want of a relay (not by ``mode = "direct"``), with relays to
        try: the serve loop tries them again between checks."""
        me = str(self._host.get_id())
        return (
            self._mode == "unreachable"
            and self._config.mode != "direct"
            and any(r.peer_id != me for r in self._relays)
        )

    def _short_of_relays(self) -> bool:
        """Relayed through fewer relays than it wants (two, where it knows two)."""
        me = str(self._host.get_id())
        known = {r.peer_id for r in self._relays if r.peer_id != me}
        return self._mode == "relayed" and len(self._held) < min(_RELAYS_HELD, len(known))

    def _relay_connected(self) -> bool:
        """Whether every relay this node announces still holds its reservation."""
        return bool(self._held) and all(
            self._relaying.holds_reservation(ID.from_base58(r.peer_id)) for r in self._held
        )

    async def start(self) -> Mode:
        """The first decision, made before this node announces anything."""
        if self._config.mode == "relay":
            await self._set_mode("relayed")
        else:
            with trio.move_on_after(_DIAL_S * 2 + self._timeouts.connect_s):
                await self.check()
        return self._mode

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Re-check every ``check_every_s`` (re-reserving the relay slot when relayed),
        sooner while no peer answered a check (``_UNKNOWN_RECHECK_S``, doubling);
        between checks, re-reserve at once when the relay connection dropped (a
        restarted relay forgot us) or the reservation is about to expire, and, while no
        relay took a reservation or fewer than it wants did, try the relays again after
        ``_WATCH_RELAY_S``, doubling up to ``_RETRY_RELAYS_MAX_S``."""
        task_status.started()
        next_check = time.monotonic() + self._config.check_every_s
        addrs = set(transport_addrs(self._host))
        retry_s = _WATCH_RELAY_S  # between tries while short of relays
        retry_at = time.monotonic() + retry_s
        unknown_s = _UNKNOWN_RECHECK_S  # until the next check while no peer answers
        if self._mode == "unknown":
            next_check = time.monotonic() + unknown_s
        while True:
            nap = min(next_check - time.monotonic(), _WATCH_ADDRS_S)
            short_before = self._wants_relay() or self._short_of_relays()
            if self._mode == "relayed":
                nap = min(nap, _WATCH_RELAY_S)
            if short_before:
                nap = min(nap, retry_at - time.monotonic())
            await trio.sleep(max(0.0, nap))
            tried = False
            try:
                now_addrs = set(transport_addrs(self._host))
                if now_addrs != addrs:
                    self._addrs_changed(addrs, now_addrs)
                    addrs = now_addrs
                    next_check = time.monotonic()  # checked again now
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + self._config.check_every_s
                    if self._config.mode == "relay":
                        await self._set_mode("relayed")
                    else:
                        await self.check()
                    if self._mode == "unknown":
                        # No peer answered: the status said "unknown" for ten minutes
                        # after a daemon started offline, or after an address change
                        # whose re-check went out over dead connections.
                        unknown_s = min(unknown_s, self._config.check_every_s)
                        next_check = time.monotonic() + unknown_s
                        unknown_s *= 2
                    else:
                        unknown_s = _UNKNOWN_RECHECK_S
                elif self._mode == "relayed" and (
                    not self._relay_connected() or awake_time() >= self._renew_at
                ):
                    await self._set_mode("relayed")
                elif self._wants_relay() and time.monotonic() >= retry_at:
                    # The relay went away (a restart): one failed try left the node
                    # unreachable, listening nowhere, until the next full check ten
                    # minutes on. Try the relays again, less often while they refuse.
                    tried = True
                    await self._set_mode("relayed")
                elif self._short_of_relays() and time.monotonic() >= retry_at:
                    # One of two relays restarted: the node held the other alone until
                    # that one failed too. Take the missing one back meanwhile.
                    tried = True
                    await self._reserve_missing()
                # The circuits kept since the relay was lost (``_KEEP_CIRCUITS_S``) run out.
                self._notify_if_changed()
            except Exception:  # a failed round must not end the node: the next one retries
                logger.exception("reachability round failed")
            if not (self._wants_relay() or self._short_of_relays()):
                retry_s = _WATCH_RELAY_S
            elif not short_before or tried:
                if tried:
                    retry_s = min(retry_s * 2, _RETRY_RELAYS_MAX_S)
                retry_at = time.monotonic() + retry_s
