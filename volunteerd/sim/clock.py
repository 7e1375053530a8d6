"""Virtual time for a trio program whose torch work runs in worker threads.

``trio.testing.MockClock(autojump_threshold=0)`` turns trio into a discrete-event
simulator: when every task is blocked, time jumps to the next deadline. That is wrong
for the simulator's trainer, whose torch code runs in a worker thread and re-enters the
loop for every network round (``TrainerClient.run``): while the thread computes, every
task *is* blocked, and the clock would jump over the computation to whatever timer is
next. ``SimClock`` jumps only while no worker is computing. Who computes is counted on
the loop (``computing``), never from the threads, so the loop's view is exact:

* ``await clock.in_thread(fn)`` runs ``fn`` in a worker thread, counted from before it
  starts until the loop has its result;
* ``clock.on_loop(afn)``, called from such a thread, runs ``afn`` on the loop with the
  thread counted as waiting (its network round takes virtual time).

Virtual time stands still while torch computes; what computing costs is charged
explicitly (``sim.network.Cpu``), from measured figures (``sim.calibration``).

Order: trio runs tasks that wake at the same instant in a randomised order; ``seed``
fixes trio's scheduler's random source, so a run is repeatable given its seed (events at
distinct instants are ordered by time in any case).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
import trio.abc
from trio._core import _run as trio_run  # the scheduler's random source (see seed)

__all__ = ["SimClock", "seed_scheduler"]

T = TypeVar("T")

# While a worker computes, the loop waits for it in real time; its result (or its
# re-entry) wakes the loop at once, so this is only an upper bound between looks.
_WAIT_FOR_WORKER_S = 0.5


def seed_scheduler(seed: int) -> None:
    """Make trio's choice among tasks woken at the same instant repeatable."""
    trio_run._r.seed(seed)


class SimClock(trio.abc.Clock):
    """A clock that starts at 0 and jumps to the next deadline whenever nothing runs
    (no runnable task and no worker computing)."""

    def __init__(self) -> None:
        self._now = 0.0
        self.computing = 0
        self.jumps = 0
        self._token: trio.lowlevel.TrioToken | None = None

    # -- trio.abc.Clock ------------------------------------------------------------------

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return self._now

    def deadline_to_sleep_time(self, deadline: float) -> float:
        # Called only when no task is runnable.
        if deadline <= self._now:
            return 0.0
        if self.computing:
            return _WAIT_FOR_WORKER_S
        if math.isinf(deadline):
            return math.inf
        self._now = deadline
        self.jumps += 1
        return 0.0

    # -- workers --------------------------------------------------------------------------

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, virtual time standing still meanwhile except
        while it waits in ``on_loop``."""
        self._token = trio.lowlevel.current_trio_token()
        self.computing += 1
        try:
            return await trio.to_thread.run_sync(fn, *args)
        finally:
            self.computing -= 1

    def on_loop(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """From a worker of ``in_thread``: ``await afn(*args)`` on the loop, in virtual
        time."""

        async def waiting() -> T:
            self.computing -= 1
            try:
                return await afn(*args)
            finally:
                self.computing += 1

        return trio.from_thread.run(waiting, trio_token=self._token)
