"""One worker per device: compute runs in a thread so the trio loop never blocks, and
one batch at a time per device so batches do not fight over the same cores or memory.

The volunteer's compute limits live here, changeable at any time: ``duty_cycle`` (the
share of time the device may be busy: after a job that took t seconds the device rests
t·(1-d)/d before the next one starts, so a job's own reply is not delayed) and
``max_batch_size`` (a cap on the samples the batch queues join into one batch; 0 = none).
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
        self.duty_cycle = 1.0
        self.max_batch_size = 0
        self._rest_until = 0.0  # trio time before which the next job must not start

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
        """Run ``fn`` on a worker thread; the caller holds ``turn()``. Waits out the
        rest the duty cycle asks for after the previous job first."""
        rest = self._rest_until - trio.current_time()
        if rest > 0:
            await trio.sleep(rest)

        took = 0.0

        def timed() -> T:
            nonlocal took
            start = time.perf_counter()
            try:
                return fn()
            finally:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                took = time.perf_counter() - start
                self._busy_s += took
                self._batches += 1

        try:
            return await trio.to_thread.run_sync(timed)
        finally:
            duty = min(max(self.duty_cycle, 0.01), 1.0)
            if duty < 1.0:
                self._rest_until = trio.current_time() + took * (1.0 - duty) / duty

    def batch_limit(self, configured: int) -> int:
        """``configured`` samples per batch, or fewer under the volunteer's cap."""
        cap = self.max_batch_size
        return min(configured, cap) if cap > 0 else configured

    def statistics(self) -> ExecutorStats:
        return ExecutorStats(batches=self._batches, busy_s=self._busy_s)
