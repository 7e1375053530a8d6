"""Keeping freed weight-sized buffers for reuse (glibc only).

Between optimizer steps an expert's gradients are None; each step's first backward
writes them into fresh buffers (cheaper than zeroing persistent ones and adding into
them). With glibc's default policy those buffers cost page faults every time: a freed
block of a few MiB at the top of the heap is returned to the kernel once more than
twice the largest recent block is free, and blocks above the (adaptive) mmap threshold
are unmapped on free. Every step then touches fresh pages: at hidden 512, 8 MiB per
expert per step, and the page faults cost as much as the backward's arithmetic (8
experts: 60 ms of backward instead of 35).

``reuse_freed_memory`` raises both thresholds once per process: blocks up to
``MMAP_THRESHOLD`` come from the heap, and up to ``TRIM_THRESHOLD`` of free heap is kept
for reuse instead of being returned. The process's resident memory can therefore stay
up to that much above what it uses; on other C libraries it does nothing.

Both thresholds govern the main arena only in practice: a thread that is not the main
one gets an arena of its own, whose heaps glibc unmaps whole once they empty, and the
experts' compute runs on worker threads. Between steps an expert's gradients are its
largest free blocks, so the heap emptied and came back step after step: during the DMoE
step benchmark the daemon hosting 8 experts took ~18,000 page faults a second, 8 % of a
core in the kernel. ``one_arena``, called by the command line before the process starts
any thread, makes every thread allocate from the main arena, where the thresholds hold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "one_arena", "reuse_freed_memory"]

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its adaptive threshold on 64 bits
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_done = False


def reuse_freed_memory() -> bool:
    """Set glibc's malloc thresholds (once per process). True when they are set."""
    global _done
    if _done:
        return True
    _done = _mallopt((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done


def one_arena() -> bool:
    """Make every thread allocate from glibc's main arena, and set the thresholds
    (``reuse_freed_memory``). Only threads that have no arena yet are affected, so call
    it before the process starts any thread: the command line does, first thing. True
    when set."""
    return _mallopt((_M_ARENA_MAX, 1)) and reuse_freed_memory()


def _mallopt(*settings: tuple[int, int]) -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return all(libc.mallopt(option, value) == 1 for option, value in settings)
    except (OSError, AttributeError) as exc:
        logger.debug("mallopt is not available: %s", exc)
        return False
