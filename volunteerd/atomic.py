"""Writing files so that a crash (even ``kill -9`` or a power cut) leaves either the old
content or the new one, never a mix: write a temporary file in the same folder, flush and
fsync it, rename it over the target, then fsync the folder so the rename itself is on
disk. Used for the pause state, run-time limits, the transfer count and checkpoints.

Each write has its own temporary file: two writers of one target (two requests of the
control API at once) used to share one name, so their bytes mixed in one file and the
second rename failed. The last rename wins; a write that fails leaves no temporary file.

Folders these files need are made private (``make_private_dirs``: 0700, missing parents
too, as the XDG spec asks of its base folders): under a umask of 000 they were made
0777, and another local user could move a key of theirs over ``identity.key``.

And reading such small files back (``read_small``): whatever stands at their name, a
FIFO, a link to ``/dev/zero`` or to a drive not mounted. Read plainly, a FIFO at
``state.json`` or ``identity.key`` held the daemon at start for good, a link to
``/dev/zero`` read until memory ran out, and a link to nothing read as "no file": a
daemon silently out of its projects, on default settings (an outside probe).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

__all__ = [
    "STATE_MAX_BYTES",
    "DanglingLink",
    "fsync_dir",
    "make_private_dirs",
    "read_small",
    "write_atomic",
]

# The most read of a small JSON file of ours (the pause state, the transfer count, the
# control file, a download's sidecar): each is well under 1 KiB; a damaged one of up to
# a MiB is still read, found damaged and moved aside for a look.
STATE_MAX_BYTES = 1 << 20


class DanglingLink(OSError):
    """A link to nothing where a file should be: not "no file" (FileNotFoundError), which
    would start afresh behind it (a drive not mounted yet)."""


def read_small(path: Path, max_bytes: int, *, links: bool = True) -> bytes:
    """The bytes of the regular file at ``path``. Raises FileNotFoundError when there is
    none, DanglingLink for a link to nothing, and OSError, with a ``strerror`` to show,
    for anything else: a folder, a FIFO or a device (opened without waiting and never
    read), more than ``max_bytes``, a link when ``links`` is false, no permission."""
    if not links and path.is_symlink():
        raise OSError(errno.ELOOP, f"a link to {os.readlink(path)}, not a file", str(path))
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    if not links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        if path.is_symlink():
            raise DanglingLink(
                errno.ENOENT, f"a link to {os.readlink(path)}, which does not exist", str(path)
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        data = b""
        while len(data) <= max_bytes and (chunk := os.read(fd, max_bytes + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"larger than {_size(max_bytes)}", str(path))
    return data


def _size(n: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def make_private_dirs(path: Path) -> None:
    """Make the folder ``path`` and each missing parent with mode 0700 (less what the
    umask takes away): ``Path.mkdir(mode=..., parents=True)`` gives the mode to the
    last folder only. Folders that exist are left as they are. Raises OSError (a file
    in the way, no permission)."""
    if path.parent != path and not path.parent.is_dir():
        make_private_dirs(path.parent)
    path.mkdir(mode=0o700, exist_ok=True)


def write_atomic(path: Path, data: str | bytes, *, sync_folder: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically (see the module docstring), making its
    folder if need be (``make_private_dirs``). Raises OSError (a full disk, a folder
    that cannot be written).

    ``sync_folder=False`` leaves out the folder's fsync, for a file rewritten often whose
    previous content is an acceptable thing to find after a power cut (a counter saved
    again within a minute): the new content is on disk before the rename, so the name
    holds the old file or the new one, never a mix or nothing; only the rename may be
    lost, and a temporary file left beside it, as a crash before the rename leaves one."""
    make_private_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_folder:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op on Windows)."""
    if os.name != "posix":  # pragma: no cover - Windows cannot open a directory
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
