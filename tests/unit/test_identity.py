"""Identity: one Ed25519 key, stored 0600, reused, and the peer id derives from it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import nacl.signing
import pytest
from libp2p.peer.id import ID

from volunteerd.errors import IdentityError
from volunteerd.identity import load_or_create_identity
from volunteerd.net.peers import peer_id_for, public_key_of


def test_key_is_created_0600_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "identity.key"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_identity(path)
    assert again.seed == first.seed
    assert peer_id_for(again) == peer_id_for(first)
    assert "seed" not in repr(first) or first.seed.hex() not in repr(first)


def test_loose_permissions_are_tightened(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    load_or_create_identity(path)
    path.chmod(0o644)
    load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_pynacl_signature_verifies_against_the_peer_id_alone(tmp_path: Path) -> None:
    identity = load_or_create_identity(tmp_path / "identity.key")
    message = b"announce ffn.3.17"
    signature = identity.sign(message)
    peer_id = str(peer_id_for(identity))
    # Only the peer id travels: its embedded key must verify the PyNaCl signature.
    key = ID.from_base58(peer_id).extract_public_key()
    assert key is not None
    assert key.verify(message, signature)
    raw = public_key_of(peer_id)
    assert raw is not None
    nacl.signing.VerifyKey(raw).verify(message, signature)
    assert raw == bytes(nacl.signing.SigningKey(identity.seed).verify_key)


def test_go_style_64_byte_key_file_is_accepted(tmp_path: Path) -> None:
    seed = os.urandom(32)
    path = tmp_path / "identity.key"
    path.write_bytes(seed + bytes(nacl.signing.SigningKey(seed).verify_key))
    path.chmod(0o600)
    assert load_or_create_identity(path).seed == seed


def test_garbage_key_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(b"not a key")
    with pytest.raises(IdentityError, match="not a volunteerd key file"):
        load_or_create_identity(path)


def test_a_key_file_that_links_to_nothing_is_a_clear_error(tmp_path: Path) -> None:
    """Reading it says "no such file", creating one says "exists": that loop ran until
    Python's recursion limit, making a new key each time. No identity is made behind a
    link (the key may be on a drive not mounted yet)."""
    path = tmp_path / "identity.key"
    path.symlink_to(tmp_path / "usb" / "identity.key")
    with pytest.raises(IdentityError, match=r"links to .*usb/identity\.key, which does not exist"):
        load_or_create_identity(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identity.key"]  # no stray files
    assert path.is_symlink()
