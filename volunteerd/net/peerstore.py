"""The node's peer store: py-libp2p's, keeping a few usable addresses per peer.

py-libp2p stores whatever a peer claims for itself, in identify (and identify-push) or
in a signed peer record: up to 1,000 addresses per peer, of any protocol and any size,
for two hours. Its Kademlia copies every one of them into every FIND_NODE answer that
names the peer. One stranger claiming 100 addresses of ~1 KB (``/dns4/<243-char
name>/tcp/N``) made a bootstrap node's answers 103 KB, past what readers take (64 KiB):
newcomers joining through it learnt no one else, for as long as the addresses lived;
20 identities with 1,000 such addresses each turned a 37-byte FIND_NODE into a 7.9 MB
answer. So here:

* **What a peer says** (``add_addrs``, which ``add_addr`` and ``consume_peer_record``
  call) is kept only where volunteerd can dial it: ``/ip4|ip6/<ip>/tcp/<port>`` or a
  circuit address through a relay at one (``usable_addr``, the rule of records'
  addresses; loopback, private and circuit addresses included: tests, LANs and relays
  use them), optionally followed by the peer's own ``/p2p/<id>``, and at most
  ``MAX_ADDRS_PER_PEER`` (8) of them per peer, the first that came; the rest are dropped.
* **A signed peer record** over ``MAX_RECORD_BYTES`` (2 KiB, room for ~100 addresses)
  is refused, as one with a wrong signer is: it would be handed on whole.
* **What this node chose to dial** (``add_own_addrs``: the addresses given to
  ``host.connect``, from the configuration, records or lookups) may also be a DNS name
  (a bootstrap peer's ``/dns4/...``), still at most ``MAX_ADDRS_PER_PEER``: a name a
  stranger claims is never resolved.
* **Entries** are at most ``max_peers`` (1,000), however they came. py-libp2p checks
  its bound only when an address is stored, and an identify (or identify-push) from a
  peer that names no usable address stores its key and protocols without one: every
  stranger that pushed an identify from a host listening nowhere left an entry for good
  (200 of them, 201 entries past a bound of 50). Here any new entry checks the bound
  (``_Entries``); past it, entries go down to nine tenths of it: expired ones first,
  then those without addresses, then the oldest; never this node's own (its key pair:
  without it identify fails and stops the node) nor a connected peer's (``connected``,
  which the host sets; connections are bounded on their own).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

from libp2p.peer.envelope import Envelope
from libp2p.peer.id import ID
from libp2p.peer.peerdata import PeerData
from libp2p.peer.peerstore import PeerStore
from multiaddr import Multiaddr

from volunteerd.config.addrs import is_dialable_addr
from volunteerd.net.peers import dialable_part, parse_circuit_addr

__all__ = ["MAX_ADDRS_PER_PEER", "MAX_RECORD_BYTES", "NodePeerStore", "usable_addr"]

MAX_ADDRS_PER_PEER = 8
"""Addresses kept per peer: what a lookup takes of a referral (``net/lookup.py``)."""
MAX_RECORD_BYTES = 2048
"""The largest signed peer record kept (marshalled)."""
# An address's text at most: a usable transport part (200 characters at most, as a
# record's) and the peer's own /p2p/<id>.
_MAX_ADDR_CHARS = 300
_OWN_ID_SUFFIX = re.compile(r"(/p2p/[1-9A-HJ-NP-Za-km-z]{1,64})?")


def usable_addr(addr: Multiaddr | str) -> bool:
    """Whether volunteerd can dial ``addr``: a direct ``/ip4|ip6/<ip>/tcp/<port>`` or a
    circuit address through a relay at one, as records carry them
    (``records.is_record_addr``), followed by nothing or the peer's ``/p2p/<id>``."""
    try:
        text = str(addr)
    except Exception:  # a multiaddr that cannot be written: not one to dial
        return False
    if len(text) > _MAX_ADDR_CHARS:
        return False
    transport = dialable_part(text)
    return bool(
        _OWN_ID_SUFFIX.fullmatch(text[len(transport) :])
        and is_dialable_addr(transport, parse_circuit_addr)
    )


class _Entries(dict[ID, PeerData]):
    """The store's ``peer_data_map``: every py-libp2p method that makes an entry does it
    with ``setdefault``, which here calls ``made`` once the new entry is in."""

    def __init__(self, made: Callable[[ID], None]) -> None:
        super().__init__()
        self._made = made

    def setdefault(self, key: ID, default: PeerData | None = None) -> PeerData:
        if key in self:
            return self[key]
        entry = PeerData() if default is None else default
        self[key] = entry
        self._made(key)
        return entry


class NodePeerStore(PeerStore):
    """py-libp2p's ``PeerStore`` with the bounds of this module; ``own`` is this node's
    peer id; ``max_peers`` (py-libp2p's attribute) is the most entries kept."""

    def __init__(self, own: ID) -> None:
        super().__init__()
        self._own = own
        self.peer_data_map = _Entries(self._made)
        self.connected: Callable[[ID], bool] = lambda peer_id: False
        """Whether the node holds a connection to the peer: its entry is kept."""

    def add_addrs(self, peer_id: ID, addrs: Sequence[Multiaddr], ttl: int = 0) -> None:
        """py-libp2p's ``add_addrs`` of those of ``addrs`` that are usable and fit in
        the peer's ``MAX_ADDRS_PER_PEER`` (addresses already known refresh their TTL);
        nothing at all when none is left."""
        self._add_within_bound(peer_id, (a for a in addrs if usable_addr(a)), ttl)

    def add_own_addrs(self, peer_id: ID, addrs: Sequence[Multiaddr], ttl: int) -> None:
        """Addresses this node itself chose to dial ``peer_id`` at: a DNS name too, but
        still no more than ``MAX_ADDRS_PER_PEER``."""
        self._add_within_bound(peer_id, (a for a in addrs if len(str(a)) <= _MAX_ADDR_CHARS), ttl)

    def consume_peer_record(self, envelope: Envelope, ttl: int) -> bool:
        """py-libp2p's, refusing a record over ``MAX_RECORD_BYTES`` (False, as for a
        record with a wrong signer); its addresses go through ``add_addrs``."""
        try:
            size = len(envelope.marshal_envelope())
        except Exception:  # one that cannot be written cannot be handed on either
            return False
        if size > MAX_RECORD_BYTES:
            return False
        return super().consume_peer_record(envelope, ttl)

    def _add_within_bound(self, peer_id: ID, addrs: Iterable[Multiaddr], ttl: int) -> None:
        data = self.peer_data_map.get(peer_id)
        if data is not None and data.is_expired():
            data.clear_addrs()  # py-libp2p would bring expired addresses back to life
        known = list(data.get_addrs()) if data is not None else []
        kept: list[Multiaddr] = []
        room = MAX_ADDRS_PER_PEER - len(known)
        for addr in addrs:
            if addr in kept:
                continue
            if addr in known:  # no room taken: its TTL is refreshed
                kept.append(addr)
            elif room > 0:
                kept.append(addr)
                room -= 1
        if kept:
            super().add_addrs(peer_id, kept, ttl)

    def _made(self, peer_id: ID) -> None:
        if len(self.peer_data_map) > self.max_peers:
            self._enforce_peer_limit()

    def _enforce_peer_limit(self) -> None:
        """Down to nine tenths of ``max_peers`` entries (one pass serves the next tenth
        of new ones): expired entries first, then those without addresses, then the
        oldest; never this node's own nor a connected peer's.

        py-libp2p's own eviction took entries without addresses first, and this node's
        own entry (its key pair) has none: once a node had learnt of 1,000 peers,
        identify could no longer read its own public key, and the exception of the next
        peer's identify stream stopped the whole node."""
        if len(self.peer_data_map) <= self.max_peers:
            return
        keep = self.max_peers - self.max_peers // 10
        # dicts keep insertion order and sorted() is stable: the oldest first in each kind
        candidates = sorted(
            (
                (peer_id, data)
                for peer_id, data in self.peer_data_map.items()
                if peer_id != self._own and not self.connected(peer_id)
            ),
            key=lambda item: (not item[1].is_expired(), bool(item[1].get_addrs())),
        )
        for peer_id, _ in candidates[: len(self.peer_data_map) - keep]:
            self.peer_record_map.pop(peer_id, None)
            del self.peer_data_map[peer_id]
