"""Peer ids and addresses: libp2p's view of a node's identity.

The peer id of an Ed25519 node embeds its public key (identity multihash), so a
signature can be checked against the peer id alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import multiaddr
from libp2p.crypto.ed25519 import Ed25519PublicKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from volunteerd.config.addrs import CIRCUIT_SUFFIX, circuit_parts, peer_multiaddr_problem
from volunteerd.errors import ConfigError
from volunteerd.identity import Identity

__all__ = [
    "CIRCUIT_SUFFIX",
    "PeerAddress",
    "dialable_part",
    "is_circuit_addr",
    "key_pair_for",
    "parse_circuit_addr",
    "parse_peer_multiaddr",
    "peer_id_for",
    "public_key_of",
    "short",
]


def key_pair_for(identity: Identity) -> KeyPair:
    return create_new_key_pair(identity.seed)


def peer_id_for(identity: Identity) -> ID:
    return ID.from_pubkey(key_pair_for(identity).public_key)


def public_key_of(peer_id: str) -> bytes | None:
    """The raw Ed25519 public key embedded in a base58 peer id, or None."""
    try:
        key = ID.from_base58(peer_id).extract_public_key()
    except Exception:  # any undecodable text is simply "no key"
        return None
    if not isinstance(key, Ed25519PublicKey):
        return None
    raw: bytes = key.to_bytes()
    return raw


def short(peer_id: object) -> str:
    """A short form of a peer id for logs: the last 8 characters."""
    text = str(peer_id)
    return f"…{text[-8:]}" if len(text) > 8 else text


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """A peer id (base58) and the multiaddrs it can be dialled at (without /p2p/)."""

    peer_id: str
    addrs: tuple[str, ...]

    def peer_info(self) -> PeerInfo:
        return PeerInfo(ID.from_base58(self.peer_id), [multiaddr.Multiaddr(a) for a in self.addrs])

    def __str__(self) -> str:
        return f"{self.addrs[0] if self.addrs else ''}/p2p/{self.peer_id}"


def parse_circuit_addr(text: str) -> tuple[str, str] | None:
    """``/ip4/1.2.3.4/tcp/38400/p2p/<relay id>/p2p-circuit`` -> (relay transport address,
    relay peer id); None for anything else (a direct address, a malformed one, a relay
    chain). The destination's own ``/p2p/<id>`` is not part of an announced address."""
    parts = circuit_parts(text)
    if parts is None:
        return None
    transport, relay_id = parts
    try:
        ID.from_base58(relay_id)
        multiaddr.Multiaddr(text)
    except Exception:  # undecodable id or address: simply "not a circuit address"
        return None
    return transport, relay_id


def is_circuit_addr(text: str) -> bool:
    return text.endswith(CIRCUIT_SUFFIX)


def dialable_part(text: str) -> str:
    """A peerstore address without the peer's own ``/p2p/<id>``: the transport part of
    a direct address, or ``.../p2p/<relay>/p2p-circuit`` of a circuit address."""
    head, sep, _ = text.rpartition(CIRCUIT_SUFFIX)
    if sep:
        return head + sep
    return text.split("/p2p/")[0]


def parse_peer_multiaddr(text: str) -> PeerAddress:
    """``/ip4/1.2.3.4/tcp/38400/p2p/12D3...`` -> PeerAddress; raises ConfigError for
    anything ``config.addrs.peer_multiaddr_problem`` refuses, what multiaddr cannot
    parse, or an undecodable peer id."""
    problem = peer_multiaddr_problem(text)
    if problem is not None:
        raise ConfigError(f"not a peer's multiaddr: {text!r}: {problem}")
    try:
        multiaddr.Multiaddr(text)
        transport, _, peer_id = text.rpartition("/p2p/")
        ID.from_base58(peer_id)
    except Exception as exc:  # multiaddr and base58 raise several kinds
        raise ConfigError(f"not a peer's multiaddr: {text!r} ({exc})") from None
    return PeerAddress(peer_id=peer_id, addrs=(transport,) if transport else ())
