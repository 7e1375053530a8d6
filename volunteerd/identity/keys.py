"""The node's Ed25519 key: made with PyNaCl, stored 0600, reused across restarts.

The key file holds the 32-byte seed and nothing else. Go-style 64-byte files
(seed followed by public key) are accepted. The libp2p peer id is derived from the
same key in ``volunteerd.net.peers``, so anything signed here verifies against the
peer id alone.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import nacl.exceptions
import nacl.signing
from nacl.bindings import crypto_core_ed25519_is_valid_point

from volunteerd.atomic import DanglingLink, fsync_dir, make_private_dirs, read_small
from volunteerd.errors import IdentityError

__all__ = ["SEED_BYTES", "Identity", "load_or_create_identity", "verify_signature"]

logger = logging.getLogger(__name__)

SEED_BYTES = 32


@dataclass(frozen=True, slots=True)
class Identity:
    """An Ed25519 signing identity. ``repr`` never shows the seed."""

    seed: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.seed) != SEED_BYTES:
            raise IdentityError(f"an Ed25519 seed has {SEED_BYTES} bytes, not {len(self.seed)}")

    @classmethod
    def generate(cls) -> Identity:
        # libp2p refuses the (astronomically rare) keys whose public point fails
        # the curve check, so never create one.
        while True:
            key = nacl.signing.SigningKey.generate()
            if crypto_core_ed25519_is_valid_point(bytes(key.verify_key)):
                return cls(bytes(key))

    @property
    def public_key(self) -> bytes:
        return bytes(nacl.signing.SigningKey(self.seed).verify_key)

    def sign(self, message: bytes) -> bytes:
        """A detached 64-byte Ed25519 signature of ``message``."""
        return nacl.signing.SigningKey(self.seed).sign(message).signature


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True if ``signature`` is a valid Ed25519 signature of ``message`` by ``public_key``."""
    try:
        nacl.signing.VerifyKey(public_key).verify(message, signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, ValueError, TypeError):
        return False
    return True


def load_or_create_identity(path: Path) -> Identity:
    """Read the key at ``path``, or create one (mode 0600) if there is none.

    Creation is atomic: a crash leaves either no file or a complete one. A file that
    others can read is tightened to 0600 with a warning. Raises IdentityError for a
    file that is not a key.
    """
    try:
        raw = read_small(path, _MAX_KEY_FILE)
    except FileNotFoundError:
        return _create(path)
    except DanglingLink:
        raise _dangling(path) from None
    except OSError as exc:  # a folder, a FIFO, a device, a huge file, no permission
        raise IdentityError(f"cannot read key file {path}: {exc.strerror}{_WHAT_TO_DO}") from None
    if len(raw) not in (SEED_BYTES, 2 * SEED_BYTES):
        raise IdentityError(
            f"{path} is not a volunteerd key file ({len(raw)} bytes; expected "
            f"{SEED_BYTES}){_WHAT_TO_DO}"
        )
    # The 64-byte form is the seed and its public key: one whose second half is not
    # (64 random bytes) started silently as another peer.
    if len(raw) == 2 * SEED_BYTES and Identity(raw[:SEED_BYTES]).public_key != raw[SEED_BYTES:]:
        raise IdentityError(
            f"{path} is not a volunteerd key file (its public key does not match its "
            f"seed){_WHAT_TO_DO}"
        )
    if os.name == "posix":
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            logger.warning("key file %s had mode %o; setting it to 600", path, mode)
            path.chmod(0o600)
    return Identity(raw[:SEED_BYTES])


_MAX_KEY_FILE = 4096  # a key file holds 32 or 64 bytes
_WHAT_TO_DO = (
    ": restore it from a copy, or move it away to start as a new peer (a new identity, "
    "unknown to the swarm)"
)


def _dangling(path: Path) -> IdentityError:
    return IdentityError(
        f"key file {path} links to {os.readlink(path)}, which does not exist: "
        "restore it, or remove the link to start a new identity"
    )


def _create(path: Path) -> Identity:
    identity = Identity.generate()
    make_private_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, identity.seed)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        # link() fails if another process created the key meanwhile: theirs wins.
        os.link(tmp, path)
    except FileExistsError:
        os.unlink(tmp)
        if path.is_symlink() and not path.exists():
            # Not a race but a link to nothing (a key on a drive not mounted?): making a
            # new identity behind it would be wrong, and trying again looped for ever.
            raise _dangling(path) from None
        return load_or_create_identity(path)
    except OSError:
        os.replace(tmp, path)  # filesystems without hard links
    else:
        os.unlink(tmp)
    # The link itself on disk: a power cut right after the first start must not leave
    # the folder without the key that peers and the trainers' ledgers already know.
    fsync_dir(path.parent)
    logger.info("created a new node key at %s", path)
    return identity
