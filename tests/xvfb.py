"""A fresh Xvfb for the tests that need an X server (the tray, the X11 idle source)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

XVFB = shutil.which("Xvfb")


@contextlib.contextmanager
def x_server(
    logs: Path, screen: str = "640x480x24"
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start Xvfb (its log in ``logs``/xvfb.log); yields its DISPLAY and its process, and
    stops it on the way out."""
    if XVFB is None:
        raise RuntimeError("Xvfb is not installed (scripts/system-deps installs it)")
    read_fd, write_fd = os.pipe()
    # -displayfd: Xvfb picks a free display number and writes it when it is ready
    with (logs / "xvfb.log").open("w") as output:  # the child has its own copy
        xvfb = subprocess.Popen(
            [XVFB, "-displayfd", str(write_fd), "-screen", "0", screen, "-nolisten", "tcp"],
            pass_fds=(write_fd,),
            stdout=subprocess.DEVNULL,
            stderr=output,
        )
    os.close(write_fd)
    try:
        with os.fdopen(read_fd) as f:
            number = f.readline().strip()
        if not number:
            raise RuntimeError(f"Xvfb did not start:\n{(logs / 'xvfb.log').read_text()}")
        yield f":{number}", xvfb
    finally:
        xvfb.terminate()
        try:
            xvfb.wait(10)
        except subprocess.TimeoutExpired:
            xvfb.kill()
            xvfb.wait(10)
