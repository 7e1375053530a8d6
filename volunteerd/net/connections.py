"""Inbound connection slots: released when a connection closes, and taken back from
idle connections when they run short.

py-libp2p 0.8.1 admits at most ``max_connections - min_connections`` inbound
connections at once. Two things are done here about how it counts them:

* **A slot per open connection, not per connection ever accepted.** Its
  ``Swarm._do_handle_inbound_connection`` awaits ``swarm.manager.wait_finished()`` --
  the whole swarm's end -- after the upgrade, and the caller releases the slot only
  then: every inbound connection kept its slot until the node stopped, and a node went
  deaf after 250 peers in its lifetime. :func:`install` replaces that method with one
  that holds the slot until *this* connection closes. Remove it (and the test
  ``test_connections.py`` keeps passing) once py-libp2p releases the slot on close.
* **Idle connections give their slots back under pressure.** Slots are still finite,
  and a peer holding connections it does not use (or many throw-away identities doing
  so) would keep newcomers out. :class:`IdleTrimmer` closes inbound connections that
  have had no stream for ``timeouts.connection_idle_s`` once more than half of the
  slots are taken, oldest idle first, down to half. A peer that still wants us dials
  again (its next request pays one handshake).
* **Handshakes queue.** At most 32 inbound connections are upgraded at once; a burst
  of hundreds of peers waits in the queue instead of all timing out together.
* **A silent peer does not hold a handshake slot.** Connections that never sent a byte
  held their slots for py-libp2p's 10 s upgrade timeout: one address opening 16 of
  them every 10 s kept every newcomer out (an honest peer's dial timed out after 5 s).
  A handshake now queues for a slot only once its peer's first bytes are in, in turns
  by address (:class:`HandshakeSlots`), and one that has waited ``_SLOW_PEER_S`` in
  all for its peer's bytes since gives the slot back and finishes (or times out)
  without one. While connections queue, that patience shrinks to ``_SLOW_PEER_S *
  32 / (32 + waiting)``: held by stalled peers the slots turn over faster the longer
  the queue, so however many addresses queue such connections a newcomer waits less
  than ``_SLOW_PEER_S`` for its turn.
* **Slots per address.** One IP address (an IPv6 /64; ``limits.address_key``) holds at
  most ``per_address`` inbound connections at once, however many identities it dials
  from: a further one is closed before its handshake. Loopback is exempt unless
  ``limit_loopback`` (this machine's own processes).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.io.abc import ReadWriteCloser
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.network.swarm import Swarm
from libp2p.rcmgr import Direction

from volunteerd.net.limits import address_key

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = [
    "AddressSlots",
    "ConnectionStats",
    "HandshakeSlots",
    "IdleTrimmer",
    "install",
    "slots_in_use",
]

logger = logging.getLogger(__name__)

_TRIM_EVERY_S = 5.0


# Handshakes (Noise, then Yamux) run at most this many at once. Hundreds of peers
# dialling in the same second all progressed together and slowly on the one event loop,
# past py-libp2p's 10 s upgrade timeout (52 of 300 failed); queued, each finishes fast.
# (16 while a silent connection could hold a slot for 10 s.)
_CONCURRENT_HANDSHAKES = 32
# A handshake that has waited this long in all for its peer's bytes gives its slot back
# (see _QuickHandshake), less while others queue (HandshakeSlots.allowance): on loopback
# a handshake waits ~1 ms in all, over a link with a 250 ms round trip ~1 s; a slow peer
# that loses its slot is not refused.
_SLOW_PEER_S = 1.0


class AddressSlots:
    """Inbound connections open now per address key, each at most ``per_address``."""

    def __init__(self, per_address: int, *, limit_loopback: bool = False) -> None:
        self.per_address = per_address
        self.limit_loopback = limit_loopback
        self._open: dict[str, int] = {}
        self.refused = 0

    def key(self, host: str | None) -> str | None:
        """The key a connection from ``host`` counts under; None: no cap applies."""
        return address_key(host, loopback=self.limit_loopback)

    def take(self, key: str) -> bool:
        """Count one more connection under ``key``; False (nothing counted) when it
        holds all its slots already."""
        if self._open.get(key, 0) >= self.per_address:
            self.refused += 1
            return False
        self._open[key] = self._open.get(key, 0) + 1
        return True

    def give_back(self, key: str) -> None:
        left = self._open.get(key, 0) - 1
        if left > 0:
            self._open[key] = left
        else:
            self._open.pop(key, None)

    def open(self, host: str) -> int:
        """Inbound connections counted against ``host``'s address now."""
        key = self.key(host)
        return self._open.get(key, 0) if key is not None else 0


def install(swarm: Swarm, slots: AddressSlots | None = None) -> AddressSlots:
    """Make ``swarm`` release an inbound slot when that connection closes, upgrade at
    most ``_CONCURRENT_HANDSHAKES`` inbound connections at once, and keep each address
    within ``slots`` (default: 64 each, loopback exempt). Returns ``slots``."""
    slots = slots if slots is not None else AddressSlots(64)
    swarm._do_handle_inbound_connection = functools.partial(  # type: ignore[method-assign]
        _serve_inbound_until_closed,
        swarm,
        HandshakeSlots(_CONCURRENT_HANDSHAKES),
        slots,
    )
    return slots


async def _serve_inbound_until_closed(
    swarm: Swarm,
    handshakes: HandshakeSlots,
    slots: AddressSlots,
    read_write_closer: ReadWriteCloser,
    maddr: multiaddr.Multiaddr,
    _event: Any,
) -> None:
    """Upgrade one inbound connection and hold its listener task (and so its slot, and
    its address's) until the connection closes; trio then closes the socket, already
    closed. The address's slot is checked first, from the socket's address: a
    connection refused for it costs no multiaddr (~45 µs of the ~160 µs of the node's
    CPU that such a refusal took)."""
    key = slots.key(_ip_of(read_write_closer))
    if key is not None and not slots.take(key):
        logger.debug("inbound connection refused: its address (%s) holds its slots", key)
        with contextlib.suppress(Exception):
            await read_write_closer.close()
        return
    try:
        remote = swarm._build_remote_multiaddr(read_write_closer)
        if remote is not None and not await swarm.connection_gate.is_allowed(remote):
            with contextlib.suppress(Exception):
                await read_write_closer.close()
            return
        await _upgrade_and_hold(swarm, handshakes, read_write_closer, maddr, remote, key)
    finally:
        if key is not None:
            slots.give_back(key)


def _ip_of(read_write_closer: ReadWriteCloser) -> str | None:
    """The IP address the connection comes from, as its socket says (None: unknown)."""
    with contextlib.suppress(Exception):
        address = read_write_closer.get_remote_address()
        if address is not None:
            return str(address[0])
    return None


async def _upgrade_and_hold(
    swarm: Swarm,
    handshakes: HandshakeSlots,
    read_write_closer: ReadWriteCloser,
    maddr: multiaddr.Multiaddr,
    remote: multiaddr.Multiaddr | None,
    key: str | None,
) -> None:
    """Upgrade (in ``key``'s turns for a handshake slot) and hold until closed."""
    # the queue's turns go round the addresses; an exempt connection is its own
    raw_conn = _QuickHandshake(read_write_closer, handshakes, key if key is not None else object())
    try:
        muxed = await swarm.upgrade_inbound_raw_conn(raw_conn, maddr)
    except Exception as exc:
        # A failed handshake is the peer's problem (or a port scan's), never ours.
        logger.debug("inbound connection from %s failed: %s", remote, exc)
        with contextlib.suppress(Exception):
            await raw_conn.close()
        return
    finally:
        raw_conn.done()
    closed = getattr(muxed, "event_closed", None)
    if isinstance(closed, trio.Event):
        await closed.wait()
    else:  # a muxer without the event: the library's own behaviour
        await swarm.manager.wait_finished()


class HandshakeSlots:
    """``total`` slots for handshakes, handed out in turns by address: when one frees,
    the address that waits longest since its last turn gets it (its oldest waiting
    connection), so the connections one address queues delay another's by one turn,
    not by their number.

    A holder may keep its slot while it waits for its peer's bytes ``allowance()`` in
    all: ``patience`` while nobody queues, ``patience * total / (total + waiting)``
    while connections queue (tightened for holders already waiting when more queue).
    Held by slow peers, the slots then turn over ``(total + waiting) / patience`` times a
    second, so a newcomer behind ``A`` addresses (with ``waiting >= A`` connections)
    waits about ``patience * A / (total + waiting)``: under ``patience`` however many
    addresses queue connections that send their first bytes and fall silent. A slow peer
    that runs out of it is not refused: it finishes without a slot."""

    def __init__(self, total: int, patience: float = _SLOW_PEER_S) -> None:
        self.total = total
        self.patience = patience
        self.used = 0
        self._waiting: OrderedDict[Hashable, deque[trio.Event]] = OrderedDict()
        self._count = 0
        # holders waiting for their peer's bytes: their read's scope -> when their
        # waiting began, counted in all (earlier reads' waiting included)
        self._reading: dict[trio.CancelScope, float] = {}

    def waiting(self) -> int:
        return self._count

    def allowance(self) -> float:
        """How long in all a holder may wait for its peer's bytes now."""
        return self.patience * self.total / (self.total + self._count)

    def reading(self, scope: trio.CancelScope, began: float) -> None:
        """A holder waits for its peer's bytes in ``scope`` (until ``done_reading``),
        having waited since ``began`` in all: its deadline is kept to the allowance."""
        scope.deadline = min(scope.deadline, began + self.allowance())
        self._reading[scope] = began

    def done_reading(self, scope: trio.CancelScope) -> None:
        self._reading.pop(scope, None)

    async def acquire(self, key: Hashable) -> None:
        if self.used < self.total and not self._waiting:
            self.used += 1
            return
        turn = trio.Event()
        self._waiting.setdefault(key, deque()).append(turn)
        self._count += 1
        allowance = self.allowance()
        for scope, began in self._reading.items():  # at most `total` of them
            scope.deadline = min(scope.deadline, began + allowance)
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():  # handed over, then cancelled: pass it on
                self.release()
            else:
                queue = self._waiting[key]
                queue.remove(turn)
                self._count -= 1
                if not queue:
                    del self._waiting[key]
            raise

    def release(self) -> None:
        """Give a slot back: to the next address's oldest waiter, if any waits."""
        if not self._waiting:
            self.used -= 1
            return
        key, queue = next(iter(self._waiting.items()))
        turn = queue.popleft()
        self._count -= 1
        if queue:
            self._waiting.move_to_end(key)
        else:
            del self._waiting[key]
        turn.set()  # the slot passes over, still counted


class _QuickHandshake(RawConnection):
    """An inbound connection whose handshake holds one of the ``handshakes`` slots
    only while its peer keeps up. It asks for the slot (in ``key``'s turn) once the
    peer's first bytes are in, so a connection that sends nothing never queues for
    one; and gives it back once it has waited for the peer's bytes longer in all than
    the slots' allowance (``_SLOW_PEER_S`` while nobody queues, less while many do),
    then finishes (or times out) without one. Reads of other tasks (the muxer's, after
    the handshake) go straight through."""

    def __init__(self, stream: ReadWriteCloser, handshakes: HandshakeSlots, key: Hashable) -> None:
        super().__init__(stream, False)
        self._handshakes = handshakes
        self._key = key
        self._task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
        self._holding = False
        self._slow = False
        self._waited = 0.0  # waiting for the peer's bytes while holding a slot, in all

    def done(self) -> None:
        """The handshake is over (or failed): give the slot back, read straight on."""
        if self._holding:
            self._handshakes.release()
        self._holding = False
        self._task = None

    async def read(self, n: int | None = None) -> bytes:
        if self._task is None or self._task is not trio.lowlevel.current_task():
            return await super().read(n)
        if not self._holding:
            if self._slow:  # goes on without a slot
                return await super().read(n)
            data = await super().read(n)  # the first bytes, then the queue
            await self._handshakes.acquire(self._key)
            self._holding = True
            return data
        started = trio.current_time()
        data_or_none: bytes | None = None
        with trio.CancelScope() as scope:  # a read cancelled early loses nothing
            self._handshakes.reading(scope, started - self._waited)
            try:
                data_or_none = await super().read(n)
            finally:
                self._handshakes.done_reading(scope)
        self._waited += trio.current_time() - started
        if data_or_none is not None:
            return data_or_none
        self._handshakes.release()
        self._holding = False
        self._slow = True  # for good: it does not queue again
        logger.debug("a handshake's peer is slow: it goes on without a slot")
        return await super().read(n)


def slots_in_use(swarm: Swarm) -> tuple[int, int]:
    """(inbound slots taken, inbound slots in all)."""
    limiter = swarm._inbound_limiter
    return int(limiter.borrowed_tokens), int(limiter.total_tokens)


@dataclass(frozen=True, slots=True)
class ConnectionStats:
    connections: int
    inbound_slots_used: int
    inbound_slots: int
    trimmed: int


class IdleTrimmer:
    """Closes idle inbound connections while more than half of the slots are taken."""

    def __init__(self, host: IHost, idle_s: float) -> None:
        self._swarm = host.get_network()
        self._idle_s = idle_s
        self._idle_since: dict[int, float] = {}
        self.trimmed = 0
        # Told (closed, slots used, slots in all) after a round closed connections.
        self.on_trimmed: Callable[[int, int, int], object] | None = None

    def crowded(self) -> bool:
        """Whether more than half of the inbound slots are taken (trimming's threshold)."""
        used, total = slots_in_use(self._swarm)  # type: ignore[arg-type]
        return used > total // 2

    def statistics(self) -> ConnectionStats:
        used, total = slots_in_use(self._swarm)  # type: ignore[arg-type]
        return ConnectionStats(len(self._swarm.get_connections()), used, total, self.trimmed)

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(_TRIM_EVERY_S)
            await self.trim_once(time.monotonic())

    async def trim_once(self, now: float) -> int:
        """Note which inbound connections are idle; close the longest idle ones while
        over half of the slots are taken. Returns how many were closed."""
        inbound = [
            c
            for c in self._swarm.get_connections()
            if getattr(c, "direction", None) == Direction.INBOUND
        ]
        idle: list[tuple[float, Any]] = []
        seen: dict[int, float] = {}
        for conn in inbound:
            if conn.get_streams():
                continue
            since = self._idle_since.get(id(conn), now)
            seen[id(conn)] = since
            if now - since >= self._idle_s:
                idle.append((since, conn))
        self._idle_since = seen
        used, total = slots_in_use(self._swarm)  # type: ignore[arg-type]
        excess = used - total // 2
        chosen = [conn for _, conn in sorted(idle, key=lambda item: item[0])[: max(0, excess)]]

        async def close(conn: Any) -> None:
            with contextlib.suppress(Exception):
                await conn.close()

        # All at once: py-libp2p pauses 0.1 s in each close, so hundreds of idle
        # strangers closed in turn would keep newcomers waiting for a slot for minutes.
        async with trio.open_nursery() as nursery:
            for conn in chosen:
                nursery.start_soon(close, conn)
        closed = len(chosen)
        if closed:
            self.trimmed += closed
            logger.info(
                "closed %d idle inbound connections (%d of %d slots taken)", closed, used, total
            )
            if self.on_trimmed is not None:
                self.on_trimmed(closed, used, total)
        return closed
