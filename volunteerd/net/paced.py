"""Identify and ping, answered for others at a paced rate.

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
"""

from __future__ import annotations

from collections import Counter

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import StreamHandlerFn, TProtocol
from libp2p.host.ping import ID as PING_ID
from libp2p.identity.identify.identify import ID as IDENTIFY_ID
from libp2p.identity.identify_push.identify_push import ID_PUSH as IDENTIFY_PUSH_ID

from volunteerd.config import Config
from volunteerd.net.host import remote_host
from volunteerd.net.limits import MessagePacer

__all__ = ["pace_services", "wait_turn"]

_WAITING = 4


async def wait_turn(pacer: MessagePacer, peer_id: str, ip: str | None) -> None:
    """Wait until ``pacer`` lets one message of ``peer_id`` (from ``ip``) through."""
    delay = pacer.wait_s(peer_id, ip)
    while delay > 0:  # the buckets refill with time, not on an event
        await trio.sleep(delay)
        delay = pacer.wait_s(peer_id, ip)


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
            paced = _paced(handler, pacer, waiting, each_read=protocol == PING_ID)
            host.set_stream_handler(TProtocol(protocol), paced)
    return pacer


def _paced(
    handler: StreamHandlerFn, pacer: MessagePacer, waiting: Counter[str], *, each_read: bool
) -> StreamHandlerFn:
    async def handle(stream: INetStream) -> None:
        peer_id = str(stream.muxed_conn.peer_id)
        ip = remote_host(stream)
        if waiting[peer_id] >= _WAITING:
            try:
                await stream.reset()
            except Exception:  # already gone
                pass
            return
        waiting[peer_id] += 1
        try:
            await wait_turn(pacer, peer_id, ip)
        finally:
            waiting[peer_id] -= 1
            if waiting[peer_id] <= 0:
                del waiting[peer_id]
        if each_read:
            await handler(_PacedReads(stream, pacer, peer_id, ip))  # type: ignore[arg-type]
        else:
            await handler(stream)

    return handle


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
        await wait_turn(self._pacer, self._peer_id, self._ip)
        return await self._stream.read(n)
