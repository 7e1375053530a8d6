"""Invitations: everything a volunteer needs to join an experiment, in one string.

``volunteerd publish`` prints one; ``volunteerd join`` (and the dashboard's "Join a
project") reads it::

    volunteerd://join/<name>?owner=<peer id>&peer=<multiaddr>&peer=<multiaddr>

* ``name``: the experiment's name (the manifest's, ``records.NAME_PATTERN``);
* ``owner``: the peer id of the key that signs its manifest: the one owner to trust.
  Manifests are signed with Ed25519 keys embedded in the peer id, so any other kind of
  peer id could never sign one and is refused here already;
* ``peer`` (1 to 8, in the order to try): peers to join the swarm through, each a
  direct multiaddr ending in ``/p2p/<peer id>`` (of an Ed25519 key, as every
  volunteerd node's), percent-encoded.

An invitation is pasted from chats, mails and web pages, so parsing is strict: the
text must be exactly one invitation (surrounding whitespace aside), and anything
unknown, repeated, oversized or undecodable is refused with a ConfigError that says
what is wrong, quoting at most a short piece of the input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote

from volunteerd.errors import ConfigError
from volunteerd.net.peers import parse_peer_multiaddr, public_key_of
from volunteerd.net.records import NAME_PATTERN

__all__ = [
    "MAX_INVITATION_LENGTH",
    "MAX_PEERS",
    "PREFIX",
    "Invitation",
    "check_peer",
    "parse_invitation",
]

PREFIX = "volunteerd://join/"
MAX_INVITATION_LENGTH = 4096
MAX_PEERS = 8
_MAX_ADDR_LENGTH = 200  # as an announced address (net.records)
_MAX_PEER_ID_LENGTH = 128
# Printable ASCII without space: what a URL is made of. Anything else (newlines that
# could forge a second line in a log or terminal, unicode look-alikes) is refused.
_URL_CHARS = re.compile(r"[!-~]*")
_NAME = re.compile(NAME_PATTERN)
_QUOTE_LIMIT = 48


def _quoted(text: str) -> str:
    """A piece of hostile input safe to put in a message: short and escaped."""
    if len(text) > _QUOTE_LIMIT:
        # Both ends: a multiaddr's peer id is at its end.
        text = f"{text[: _QUOTE_LIMIT - 16]}...{text[-13:]}"
    return ascii(text)


@dataclass(frozen=True)
class Invitation:
    """A checked invitation: constructing one with a bad field raises ConfigError, so
    every Invitation's ``url()`` parses back to an equal Invitation."""

    name: str
    owner: str
    peers: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(
                f"not a valid invitation: the experiment name {_quoted(str(self.name))} "
                "is not a name (lower-case letters, digits, '_', '.', '-'; at most 64)"
            )
        _check_owner(self.owner)
        if not isinstance(self.peers, tuple):
            raise ConfigError("not a valid invitation: peers must be a tuple of multiaddrs")
        if not self.peers:
            raise ConfigError(
                "not a valid invitation: it names no peer to join through (peer=<multiaddr>)"
            )
        if len(self.peers) > MAX_PEERS:
            raise ConfigError(
                f"not a valid invitation: {len(self.peers)} peers; at most {MAX_PEERS}"
            )
        for peer in self.peers:
            check_peer(peer)
        if len(set(self.peers)) != len(self.peers):
            raise ConfigError("not a valid invitation: a peer is listed twice")
        if len(self.url()) > MAX_INVITATION_LENGTH:
            raise ConfigError(
                f"not a valid invitation: longer than {MAX_INVITATION_LENGTH} characters"
            )

    def url(self) -> str:
        """``volunteerd://join/<name>?owner=<peer id>&peer=<multiaddr>...``"""
        query = [f"owner={self.owner}"] + [f"peer={quote(p, safe='')}" for p in self.peers]
        return f"{PREFIX}{self.name}?{'&'.join(query)}"

    def __str__(self) -> str:
        return self.url()


def _check_owner(owner: object) -> None:
    if not isinstance(owner, str) or not owner:
        raise ConfigError("not a valid invitation: it names no owner (owner=<peer id>)")
    if len(owner) > _MAX_PEER_ID_LENGTH or public_key_of(owner) is None:
        raise ConfigError(
            f"not a valid invitation: the owner {_quoted(owner)} is not the peer id of an "
            "Ed25519 key (like 12D3KooW...), the only kind that signs manifests"
        )


def check_peer(peer: object) -> None:
    """Raises ConfigError unless ``peer`` is a direct multiaddr whose last part, and only
    /p2p/ part, is the peer's id: the shape ``network.bootstrap_peers`` dials. Also for
    a peer recorded in ``projects.toml`` (``swarm.projects``), which sets aside one
    refused."""
    if not isinstance(peer, str):
        raise ConfigError("not a valid invitation: a peer is not a multiaddr")
    if len(peer) > _MAX_ADDR_LENGTH:
        raise ConfigError(
            f"not a valid invitation: the peer {_quoted(peer)} is longer than "
            f"{_MAX_ADDR_LENGTH} characters"
        )
    if not _URL_CHARS.fullmatch(peer) or not peer.startswith("/"):
        raise ConfigError(
            f"not a valid invitation: the peer {_quoted(peer)} is not a multiaddr "
            "(like /ip4/203.0.113.7/tcp/38400/p2p/12D3KooW...)"
        )
    if peer.count("/p2p/") != 1 or "p2p-circuit" in peer:
        raise ConfigError(
            f"not a valid invitation: the peer {_quoted(peer)} must be a direct address "
            "ending in /p2p/<peer id>"
        )
    try:
        address = parse_peer_multiaddr(peer)
    except ConfigError:
        raise ConfigError(
            f"not a valid invitation: the peer {_quoted(peer)} is not a valid multiaddr "
            "ending in /p2p/<peer id>"
        ) from None
    if not address.addrs or not peer.endswith(f"/p2p/{address.peer_id}"):
        raise ConfigError(
            f"not a valid invitation: the peer {_quoted(peer)} must be a transport "
            "address (/ip4/.../tcp/...) ending in /p2p/<peer id>"
        )
    # multiaddr accepts the first characters of a peer id as a (shorter) peer id: a
    # truncated paste. Every volunteerd node's id embeds its whole Ed25519 key.
    if public_key_of(address.peer_id) is None:
        raise ConfigError(
            f"not a valid invitation: the peer {_quoted(peer)} does not end in a "
            "volunteerd node's peer id (12D3KooW... of an Ed25519 key); was it cut short?"
        )


def parse_invitation(text: str) -> Invitation:
    """The invitation in ``text`` (whitespace around it is ignored).

    Raises ConfigError, saying what is wrong, for anything but exactly one invitation:
    another scheme or verb, a bad name, no owner or a repeated one, an owner that is
    not an Ed25519 peer id, no peer or more than 8, a peer that is not a multiaddr
    ending in /p2p/<peer id>, an unknown query key, a fragment, characters outside
    printable ASCII (after percent-decoding too), or more than 4096 characters."""
    if not isinstance(text, str):
        raise ConfigError("not a valid invitation: expected text")
    text = text.strip()
    if len(text) > MAX_INVITATION_LENGTH:
        raise ConfigError(f"not a valid invitation: longer than {MAX_INVITATION_LENGTH} characters")
    if not text:
        raise ConfigError(f"not a valid invitation: empty (expected {PREFIX}<name>?owner=...)")
    if not _URL_CHARS.fullmatch(text):
        raise ConfigError(
            "not a valid invitation: it contains spaces, line breaks or characters "
            "outside printable ASCII (was it wrapped or retyped? copy it again whole)"
        )
    if not text.startswith(PREFIX):
        raise ConfigError(f"not a valid invitation: {_quoted(text)} does not start with {PREFIX!r}")
    rest = text.removeprefix(PREFIX)
    if "#" in rest:
        raise ConfigError("not a valid invitation: it has a '#' fragment")
    name, sep, query = rest.partition("?")
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"not a valid invitation: the experiment name {_quoted(name)} is not a name "
            "(lower-case letters, digits, '_', '.', '-'; at most 64)"
        )
    if not sep or not query:
        raise ConfigError(
            "not a valid invitation: it names no owner and no peer (owner=...&peer=...)"
        )
    try:
        fields = parse_qsl(
            query,
            keep_blank_values=True,
            strict_parsing=True,
            errors="strict",
            max_num_fields=1 + MAX_PEERS + 1,
        )
    except (ValueError, UnicodeDecodeError):
        # Too many fields, a field without '=', or percent-escapes that are not UTF-8.
        raise ConfigError(
            f"not a valid invitation: its query is malformed or has more than {MAX_PEERS} peers"
        ) from None
    owners: list[str] = []
    peers: list[str] = []
    for key, value in fields:
        if key == "owner":
            owners.append(value)
        elif key == "peer":
            peers.append(value)
        else:
            raise ConfigError(
                f"not a valid invitation: unknown key {_quoted(key)} (only owner and peer)"
            )
    if len(owners) > 1:
        raise ConfigError("not a valid invitation: owner is given more than once")
    return Invitation(name=name, owner=owners[0] if owners else "", peers=tuple(peers))
