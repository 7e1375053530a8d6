"""Reading TOML: the one place that turns whatever a damaged file raises into a
ConfigError.

``tomllib`` raises ``TOMLDecodeError`` for most bad text, but a plain ``ValueError``
for an integer of more than 4,300 digits (Python's limit on converting them) and
``RecursionError`` for arrays nested a few thousand deep; a file that is not UTF-8
raises ``UnicodeDecodeError``. Caught by type one at a time, the rare ones escaped as
tracebacks: a damaged ``limits.toml`` reloaded on SIGHUP stopped the daemon.
"""

from __future__ import annotations

import errno
import tomllib
from pathlib import Path
from typing import Any

from volunteerd.atomic import DanglingLink, read_small
from volunteerd.errors import ConfigError, ConfigUnavailable

__all__ = ["parse_toml", "read_toml"]

MAX_BYTES = 16 * 2**20  # every file of ours is a few KiB; a manifest's text is far less
# A drive's I/O error, a network file system's server gone: may pass on a restart.
_FOR_NOW = frozenset({errno.EIO, errno.ESTALE, errno.ENOTCONN, errno.ETIMEDOUT, errno.ENODEV})
_NOT_TOML = (ValueError, RecursionError)  # ValueError covers TOMLDecodeError and UnicodeDecodeError


def _why(exc: BaseException) -> str:
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML file at ``path``. Raises FileNotFoundError when there is none (the
    caller decides what that means) and ConfigError, naming the file, for anything
    else: text that is not TOML or not UTF-8, a folder, a FIFO or device (opened
    without waiting, never read: a FIFO nobody writes to would block forever), a link
    to nothing (read as "no file", a daemon left its projects silently), more than
    ``MAX_BYTES``, no permission. A link to nothing and a drive's I/O error raise
    ConfigUnavailable, the ConfigError that exits 5 (the service manager restarts it)."""
    try:
        data = read_small(path, MAX_BYTES)
    except FileNotFoundError:
        raise
    except OSError as exc:  # a link to nothing too: not "no file" (a drive not mounted)
        # Only "for now" (the link's drive, an I/O error) may pass on a restart; a
        # folder, a FIFO or no permission will not.
        unavailable = isinstance(exc, DanglingLink) or exc.errno in _FOR_NOW
        error = ConfigUnavailable if unavailable else ConfigError
        raise error(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return tomllib.loads(data.decode())
    except _NOT_TOML as exc:
        raise ConfigError(f"{path}: not valid TOML: {_why(exc)}") from None


def parse_toml(text: str, what: str) -> dict[str, Any]:
    """TOML ``text``; raises ConfigError naming ``what`` it is."""
    try:
        return tomllib.loads(text)
    except _NOT_TOML as exc:
        raise ConfigError(f"{what}: not valid TOML: {_why(exc)}") from None
