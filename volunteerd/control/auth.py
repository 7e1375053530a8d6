"""Who may use the control API: local programs that can read the token file.

* The token: 32 random bytes (URL-safe text) written on first start to ``api-token``
  in the data folder, mode 0600; every route but ``health`` and the dashboard's static
  files wants it as ``Authorization: Bearer <token>``. Compared in constant time.
* The Host header must name this server by loopback (``127.0.0.1``, ``localhost`` or
  ``[::1]`` with its port): a web page on another name that resolves to 127.0.0.1 (DNS
  rebinding) is refused with 403 before anything else happens.
* A request carrying an ``Origin`` from anywhere but this server is refused (403), and
  no CORS header is ever sent, so other sites' pages can neither read nor write.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

__all__ = ["allowed_hosts", "check_token", "load_or_create_token"]

_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def load_or_create_token(path: Path) -> str:
    """The API token in ``path``; created (0600) if missing or empty."""
    try:
        token = path.read_text().strip()
        if token:
            if os.name == "posix" and path.stat().st_mode & 0o077:
                path.chmod(0o600)  # someone loosened it: tighten again
            return token
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
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


def allowed_hosts(port: int) -> frozenset[str]:
    """The Host header values that name this server."""
    return frozenset(f"{name}:{port}" for name in _LOOPBACK_NAMES)


def check_token(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``token``."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())
