"""Who may use the control API: local programs that can read the token file.

* The token: 32 random bytes (URL-safe text) written on first start to ``api-token``
  in the data folder, mode 0600; every route but ``health`` and the dashboard's static
  files wants it as ``Authorization: Bearer <token>``. Compared in constant time.
* The Host header must name this server by loopback (``127.0.0.1``, ``localhost`` or
  ``[::1]`` with its port): a web page on another name that resolves to 127.0.0.1 (DNS
  rebinding) is refused with 403 before anything else happens.
* A request carrying an ``Origin`` from anywhere but this server is refused (403), and
  no CORS header is ever sent, so other sites' pages can neither read nor write.
* The server proves it knows the token before a client sends it: ``health`` answers a
  ``challenge`` with ``prove(token, challenge)``. A ``control.json`` left behind by a
  daemon that crashed names a port that another local user's program may hold next;
  the client checks the proof first, so that program never sees the token.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from volunteerd.atomic import make_private_dirs, read_small

__all__ = [
    "MAX_CHALLENGE_CHARS",
    "allowed_hosts",
    "check_token",
    "is_token_text",
    "load_or_create_token",
    "prove",
]

logger = logging.getLogger(__name__)

MAX_CHALLENGE_CHARS = 128
_MAX_TOKEN_FILE = 4096  # a token file holds ~44 characters

_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def load_or_create_token(path: Path) -> str:
    """The API token in ``path``; created (0600) if missing, empty or not a token (bytes
    that are not visible ASCII, a link, a FIFO or a device: logged). Raises OSError if
    ``path`` cannot be read or written (e.g. it is a folder)."""
    try:
        # Not through a link: one to another file gave that file's text as the token
        # and tightened that file's mode (an outside probe: /etc/hostname made 0600).
        raw = read_small(path, _MAX_TOKEN_FILE, links=False).strip()
    except FileNotFoundError:
        raw = b""
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EINVAL, errno.EFBIG):
            raise  # no permission: nothing to replace
        # a link, a FIFO, a device, a huge file: replaced by a file with a new token
        # (a folder is refused by the rename below)
        logger.warning("%s is not a token file (%s): making a new one", path, exc.strerror)
        raw = b""
    if raw:
        token = raw.decode("ascii", errors="replace")
        if is_token_text(token):
            if os.name == "posix" and path.stat().st_mode & 0o077:
                path.chmod(0o600)  # someone loosened it: tighten again
            return token
        # Such bytes cannot travel in an HTTP header (clients failed on them), and the
        # file holds nothing anyone could use: a new token is all that is lost.
        logger.warning("%s does not hold a token (damaged?): making a new one", path)
    make_private_dirs(path.parent)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def is_token_text(text: str) -> bool:
    """Whether ``text`` can be a token: visible ASCII, no spaces (what an HTTP header
    carries as is)."""
    return bool(text) and all("!" <= c <= "~" for c in text)


def allowed_hosts(port: int) -> frozenset[str]:
    """The Host header values that name this server."""
    return frozenset(f"{name}:{port}" for name in _LOOPBACK_NAMES)


def check_token(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``token``."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())


def prove(token: str, challenge: str) -> str:
    """The answer to ``challenge`` that only a holder of ``token`` can give (hex). The
    label keeps it from being a valid answer in any other use of the token."""
    message = b"volunteerd control proof\0" + challenge.encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()
