"""Inbound streams, identify and ping, answered for others at a paced rate.

py-libp2p answers identify (a stream per request: the node's addresses, protocols and
signed record, encoded for each) and ping (an echo per 32 bytes read, as fast as they
come on one stream) as often as any peer asks. One peer looping either took a daemon's
whole core: 925 identify streams a second, or 10,141 pings echoed a second on two
streams (``benchmarks/flood.py``). An honest peer identifies once per connection,
pushes an identify when its addresses change and pings rarely, if ever (volunteerd
itself does not).

``pace_services`` wraps the three handlers: every identify, identify-push and ping
stream takes a token of its peer (``peer_limits.identify_ping_per_s``, 2 a second,
``identify_ping_burst``, 20, at once) and of its address (``peer_limits.per_address``
times both; loopback and relayed peers by peer only, as everywhere), and so does every
ping on a ping stream; at most ``_WAITING`` streams of one peer wait for a token at a
time, more are reset at once.

``pace_streams`` does the same one layer down, for every inbound stream whatever its
protocol: before py-libp2p negotiates the stream's protocol (multistream-select, a few
messages each way in Python) it takes a token of its peer (``peer_limits.streams_per_s``,
50 a second, ``stream_burst``, 250, at once) and of its address; at most
``_WAITING_STREAMS`` of a peer's streams wait. One peer opening streams for a protocol
nobody serves had a daemon negotiate 1,452 a second with its whole core
(``benchmarks/flood.py --flood unknown``). A stream beyond those waiting is reset and
its connection closed: yamux's and trio's work per stream is paid whether or not the
stream is negotiated, and one peer opening and resetting streams took a daemon's core
(~9,000 a second) with every one of them refused. The peer may dial again (its
buckets keep their state: its next streams wait again). Honest peers reuse their RPC
streams (``net/rpc.py`` pools them); a Kademlia query opens one, and a daemon's start-up
publishing sends each peer a burst of them, which the burst covers. And a negotiation
reads at most ``_MOST_PROPOSALS`` protocol proposals (py-libp2p answers "na" to as many
as a peer sends on one stream, and the whole protocol list to each "ls").
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from libp2p.abc import IHost, IMultiselectCommunicator, INetStream
from libp2p.custom_types import StreamHandlerFn, TProtocol
from libp2p.host.ping import ID as PING_ID
from libp2p.identity.identify.identify import ID as IDENTIFY_ID
from libp2p.identity.identify_push.identify_push import ID_PUSH as IDENTIFY_PUSH_ID
from libp2p.peer.id import ID
from libp2p.protocol_muxer.exceptions import MultiselectCommunicatorError

from volunteerd.config import Config
from volunteerd.net.host import remote_host
from volunteerd.net.limits import MessagePacer
from volunteerd.net.peers import short

__all__ = ["pace_services", "pace_streams"]

logger = logging.getLogger(__name__)

_WAITING = 4
_WAITING_STREAMS = 8
# The multistream header, then protocols proposed (an honest peer proposes one; a
# py-libp2p peer tries each of the protocols it was given in turn).
_MOST_PROPOSALS = 8


def pace_services(host: IHost, config: Config) -> MessagePacer:
    """Replace ``host``'s identify, identify-push and ping handlers with paced ones;
    returns their pacer (its counts: streams and pings let through, waits)."""
    limits = config.peer_limits
    pacer = MessagePacer.for_peers(limits.identify_ping_per_s, limits.identify_ping_burst, limits)
    waiting: Counter[str] = Counter()
    handlers = host.get_mux().handlers
    for protocol in (IDENTIFY_ID, IDENTIFY_PUSH_ID, PING_ID):
        handler = handlers.get(TProtocol(protocol))
        if handler is not None:
            paced = _paced(handler, pacer, waiting, _WAITING, each_read=protocol == PING_ID)
            host.set_stream_handler(TProtocol(protocol), paced)
    return pacer


def pace_streams(
    host: IHost, config: Config, keep_connection: Callable[[ID], bool] = lambda peer: False
) -> MessagePacer:
    """Make every inbound stream of ``host`` wait for its peer's and address's turn
    before its protocol is negotiated, and bound the proposals a negotiation reads;
    returns the pacer (its counts: streams let through, waits, refused).

    A peer for which ``keep_connection`` says so (a relay this node holds a reservation
    with: closing that connection would cut every circuit to the node) only has its
    excess streams reset."""
    limits = config.peer_limits
    pacer = MessagePacer.for_peers(limits.streams_per_s, limits.stream_burst, limits)
    swarm = host.get_network()
    negotiate_and_serve = swarm.common_stream_handler  # type: ignore[attr-defined]
    paced = _paced(
        negotiate_and_serve,
        pacer,
        Counter(),
        _WAITING_STREAMS,
        each_read=False,
        on_overflow=functools.partial(_close_connection, keep_connection),
    )
    swarm.set_stream_handler(paced)
    mux = host.get_mux()
    negotiate = mux.negotiate

    async def bounded(communicator: IMultiselectCommunicator, *args: object) -> object:
        return await negotiate(_Proposals(communicator, 1 + _MOST_PROPOSALS), *args)  # type: ignore[arg-type]

    mux.negotiate = bounded  # type: ignore[method-assign,assignment]
    return pacer


class _Proposals:
    """A multistream communicator that reads at most ``most`` messages."""

    def __init__(self, communicator: IMultiselectCommunicator, most: int) -> None:
        self._communicator = communicator
        self._left = most

    async def write(self, msg_str: str) -> None:
        await self._communicator.write(msg_str)

    async def read(self) -> str:
        if self._left <= 0:
            raise MultiselectCommunicatorError("too many protocols proposed on one stream")
        self._left -= 1
        return await self._communicator.read()


async def _close_connection(keep_connection: Callable[[ID], bool], stream: INetStream) -> None:
    """Close the connection ``stream`` came on (its peer opens streams faster than it
    is served, far beyond any honest burst: what it costs is yamux's and trio's work
    per stream, paced or not)."""
    connection = getattr(stream, "swarm_conn", None)
    if connection is None or keep_connection(stream.muxed_conn.peer_id):
        return
    logger.debug(
        "closing the connection of %s: it opens streams faster than they are served",
        short(str(stream.muxed_conn.peer_id)),
    )
    with contextlib.suppress(Exception):  # already closing
        await connection.close()


def _paced(
    handler: StreamHandlerFn,
    pacer: MessagePacer,
    waiting: Counter[str],
    most_waiting: int,
    *,
    each_read: bool,
    on_overflow: Callable[[INetStream], Awaitable[None]] | None = None,
) -> StreamHandlerFn:
    async def handle(stream: INetStream) -> None:
        peer_id = str(stream.muxed_conn.peer_id)
        ip = remote_host(stream)
        if waiting[peer_id] >= most_waiting:
            pacer.refused += 1
            with contextlib.suppress(Exception):  # already gone
                await stream.reset()
            if on_overflow is not None:
                await on_overflow(stream)
            return
        waiting[peer_id] += 1
        try:
            await pacer.wait(peer_id, ip)
        finally:
            waiting[peer_id] -= 1
            if waiting[peer_id] <= 0:
                del waiting[peer_id]
        try:
            if each_read:
                await handler(_PacedReads(stream, pacer, peer_id, ip))  # type: ignore[arg-type]
            else:
                await handler(stream)
        except Exception as exc:
            # Raised out of here, a handler's exception (py-libp2p's identify, say)
            # stopped the swarm and with it the node: it costs the stream only.
            _handler_failed(exc)
            with contextlib.suppress(Exception):
                await stream.reset()

    return handle


_FAILURES_SEEN: set[str] = set()


def _handler_failed(exc: Exception) -> None:
    """Log a stream handler's failure: a kind's first at WARNING (a bug to report),
    the rest at DEBUG (a peer could repeat one at will)."""
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    first = kind not in _FAILURES_SEEN and len(_FAILURES_SEEN) < 100
    if first:
        _FAILURES_SEEN.add(kind)
    logger.log(
        logging.WARNING if first else logging.DEBUG,
        "a stream handler failed (%s: %s); its stream is reset, the node goes on",
        kind,
        exc,
        exc_info=first,
    )


class _PacedReads:
    """``stream`` whose every read first waits for a token (a ping is one read)."""

    def __init__(self, stream: INetStream, pacer: MessagePacer, peer_id: str, ip: str | None):
        self._stream = stream
        self._pacer = pacer
        self._peer_id = peer_id
        self._ip = ip

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)

    async def read(self, n: int | None = None) -> bytes:
        await self._pacer.wait(self._peer_id, self._ip)
        return await self._stream.read(n)
