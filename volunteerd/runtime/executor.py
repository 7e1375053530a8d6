"""One worker per device: compute runs in a thread so the trio loop never blocks, and
one batch at a time per device so batches do not fight over the same cores or memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import trio

__all__ = ["DeviceExecutor", "ExecutorStats"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ExecutorStats:
    batches: int
    busy_s: float


class DeviceExecutor:
    """Runs blocking compute for one device, one call at a time, in FIFO order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._limiter = trio.CapacityLimiter(1)
        self._batches = 0
        self._busy_s = 0.0

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device's worker thread, after the work queued before it.
        On cancellation, waits for ``fn`` to finish (a half-applied optimizer step would be
        worse than a short wait)."""
        async with self.turn():
            return await self.run_now(fn)

    def turn(self) -> trio.CapacityLimiter:
        """Hold the device (``async with``): for work that must start exactly when its
        turn comes, such as closing the window for gradients before a step."""
        return self._limiter

    async def run_now(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on a worker thread; the caller holds ``turn()``."""

        def timed() -> T:
            start = time.perf_counter()
            try:
                return fn()
            finally:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self._busy_s += time.perf_counter() - start
                self._batches += 1

        return await trio.to_thread.run_sync(timed)

    def statistics(self) -> ExecutorStats:
        return ExecutorStats(batches=self._batches, busy_s=self._busy_s)
