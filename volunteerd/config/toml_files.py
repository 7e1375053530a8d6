"""Reading TOML: the one place that turns whatever a damaged file raises into a
ConfigError.

``tomllib`` raises ``TOMLDecodeError`` for most bad text, but a plain ``ValueError``
for an integer of more than 4,300 digits (Python's limit on converting them) and
``RecursionError`` for arrays nested a few thousand deep; a file that is not UTF-8
raises ``UnicodeDecodeError``. Caught by type one at a time, the rare ones escaped as
tracebacks: a damaged ``limits.toml`` reloaded on SIGHUP stopped the daemon.

Files as Windows Notepad (and older editors) save them are read too: a UTF-8 byte
order mark, a UTF-16 file with its mark, a Ctrl-Z (``\\x1a``) at the end. They read as
"Invalid statement (at line 1, column 1)" or "can't decode byte 0xff in position 0",
errors nobody could act on, and a ``projects.toml`` with a mark stopped the daemon.
UTF-32 with its mark is read too. UTF-16 or UTF-32 without a mark (NUL bytes between
the letters) is refused as such ("Invalid initial character for a key part" said
nothing), and other bytes that are not UTF-8 (a Latin-1 "ü" in a comment) are named
by line and column, with what to do: save the file as UTF-8.
"""

from __future__ import annotations

import codecs
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
        return tomllib.loads(_text(data))
    except _NOT_TOML as exc:
        raise ConfigError(f"{path}: not valid TOML: {_why(exc)}") from None


# UTF-32's marks first: UTF-32 LE's begins with UTF-16 LE's.
_MARKS = (
    ((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE), "utf-32"),
    ((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE), "utf-16"),
)
_SNIFF_BYTES = 512


def _text(data: bytes) -> str:
    """A file's bytes as text: UTF-8, after a byte order mark if there is one, or
    UTF-16 or UTF-32 with its mark (Notepad's "Unicode"); a Ctrl-Z after the end
    (DOS's end of file, some Windows editors still write it) left out. Raises
    ValueError naming the line and column of a byte that is not UTF-8, or saying the
    file looks like UTF-16 or UTF-32 without a mark."""
    for marks, codec in _MARKS:
        if data.startswith(marks):
            try:
                text = data.decode(codec)  # reads the mark and drops it
            except UnicodeDecodeError:
                name = codec.upper()
                raise ValueError(f"saved as {name} but damaged: save it as UTF-8") from None
            return text.rstrip("\x1a")
    head = data[:_SNIFF_BYTES]
    # TOML allows no NUL anywhere; UTF-16 of ASCII text has one in every other byte,
    # UTF-32 three in four. One stray NUL is left to tomllib, which names its line.
    if head.count(0) * 4 >= len(head) > 0:
        raise ValueError("looks like UTF-16 or UTF-32 without a byte order mark: save it as UTF-8")
    try:
        text = data.removeprefix(codecs.BOM_UTF8).decode()
    except UnicodeDecodeError as exc:
        raise ValueError(_where_not_utf8(exc)) from None
    return text.rstrip("\x1a")


def _where_not_utf8(exc: UnicodeDecodeError) -> str:
    """Where the first byte that is not UTF-8 is, as an editor counts (line and
    column from 1), for a person to find it: not a byte offset."""
    data = bytes(exc.object)
    start = data.rfind(b"\n", 0, exc.start) + 1
    line = data.count(b"\n", 0, exc.start) + 1
    column = len(data[start : exc.start].decode("utf-8", "replace")) + 1
    byte = data[exc.start]
    return f"byte 0x{byte:02x} at line {line}, column {column} is not UTF-8: save the file as UTF-8"


def parse_toml(text: str, what: str) -> dict[str, Any]:
    """TOML ``text``; raises ConfigError naming ``what`` it is."""
    try:
        return tomllib.loads(text)
    except _NOT_TOML as exc:
        raise ConfigError(f"{what}: not valid TOML: {_why(exc)}") from None
