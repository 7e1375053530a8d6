"""Hole punching (DCUtR, ``/libp2p/dcutr``) with bounds on what a peer can make it dial.

py-libp2p's ``DCUtRProtocol`` upgrades a relayed connection to a direct one: the two
peers trade the addresses they are seen at (a CONNECT message each way, then SYNC) and
both dial at once. What the other peer sends is taken on trust there: every address in
its CONNECT (up to ~400 fit in 4 KiB, any multiaddr, loopback and private ones too) is
dialled in parallel, outside the swarm's dial limit, three rounds, in as many sessions
at once as the peer opens, and kept in the peerstore for ten minutes. A peer with a
relayed connection to a node (anyone: dial its circuit address through its relay, or
plant a record with a circuit address that a trainer dials) made it open thousands of
connections to a third party, or port-scan the node's own machine and LAN.

``HolePunching`` keeps py-libp2p's exchange and timing and bounds the rest:

* at most ``MAX_PUNCH_ADDRS`` (4) addresses are dialled per session, and as many in
  the plain dial that comes first (``punchable_addrs``): each a direct
  ``/ip4|ip6/<ip>/tcp/<port>`` that a record may carry (no unspecified, multicast or
  broadcast IP, no port 0, no DNS, circuit or other transport), never the relay's own;
* no address on a network narrower than the relay the connection runs through: the
  peer is reached beyond the relay, so an address on this machine (loopback) is
  dialled only when the relay is reached over loopback, and a private one (RFC 1918,
  link-local, ULA, CGNAT) only when the relay is reached at a loopback or private
  address. Tests and the demo (a relay on 127.0.0.1) and a LAN or emulated WAN (a
  relay at a private address) keep working; through a relay on the internet, only
  public addresses are dialled;
* a session a peer asks for is refused while another of its own runs, while
  ``SESSIONS_AT_ONCE`` (2) of any peers run, and for ``PEER_COOLDOWN_S`` (3 min) after
  its last one; this node starts its own sessions one at a time (py-libp2p's loop),
  at most one per peer per ``PEER_COOLDOWN_S``;
* the addresses received are not put in the peerstore by the responder, and at most
  ``MAX_OBSERVED_ADDRS`` (20) well-formed ones by the initiator (py-libp2p's choice).

A session dials its addresses in py-libp2p's three rounds (both sides run the same
schedule, so a mistimed first round is retried together), each address once a round
(the swarm's own retry of a failed dial is not used): at most 12 connection attempts
per session. A session that gains no direct connection lasts ~19 s, so the sessions
peers ask for make a node attempt at most about one connection a second in all,
whatever they send (py-libp2p: 8 CONNECTs, 10,105 connections in 27 s).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import (
    MAX_OBSERVED_ADDRS,
    DCUtRProtocol,
    _local_tcp_listen_addrs,
    read_dcutr_msg,
)
from libp2p.relay.circuit_v2.pb.dcutr_pb2 import HolePunch
from libp2p.relay.circuit_v2.utils import write_delimited_msg
from multiaddr import Multiaddr

from volunteerd.config.addrs import is_dialable_addr, tcp_endpoint
from volunteerd.net.peers import CIRCUIT_SUFFIX, short

__all__ = [
    "MAX_PUNCH_ADDRS",
    "PEER_COOLDOWN_S",
    "SESSIONS_AT_ONCE",
    "HolePunching",
    "UpgradeStats",
    "direct_ips",
    "punchable_addrs",
]

logger = logging.getLogger(__name__)

MAX_PUNCH_ADDRS = 4  # addresses dialled per session (as many as a dial-back request)
SESSIONS_AT_ONCE = 2  # sessions that peers asked for, running at once
PEER_COOLDOWN_S = 180.0  # a peer's next session (each direction) at the earliest
_ROUNDS = 3  # dial rounds per session (py-libp2p's)
_ROUND_S = 5.0  # one round: dials, then waiting for a direct connection (py-libp2p's)
_BETWEEN_ROUNDS_S = 2.0  # (py-libp2p's)
_EXCHANGE_S = 10  # reading or writing one CONNECT or SYNC (py-libp2p: 30 s)
_REMEMBERED = 4096  # peers whose last session start is kept; beyond, new ones are refused

_LOOPBACK, _PRIVATE, _PUBLIC = 0, 1, 2


def direct_ips(host: IHost, peer_id: ID) -> list[str]:
    """The remote IPs of ``host``'s direct (not relayed) connections to ``peer_id``."""
    conns = host.get_network().connections.get(peer_id) or []  # type: ignore[attr-defined]
    ips = []
    for conn in conns if isinstance(conns, list) else [conns]:
        try:
            if any(CIRCUIT_SUFFIX in str(a) for a in conn.get_transport_addresses()):
                continue
            remote = conn.muxed_conn.get_remote_address()
        except Exception:  # a closing connection: nothing observed
            continue
        if remote:
            ips.append(str(remote[0]))
    return ips


@dataclass(frozen=True, slots=True)
class UpgradeStats:
    """What DCUtR did with this node's relayed connections."""

    # Relayed connections that gained a direct one: by hole punching (both sides dial
    # at once, from their listening ports) or by a plain dial that simply worked (the
    # other side is reachable, or this one is).
    upgraded: int
    # Hole punches that ended without a direct connection (a symmetric NAT, a firewall).
    failed: int
    last_upgrade_at: float | None
    last_upgrade_peer: str | None
    # Sessions that peers asked for and were refused (one running already, too many
    # running, or too soon after their last one).
    refused: int = 0


def _scope(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> int:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return _LOOPBACK
    return _PUBLIC if ip.is_global else _PRIVATE


def _direct_tcp(addr: str) -> bool:
    return tcp_endpoint(addr) is not None and is_dialable_addr(addr)


def punchable_addrs(
    addrs: Iterable[str], relay_ips: Iterable[str], exclude: Collection[str] = ()
) -> list[str]:
    """The addresses a hole punch may dial for a peer reached through a relay at
    ``relay_ips`` (the relay's IPs as this node sees them): the first
    ``MAX_PUNCH_ADDRS`` of ``addrs`` that are direct TCP addresses a record may carry,
    on a network no narrower than the relay's (module docstring), not in ``exclude``.
    With no relay IP known, only public addresses."""
    scopes = []
    for ip in relay_ips:
        with contextlib.suppress(ValueError):  # not an IP: no network known by it
            scopes.append(_scope(ipaddress.ip_address(ip)))
    narrowest = max(scopes, default=_PUBLIC)
    kept: list[str] = []
    for addr in addrs:
        endpoint = tcp_endpoint(addr)
        if endpoint is None or not _direct_tcp(addr) or addr in exclude or addr in kept:
            continue
        if _scope(ipaddress.ip_address(endpoint[0])) < narrowest:
            continue
        kept.append(addr)
        if len(kept) == MAX_PUNCH_ADDRS:
            break
    return kept


def _transport_part(addr: object, peer_id: ID) -> str:
    """``addr`` without a ``/p2p/<peer_id>`` suffix naming ``peer_id`` itself."""
    text = str(addr)
    head, sep, tail = text.rpartition("/p2p/")
    return head if sep and tail == str(peer_id) else text


class HolePunching(DCUtRProtocol):
    """py-libp2p's DCUtR, bounded (module docstring), counting its outcomes.

    Every 2 s it looks for peers connected only through a relay and, for each, first
    dials the peer's known direct addresses, then exchanges observed addresses over
    the relayed connection and has both sides dial each other at the same moment,
    each from its listening port (SO_REUSEPORT). Both sides dial, so a node behind
    any NAT reaches a public peer directly (its NAT lets it dial out); two peers
    behind symmetric NATs (a new public port per destination) have no port to aim
    at and stay relayed (docs/protocol.md has the measured table). A relayed
    connection that gained a direct one is closed a minute later; new streams
    prefer the direct one at once.

    ``reserved_relays()`` names the relays this node holds reservations with: a
    circuit that came in arrived through one of them."""

    def __init__(self, host: IHost, reserved_relays: Callable[[], Iterable[ID]] = tuple) -> None:
        super().__init__(host, read_timeout=_EXCHANGE_S, write_timeout=_EXCHANGE_S)
        self._reserved_relays = reserved_relays
        self.upgraded = 0
        self.failed = 0
        self.refused = 0
        self.last_upgrade_at: float | None = None
        self.last_upgrade_peer: str | None = None
        self._asked: set[ID] = set()  # peers whose session with us runs now
        # (peer, asked by the peer?) -> when its last session started (trio clock),
        # oldest first.
        self._started: dict[tuple[ID, bool], float] = {}

    def statistics(self) -> UpgradeStats:
        return UpgradeStats(
            self.upgraded,
            self.failed,
            self.last_upgrade_at,
            self.last_upgrade_peer,
            self.refused,
        )

    def _count(self, peer_id: ID, upgraded: bool) -> None:
        if upgraded:
            self.upgraded += 1
            self.last_upgrade_at = time.time()
            self.last_upgrade_peer = str(peer_id)
            logger.info("connection to %s upgraded from relayed to direct", short(peer_id))
        else:
            self.failed += 1

    # -- admission --------------------------------------------------------------------

    def _admit(self, peer_id: ID, *, asked: bool) -> str | None:
        """Start a session with ``peer_id`` (``asked``: it asked for it); or the
        reason not to."""
        now = trio.current_time()
        while self._started:
            oldest = next(iter(self._started))
            if self._started[oldest] > now - PEER_COOLDOWN_S:
                break
            del self._started[oldest]
        if asked and peer_id in self._asked:
            return "a session with it is running"
        if asked and len(self._asked) >= SESSIONS_AT_ONCE:
            return f"{SESSIONS_AT_ONCE} sessions are running"
        if (peer_id, asked) in self._started:
            return f"its last session started under {PEER_COOLDOWN_S:.0f} s ago"
        if len(self._started) >= _REMEMBERED:
            return f"{_REMEMBERED} peers had a session in the last {PEER_COOLDOWN_S:.0f} s"
        self._started[(peer_id, asked)] = now
        if asked:
            self._asked.add(peer_id)
        return None

    async def _handle_dcutr_stream(self, stream: INetStream) -> None:
        """A session the peer asked for: admitted or reset (counted in ``refused``),
        then py-libp2p's exchange with the peer's addresses bounded and not stored."""
        peer_id = stream.muxed_conn.peer_id
        try:
            direct = await self._have_direct_connection(peer_id)
        except Exception:
            direct = False
        if direct:
            with contextlib.suppress(Exception):
                await stream.close()
            return
        refusal = self._admit(peer_id, asked=True)
        if refusal is not None:
            self.refused += 1
            logger.debug("hole punch asked by %s refused: %s", short(peer_id), refusal)
            with contextlib.suppress(Exception):
                await stream.reset()
            return
        self._in_progress.add(peer_id)
        try:
            await self._respond(peer_id, stream)
        except Exception as exc:  # a timeout, a reset: this session ends, nothing else
            logger.debug("hole punch asked by %s ended: %r", short(peer_id), exc)
        finally:
            self._asked.discard(peer_id)
            self._in_progress.discard(peer_id)
            with contextlib.suppress(Exception):
                await stream.close()

    async def _respond(self, peer_id: ID, stream: INetStream) -> None:
        with trio.fail_after(self.read_timeout):
            connect = await read_dcutr_msg(stream, HolePunch)
        if connect.type != HolePunch.CONNECT:
            return
        # Not stored in the peerstore: the peer's word, used for this session only.
        addrs = self._decode_observed_addrs(list(connect.ObsAddrs))
        reply = HolePunch()
        reply.type = HolePunch.CONNECT
        reply.ObsAddrs.extend(await self._get_observed_addrs())
        with trio.fail_after(self.write_timeout):
            await write_delimited_msg(stream, reply)
        with trio.fail_after(self.read_timeout):
            sync = await read_dcutr_msg(stream, HolePunch)
        if sync.type != HolePunch.SYNC:
            return
        # The peer that receives SYNC dials at once, as the client (spec).
        await self._perform_hole_punch(peer_id, addrs)

    async def _initiate_hole_punch_locked(self, peer_id: ID) -> bool:
        # py-libp2p's loop starts sessions one at a time; at most one per peer per
        # PEER_COOLDOWN_S (its own budget of three resets whenever the peer reconnects).
        if peer_id in self._in_progress or self._admit(peer_id, asked=False) is not None:
            return False
        return bool(await super()._initiate_hole_punch_locked(peer_id))

    # -- what is dialled --------------------------------------------------------------

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[Multiaddr]:
        """The well-formed direct TCP addresses of a CONNECT, at most
        ``MAX_OBSERVED_ADDRS`` (which ones are dialled: ``_targets``)."""
        decoded: list[Multiaddr] = []
        for raw in addr_bytes:
            try:
                addr = Multiaddr(raw)
            except Exception:
                continue
            if _direct_tcp(str(addr)):
                decoded.append(addr)
                if len(decoded) == MAX_OBSERVED_ADDRS:
                    break
        return decoded

    def _relays_of(self, peer_id: ID) -> set[ID]:
        """The relays this node's relayed connections to ``peer_id`` run through."""
        me = self.host.get_id()
        relays: set[ID] = set()
        for conn in self._conns(peer_id):
            try:
                addrs = [str(a) for a in conn.get_transport_addresses()]
            except Exception:  # a closing connection
                continue
            for addr in addrs:
                head, sep, _ = addr.partition(CIRCUIT_SUFFIX)
                if not sep:
                    continue
                try:
                    relay = ID.from_base58(head.rpartition("/p2p/")[2])
                except Exception:
                    continue
                if relay == me:  # it came in: through a relay this node reserved with
                    relays.update(self._reserved_relays())
                else:
                    relays.add(relay)
        return relays

    def _conns(self, peer_id: ID) -> list[INetConn]:
        conns = self.host.get_network().connections.get(peer_id) or []  # type: ignore[attr-defined]
        return conns if isinstance(conns, list) else [conns]

    def _direct_ips(self, peer_id: ID) -> list[str]:
        return direct_ips(self.host, peer_id)

    def _known_addrs(self, peer_id: ID) -> list[Multiaddr]:
        try:
            return list(self.host.get_peerstore().addrs(peer_id))
        except Exception:  # a peer the peerstore does not know
            return []

    def _targets(self, peer_id: ID, addrs: Iterable[Multiaddr]) -> list[Multiaddr]:
        """What a dial to ``peer_id`` may aim at, of ``addrs`` (``punchable_addrs``)."""
        relays = self._relays_of(peer_id)
        relay_ips = [ip for relay in relays for ip in self._direct_ips(relay)]
        relay_addrs = {_transport_part(a, r) for r in relays for a in self._known_addrs(r)}
        wanted = [_transport_part(a, peer_id) for a in addrs]
        kept = punchable_addrs(wanted, relay_ips, relay_addrs)
        if len(kept) < len(set(wanted)):
            logger.debug(
                "hole punch to %s: %d of %d addresses dialled (relay at %s)",
                short(peer_id),
                len(kept),
                len(set(wanted)),
                ", ".join(relay_ips) or "no known IP",
            )
        return [Multiaddr(a) for a in kept]

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        """A plain dial of the peer's known direct addresses (those it told identify),
        bounded like a hole punch's."""
        targets = self._targets(peer_id, self._known_addrs(peer_id))
        if not targets:
            return False
        with trio.move_on_after(self.dial_timeout):
            async with trio.open_nursery() as nursery:
                for addr in targets:
                    nursery.start_soon(self._dial_peer, peer_id, addr)
        upgraded = await self._verify_direct_connection(peer_id)
        if upgraded:
            self._count(peer_id, True)
        return upgraded

    async def _dial_peer(
        self,
        peer_id: ID,
        addr: Multiaddr,
        source: tuple[str, int] | None = None,
        as_responder: bool = False,
    ) -> None:
        """One dial of ``addr`` (py-libp2p's ``dial_addr`` retries a failed dial as the
        swarm is configured to: once more in volunteerd, so every address twice)."""
        network = self.host.get_network()
        try:
            with trio.fail_after(self.dial_timeout):
                if as_responder:
                    await network.dial_addr_as_responder(addr, peer_id, source)  # type: ignore[attr-defined]
                else:
                    await network._dial_addr_single_attempt(addr, peer_id, source)  # type: ignore[attr-defined]
        except Exception as exc:  # refused, timed out, another peer's key: no connection
            logger.debug("hole punch dial to %s at %s failed: %r", short(peer_id), addr, exc)
            return
        if await self._verify_direct_connection(peer_id):
            self._direct_connections.add(peer_id)

    async def _perform_hole_punch(
        self, peer_id: ID, addrs: list[Multiaddr], as_responder: bool = False
    ) -> bool:
        """Dial the CONNECT's addresses and the peer's known ones (at most
        ``MAX_PUNCH_ADDRS`` in all) from this node's listening port, in up to
        ``_ROUNDS`` rounds; True when a direct connection verifies."""
        targets = self._targets(peer_id, [*addrs, *self._known_addrs(peer_id)])
        upgraded = bool(targets) and await self._punch(peer_id, targets, as_responder)
        self._count(peer_id, upgraded)
        return upgraded

    async def _punch(self, peer_id: ID, targets: list[Multiaddr], as_responder: bool) -> bool:
        # From the listening port, so that the NAT's mapping matches the address the
        # peer was told (TCP simultaneous open).
        source = next(((ip, port) for _, ip, port in _local_tcp_listen_addrs(self.host)), None)
        for round_ in range(_ROUNDS):
            if round_:
                await trio.sleep(_BETWEEN_ROUNDS_S)
            async with trio.open_nursery() as nursery:
                for addr in targets:
                    nursery.start_soon(self._dial_peer, peer_id, addr, source, as_responder)
                # The swarm has no event for "a direct connection opened": poll.
                with trio.move_on_after(_ROUND_S):
                    while not await self._verify_direct_connection(peer_id):  # noqa: ASYNC110
                        await trio.sleep(0.2)
                nursery.cancel_scope.cancel()
            if await self._verify_direct_connection(peer_id):
                self._schedule_relay_close(peer_id)
                return True
        return False
