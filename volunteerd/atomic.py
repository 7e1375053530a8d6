"""Writing files so that a crash (even ``kill -9`` or a power cut) leaves either the old
content or the new one, never a mix: write a temporary file in the same folder, flush and
fsync it, rename it over the target, then fsync the folder so the rename itself is on
disk. Used for the pause state, run-time limits, the transfer count and checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "write_atomic"]


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` atomically (see the module docstring)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
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
