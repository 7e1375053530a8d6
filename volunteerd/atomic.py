"""Writing files so that a crash (even ``kill -9`` or a power cut) leaves either the old
content or the new one, never a mix: write a temporary file in the same folder, flush and
fsync it, rename it over the target, then fsync the folder so the rename itself is on
disk. Used for the pause state, run-time limits, the transfer count and checkpoints.

Each write has its own temporary file: two writers of one target (two requests of the
control API at once) used to share one name, so their bytes mixed in one file and the
second rename failed. The last rename wins; a write that fails leaves no temporary file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["fsync_dir", "write_atomic"]


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` atomically (see the module docstring). Raises
    OSError (a full disk, a folder that cannot be written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
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
