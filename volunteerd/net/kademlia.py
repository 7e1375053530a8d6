"""How a node serves Kademlia to others: routing only, a bounded number of streams,
messages paced per peer and per address.

volunteerd uses py-libp2p's ``KadDHT`` for routing alone (FIND_NODE, PING); records go
through ``ExpertDHT``'s own verbs, under the RPC server's limits. What py-libp2p's
handler does for any peer that opens a stream had to be bounded here:

* **Nothing kept for others** (``_routing_only``). py-libp2p serves ADD_PROVIDER and
  PUT_VALUE in server mode whatever the caller uses, and keeps what they carry for
  48 h and 24 h: provider entries with no cap on keys or addresses (about 37 MiB held
  per 4 MiB message, from identities that cost nothing), values up to 50,000 entries.
* **Streams** (``_KADEMLIA_STREAMS``...). py-libp2p serves at most 12 inbound streams
  at once, resets the rest and waits on each for its next message with no deadline:
  one peer holding 12 streams open without a word made a node answer no FIND_NODE to
  anyone.
* **Messages.** On a stream it was given, a peer could ask as fast as the node could
  answer: one peer pipelining FIND_NODE requests on four streams took as much of the
  node's CPU as it liked (each answer costs a few hundred microseconds: a routing
  table search, a signed record checked if the request carries one, a protobuf
  encoded). Each message now waits for a token of its peer
  (``peer_limits.dht_messages_per_s``, burst ``dht_message_burst``) and of its address
  (``per_address`` times as many), so a flood is answered at that rate and no faster.
  Messages are delayed, never refused: an honest node's burst of lookups (a daemon
  publishing its experts at start) must not lose its answers.
* **Answers** (``_bounded_answers``). py-libp2p lists every peerstore address and the
  signed record of each peer it names: one stranger that claimed 100 addresses of ~1 KB
  made a bootstrap node's FIND_NODE answers 103 KB, which readers drop whole (64 KiB at
  most, ``net/lookup.py``), so newcomers joining through it learnt no one else; 20
  such identities with 1,000 addresses each made a 37-byte request a 7.9 MB answer.
  A named peer now carries at most ``MAX_ADDRS_PER_PEER`` usable addresses
  (``net/peerstore.py``, which also bounds what is stored) and its signed record only
  if at most ``MAX_RECORD_BYTES``, and the peers named stay within
  ``_ANSWER_PEERS_BYTES``, the farthest left out first.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence

import trio
from libp2p.abc import IHost, INetStream
from libp2p.io.exceptions import IncompleteReadError
from libp2p.kad_dht.common import MAX_DHT_MESSAGE_SIZE, PROTOCOL_ID
from libp2p.kad_dht.kad_dht import KadDHT, get_connection_type
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

from volunteerd.config import Config
from volunteerd.net.host import remote_host
from volunteerd.net.limits import MessagePacer, address_key
from volunteerd.net.peerstore import MAX_ADDRS_PER_PEER, MAX_RECORD_BYTES, usable_addr

__all__ = ["serve_kademlia"]

# Inbound Kademlia streams served at once: in all (py-libp2p's 12, raised: a handler
# waiting on a peer costs nothing), from one peer (a node runs at most 4 lookups at once,
# each asking a peer one FIND_NODE per stream: ``ExpertDHT._lookups``), and from one
# address's peers together.
_KADEMLIA_STREAMS = 32
_KADEMLIA_STREAMS_PER_PEER = 4
_KADEMLIA_STREAMS_PER_ADDRESS = 8
# What the peers an answer names may take of it: readers take answers of 64 KiB at most
# (``net/lookup.py``); the rest is for the key and this node's own signed record. An
# honest answer, 20 peers with a few addresses and records each, is ~5.5 KB.
_ANSWER_PEERS_BYTES = 60 * 1024
# A named peer's field tag and length prefix, at most (an entry under 2 MiB).
_FIELD_OVERHEAD = 4


def serve_kademlia(host: IHost, kad: KadDHT, config: Config) -> MessagePacer:
    """Serve ``kad`` to other peers under this module's bounds (installs the stream
    handler); returns the pacer, whose counts say how many messages were answered and
    how often one had to wait."""
    _routing_only(kad)
    _bounded_answers(kad)
    limits = config.peer_limits
    pacer = MessagePacer.for_peers(limits.dht_messages_per_s, limits.dht_message_burst, limits)
    _bound_kademlia_streams(host, kad, config, pacer)
    return pacer


def _routing_only(kad: KadDHT) -> None:
    """Make ``kad`` keep nothing for others. An ADD_PROVIDER is refused like one over
    py-libp2p's rate limit (the stream is reset, before its providers are read), and
    neither store takes an entry from any other path."""

    def refuse_providers(peer_id: object) -> bool:
        return False

    def keep_no_provider(key: bytes, provider: object) -> None:
        return None

    def keep_no_value(key: bytes, record: object) -> None:
        return None

    kad._check_provider_rate_limit = refuse_providers  # type: ignore[method-assign,assignment]
    kad.provider_store.add_provider = keep_no_provider  # type: ignore[method-assign,assignment]
    kad.value_store.put_record = keep_no_value  # type: ignore[method-assign,assignment]


def _bounded_answers(kad: KadDHT) -> None:
    """Make ``kad`` name peers in its answers (FIND_NODE, and the closer peers of
    GET_VALUE and GET_PROVIDERS) with at most ``MAX_ADDRS_PER_PEER`` usable addresses
    each, a signed record only of at most ``MAX_RECORD_BYTES``, and no more peers than
    fit in ``_ANSWER_PEERS_BYTES`` (py-libp2p gives them closest first: the farthest
    are left out)."""
    host = kad.host

    def add_closer_peers(
        response: Message, closest_peers: Sequence[ID], exclude_peer_id: ID | None = None
    ) -> None:
        peerstore = host.get_peerstore()
        room = _ANSWER_PEERS_BYTES - response.ByteSize()
        for peer_id in closest_peers:
            if peer_id == exclude_peer_id:
                continue
            named = Message.Peer(id=peer_id.to_bytes())
            named.connection = get_connection_type(host, peer_id)
            envelope = peerstore.get_peer_record(peer_id)
            if envelope is not None:
                signed = envelope.marshal_envelope()
                if len(signed) <= MAX_RECORD_BYTES:
                    named.signedRecord = signed
            try:
                addrs = peerstore.addrs(peer_id)
            except Exception:  # a peer the peerstore forgot, or whose addresses expired
                addrs = []
            named.addrs.extend([a.to_bytes() for a in addrs if usable_addr(a)][:MAX_ADDRS_PER_PEER])
            size = named.ByteSize() + _FIELD_OVERHEAD
            if size > room:
                break
            room -= size
            response.closerPeers.append(named)

    kad._add_closer_peers_to_response = add_closer_peers  # type: ignore[method-assign]


def _bound_kademlia_streams(host: IHost, kad: KadDHT, config: Config, pacer: MessagePacer) -> None:
    """``_KADEMLIA_STREAMS`` are served in all, a peer has at most
    ``_KADEMLIA_STREAMS_PER_PEER`` of them and the peers of one address
    (``limits.address_key``; none for loopback and relayed peers) at most
    ``_KADEMLIA_STREAMS_PER_ADDRESS``, the rest reset before they reach py-libp2p's
    handler; a stream is served for at most twice ``timeouts.dht_rpc_s``, then reset;
    and each message on it waits for ``pacer``."""
    limits = config.peer_limits
    lifetime_s = 2 * config.timeouts.dht_rpc_s
    kad._inbound_limiter = trio.CapacityLimiter(_KADEMLIA_STREAMS)
    serving: Counter[str] = Counter()

    async def handle(stream: INetStream) -> None:
        peer_id = str(stream.muxed_conn.peer_id)
        ip = remote_host(stream)
        peer = f"peer:{peer_id}"
        address = address_key(ip, loopback=limits.limit_loopback)
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
                paced = _PacedStream(stream, pacer, peer_id, ip)
                await kad.handle_stream(paced)  # type: ignore[arg-type]
            if deadline.cancelled_caught:
                with contextlib.suppress(Exception):
                    await stream.reset()
        finally:
            serving.subtract(sources)
            for source in sources:
                if serving[source] <= 0:
                    del serving[source]

    host.set_stream_handler(PROTOCOL_ID, handle)


class _PacedStream:
    """``stream`` as py-libp2p's Kademlia handler reads it, one whole message at a time,
    each message read only once the pacer lets it through. Everything else (writes,
    reset, the connection) is the stream's own."""

    def __init__(self, stream: INetStream, pacer: MessagePacer, peer_id: str, ip: str | None):
        self._stream = stream
        self._pacer = pacer
        self._peer_id = peer_id
        self._ip = ip
        self._pending = memoryview(b"")

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)

    async def read(self, n: int | None = None) -> bytes:
        if not self._pending:
            try:
                message = await read_varint_prefixed_bytes_limited(
                    self._stream, MAX_DHT_MESSAGE_SIZE
                )
            except IncompleteReadError as exc:
                if exc.received_bytes == 0:
                    return b""  # the peer is done: the handler sees a clean end
                raise
            await self._pacer.wait(self._peer_id, self._ip)
            self._pending = memoryview(encode_varint_prefixed(message))
        size = len(self._pending) if n is None else min(n, len(self._pending))
        chunk, self._pending = self._pending[:size], self._pending[size:]
        return bytes(chunk)
