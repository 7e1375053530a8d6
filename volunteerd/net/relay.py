"""The circuit relay's hop service (``/libp2p/circuit/relay/0.2.0/hop``), bounded.

Bootstrap nodes and ``act_as_relay`` volunteers relay circuits for peers that cannot be
dialled. py-libp2p's ``CircuitV2Protocol`` took three things on trust, each measured
against a relay with ``upload_mbit = 1``:

* whom a reservation is for: the RESERVE message's ``peer`` field, not the peer that
  sent it, and slots of peers gone stayed taken until they expired (an hour). One
  stranger, one connection, 70 RESERVEs naming made-up peers: all 64 slots taken in
  0.4 s, and no NATed volunteer got one for the next hour;
* how many circuits run to one reserved peer: the cap (16) was checked before the
  STOP handshake and counted after it, so circuits opened at once all passed: 200 of
  200 from one stranger over one TCP connection, and an honest peer was then refused;
* what relaying costs the volunteer: its copies of the bytes went around the node's
  throttle, ~250-417 Mbit/s against ``upload_mbit = 1``, none of it counted against the
  quotas.

``BoundedRelay`` keeps py-libp2p's messages and its limits per circuit (``RELAY_LIMITS``:
duration and bytes) and bounds the rest:

* a reservation is always for the peer whose connection asks (a RESERVE naming another
  peer is refused), valid while that peer is connected to the relay (spec), and at most
  ``RESERVATIONS_PER_ADDRESS`` (4) are held by the peers at one IP address (an IPv6
  /64; loopback exempt unless ``peer_limits.limit_loopback``, as for every
  per-address limit: ``net/limits.address_key``);
* the circuits to one reserved peer are counted when admitted, before the STOP
  handshake, and given back when they end: at most ``max_circuit_conns`` (16) in all,
  of which at most ``CIRCUITS_PER_SOURCE`` (4) from one peer and as many from the
  peers at one address;
* a circuit that carried nothing but keep-alives (reads of at most ``PING_BYTES``: the
  endpoints' Yamux pings and window updates) for ``idle_s`` is closed; the node makes
  that at least ``timeouts.request_s`` and a half, so a call waiting for a slow answer
  is never cut (fixed windows of 30 s cut answers slower than 30 s);
* every relayed byte passes through the node's ``Throttle``: received counts against
  the download limit and sent against the upload limit, both against the quotas; while
  a quota is used up, reservations and circuits are refused and the open circuits end.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, Limit, StopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID, CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from volunteerd.net.limits import address_key
from volunteerd.net.peers import short
from volunteerd.net.throttle import Throttle

if TYPE_CHECKING:
    from trio_typing import TaskStatus

__all__ = [
    "CIRCUITS_PER_SOURCE",
    "PING_BYTES",
    "RESERVATIONS_PER_ADDRESS",
    "BoundedRelay",
    "QuietNotifee",
]

logger = logging.getLogger(__name__)

RESERVATIONS_PER_ADDRESS = 4  # reservations held by the peers at one IP address
CIRCUITS_PER_SOURCE = 4  # circuits to one reserved peer from one peer, or one address
# A read no larger is a keep-alive (a Yamux ping or window update in its Noise frame,
# ~30 bytes), not activity; any request or answer is larger.
PING_BYTES = 64
_PIECE = 64 * 1024  # the most read (and so written, and throttled) at once
_STOP_S = 15.0  # the STOP handshake with the reserved peer (py-libp2p's)
_CLOSE_S = 2.0  # closing a circuit's two streams


@dataclass(slots=True)
class _Circuit:
    moved: int = 0  # bytes, both directions together
    active_at: float = 0.0  # trio time of the last read larger than PING_BYTES


class BoundedRelay(CircuitV2Protocol):
    """py-libp2p's circuit relay v2, bounded (module docstring).

    ``throttle``: the node's; None relays unthrottled and uncounted. ``idle_s``: a
    circuit carrying only keep-alives that long is closed. ``limit_loopback``: peers
    on loopback share per-address bounds too (``peer_limits.limit_loopback``)."""

    def __init__(
        self,
        host: IHost,
        limits: RelayLimits,
        *,
        allow_hop: bool,
        throttle: Throttle | None = None,
        idle_s: float = 30.0,
        limit_loopback: bool = False,
    ) -> None:
        super().__init__(host, limits=limits, allow_hop=allow_hop)
        self._throttle = throttle
        self._idle_s = idle_s
        self._limit_loopback = limit_loopback
        self._address_of: dict[ID, str | None] = {}  # reserved peer -> its address key
        self._taken: dict[tuple[str, ...], int] = {}  # circuit slots taken, by key
        self._open: set[trio.CancelScope] = set()  # one per circuit relayed now
        # RESERVEs and CONNECTs refused by the bounds above (py-libp2p's own refusals,
        # a full relay or a peer without a reservation, are not counted).
        self.refused_reservations = 0
        self.refused_circuits = 0
        # Why the volunteer holds this node back now (paused, snoozed, the schedule), or
        # None: set by the daemon. Relaying is the volunteer's bandwidth too.
        self.held: Callable[[], str | None] = lambda: None

    @property
    def circuits(self) -> int:
        """Circuits relayed now."""
        return len(self._open)

    @property
    def reservations(self) -> int:
        """Reservations held now (by connected peers)."""
        self._drop_stale()
        return len(self.resource_manager._reservations)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        network = self.host.get_network()
        notifee = _OnDisconnect(self._drop_if_gone)
        network.register_notifee(notifee)
        try:
            await super().run(task_status=task_status)
        finally:
            network.remove_notifee(notifee)
            for scope in list(self._open):
                scope.cancel()

    # -- reservations -----------------------------------------------------------------

    def _drop_if_gone(self, peer_id: ID) -> None:
        """Forget ``peer_id``'s reservation when it has no connection to this relay."""
        if not self.host.get_network().connections.get(peer_id):  # type: ignore[attr-defined]
            self.resource_manager._reservations.pop(peer_id, None)
            self._address_of.pop(peer_id, None)

    def _drop_stale(self) -> None:
        """Forget expired reservations and those of peers no longer connected."""
        reservations = self.resource_manager._reservations
        for peer_id, reservation in list(reservations.items()):
            if reservation.is_expired() or not self.resource_manager._is_peer_connected(peer_id):
                del reservations[peer_id]
        for peer_id in [p for p in self._address_of if p not in reservations]:
            del self._address_of[peer_id]

    def _held_back(self) -> str | None:
        """Why no reservation, circuit or relayed byte is taken now, or None."""
        if self._throttle is not None and self._throttle.quota_exhausted:
            return "the transfer quota is used up"
        return self.held()

    def _reservation_refusal(self, stream: INetStream, msg: HopMessage) -> str | None:
        """Why the RESERVE ``msg`` on ``stream`` is refused (by these bounds), or None."""
        peer_id = stream.muxed_conn.peer_id
        if msg.HasField("peer") and msg.peer.id and msg.peer.id != peer_id.to_bytes():
            return "it names another peer"
        reason = self._held_back()
        if reason is not None:
            return reason
        self._drop_stale()
        if peer_id in self.resource_manager._reservations:
            return None  # a refresh
        key = self._address_key(stream)
        if key is not None:
            held = sum(1 for k in self._address_of.values() if k == key)
            if held >= RESERVATIONS_PER_ADDRESS:
                return f"{held} reservations are held from its address"
        self._address_of[peer_id] = key  # kept only if py-libp2p grants it (_drop_stale)
        return None

    async def _handle_reserve(self, stream: INetStream, msg: HopMessage) -> None:
        refusal = self._reservation_refusal(stream, msg)
        if refusal is None:
            # Whom for: the connection's peer (msg.peer names it or nothing).
            await super()._handle_reserve(stream, msg)
            return
        self.refused_reservations += 1
        logger.debug(
            "reservation by %s refused: %s", short(str(stream.muxed_conn.peer_id)), refusal
        )
        code = (
            StatusCode.PERMISSION_DENIED
            if refusal == "it names another peer"
            else StatusCode.RESERVATION_REFUSED
        )
        await self._send_status(stream, code, refusal)

    # -- circuits ---------------------------------------------------------------------

    def _address_key(self, stream: INetStream) -> str | None:
        try:
            remote = stream.muxed_conn.get_remote_address()
        except Exception:  # a closing connection
            remote = None
        return address_key(remote[0] if remote else None, loopback=self._limit_loopback)

    def _take(self, caps: Iterable[tuple[tuple[str, ...], int]]) -> bool:
        """Count one circuit under each key, unless one of them is at its cap."""
        caps = list(caps)
        if any(self._taken.get(key, 0) >= cap for key, cap in caps):
            return False
        for key, _ in caps:
            self._taken[key] = self._taken.get(key, 0) + 1
        return True

    def _give_back(self, keys: Iterable[tuple[str, ...]]) -> None:
        for key in keys:
            left = self._taken.get(key, 0) - 1
            if left > 0:
                self._taken[key] = left
            else:
                self._taken.pop(key, None)

    async def _refuse(self, stream: INetStream, code: StatusCode, why: str) -> None:
        await self._send_status(stream, code, why)
        await self._close_stream(stream)

    async def _handle_connect(self, stream: INetStream, msg: HopMessage) -> None:
        """Admit a circuit (its slots counted now, before any await), then hand the
        source a stream to the reserved peer and relay between them until either side
        ends, a limit is reached, or it is idle."""
        source = stream.muxed_conn.peer_id
        try:
            target = ID(msg.peer.id)
            target.to_base58()
        except Exception:
            await self._refuse(stream, StatusCode.MALFORMED_MESSAGE, "no destination peer")
            return
        if msg.HasField("reservation") and not self.resource_manager.verify_reservation(
            source, msg.reservation
        ):
            await self._refuse(stream, StatusCode.PERMISSION_DENIED, "invalid reservation")
            return
        reservation = self.resource_manager.get_reservation(target)
        if reservation is None:
            await self._refuse(stream, StatusCode.NO_RESERVATION, "no reservation")
            return
        held = self._held_back()
        if held is not None:
            self.refused_circuits += 1
            await self._refuse(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, held)
            return
        to = str(target)
        caps = [
            (("to", to), self.limits.max_circuit_conns),
            (("peer", str(source), to), CIRCUITS_PER_SOURCE),
        ]
        key = self._address_key(stream)
        if key is not None:
            caps.append((("address", key, to), CIRCUITS_PER_SOURCE))
        if not self._take(caps):
            self.refused_circuits += 1
            logger.debug("circuit from %s to %s refused: at a cap", short(str(source)), short(to))
            await self._refuse(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, "too many circuits")
            return
        reservation.active_connections += 1
        try:
            await self._open_circuit(stream, source, target)
        finally:
            self._give_back(k for k, _ in caps)
            reservation.active_connections = max(0, reservation.active_connections - 1)

    async def _open_circuit(self, stream: INetStream, source: ID, target: ID) -> None:
        limit = Limit(duration=self.limits.duration, data=self.limits.data)
        dst: INetStream | None = None
        try:
            with trio.fail_after(_STOP_S):
                dst = await self.host.new_stream(target, [STOP_PROTOCOL_ID])
                connect = StopMessage(
                    type=StopMessage.CONNECT,
                    peer=CircuitPeerId(id=source.to_bytes()),
                    limit=limit,
                )
                await write_delimited_msg(dst, connect)
                reply = await read_delimited_msg(dst, StopMessage)
            if reply.HasField("status") and reply.status != StatusCode.OK:
                raise ConnectionError(f"the peer answered {reply.status}")
        except Exception as exc:  # unreachable, refused, too slow
            logger.debug(
                "circuit from %s to %s failed: %r", short(str(source)), short(str(target)), exc
            )
            await self._send_status(stream, StatusCode.CONNECTION_FAILED, "connection failed")
            for s in (stream, dst):
                if s is not None:
                    with contextlib.suppress(Exception):
                        await s.reset()
            return
        await self._send_status(stream, StatusCode.OK, "Connection established", limit=limit)
        await self._relay(stream, dst)

    async def _relay(self, src: INetStream, dst: INetStream) -> None:
        circuit = _Circuit()
        scope = trio.CancelScope()
        if self.limits.duration > 0:
            scope.deadline = trio.current_time() + self.limits.duration
        self._open.add(scope)
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._copy, src, dst, circuit, scope)
                    nursery.start_soon(self._copy, dst, src, circuit, scope)
                    nursery.start_soon(self._end_when_idle, circuit, scope)
        finally:
            self._open.discard(scope)
            with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_S):
                await self._close_stream(src)
                await self._close_stream(dst)

    async def _copy(
        self, src: INetStream, dst: INetStream, circuit: _Circuit, scope: trio.CancelScope
    ) -> None:
        """Copy ``src`` to ``dst`` through the throttle; end the circuit when ``src``
        ends, a write fails, the circuit's byte limit is reached or a quota used up."""
        throttle = self._throttle
        try:
            while True:
                data = await src.read(_PIECE)
                if not data:
                    return
                circuit.moved += len(data)
                if len(data) > PING_BYTES:
                    circuit.active_at = trio.current_time()
                if 0 < self.limits.data < circuit.moved:
                    logger.debug("circuit ended: %d bytes relayed", circuit.moved)
                    return
                held = self._held_back()
                if held is not None:
                    logger.debug("circuit ended: %s", held)
                    return
                if throttle is not None:
                    await throttle.received(len(data))
                    await throttle.sent(len(data))
                with trio.fail_after(self.write_timeout):
                    await dst.write(data)
        except Exception as exc:  # EOF, a reset, a stalled reader
            logger.debug("circuit ended: %r", exc)
        finally:
            scope.cancel()

    async def _end_when_idle(self, circuit: _Circuit, scope: trio.CancelScope) -> None:
        circuit.active_at = trio.current_time()
        while True:
            await trio.sleep_until(circuit.active_at + self._idle_s)
            if trio.current_time() - circuit.active_at >= self._idle_s:
                logger.debug("circuit ended: idle for %.0f s", self._idle_s)
                scope.cancel()
                return


class QuietNotifee(INotifee):
    """A py-libp2p network notifee that does nothing; subclasses override what they
    watch."""

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass


class _OnDisconnect(QuietNotifee):
    """Calls ``closed(peer id)`` when a connection to that peer closes."""

    def __init__(self, closed: Callable[[ID], None]) -> None:
        self._closed = closed

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        with contextlib.suppress(Exception):  # a connection that never finished
            self._closed(conn.muxed_conn.peer_id)
