"""A clock that counts the time a computer slept.

``time.monotonic`` on Linux (and macOS) stops while the machine is suspended, so a
laptop closed for a night reads a few seconds passed. What compares its own elapsed time
with other computers' (replicas that trained on, peers' signed records whose times moved
on) must count the sleep: Linux's ``CLOCK_BOOTTIME`` does, and never goes back when the
wall clock is set. Where it is missing (macOS, Windows) ``time.monotonic`` stands in.
"""

from __future__ import annotations

import time

__all__ = ["awake_time"]


def awake_time() -> float:
    """Seconds on a clock that runs on while the machine sleeps and never goes back."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.monotonic()
