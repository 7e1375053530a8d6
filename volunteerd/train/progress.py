"""A progress bar for training, on stderr. On a terminal it redraws one line; in a log
(not a terminal) it prints a line every few percent instead."""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "Rate"]


class Rate:
    """Units per second over the last ``window_s`` seconds. With several batches in
    flight one step's own duration says nothing about throughput (four overlapping
    steps of 1 s each make 4 steps/s): count what finished in a window instead.

    The window is measured from the last event before it (or the start), so steps
    slower than the window still read as their own rate, not as one step per window."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._events: deque[tuple[float, float]] = deque()  # (when, units)

    def add(self, units: float) -> None:
        now = self._clock()
        self._events.append((now, units))
        # keep one event at or before the window's start: the rate is measured from it
        while len(self._events) >= 2 and self._events[1][0] <= now - self.window_s:
            self._events.popleft()

    def per_s(self) -> float:
        """Units finished since the anchor (the last event before the window) per
        second; without one, those in the window (or since the start, if younger)."""
        now = self._clock()
        if len(self._events) >= 2 and self._events[0][0] <= now - self.window_s:
            since = self._events[0][0]
            units = sum(u for _, u in list(self._events)[1:])
        else:
            since = max(self._started, now - self.window_s)
            units = sum(u for t, u in self._events if t >= since)
        return units / max(now - since, 1e-9)


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self._every = max(1, total // 20)
        self._last = ""
        self._started = time.monotonic()

    def update(self, step: int, fields: dict[str, str]) -> None:
        done = int(self.width * step / max(self.total, 1))
        bar = "=" * done + (">" if done < self.width else "") + " " * (self.width - done - 1)
        elapsed = time.monotonic() - self._started
        text = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{bar[: self.width]}] "
            + (" | ".join(f"{k} {v}" for k, v in fields.items()))
            + f" | {elapsed:.0f}s"
        )
        if self.tty:
            self.stream.write("\r" + text.ljust(len(self._last)))
            self.stream.flush()
        elif step % self._every == 0 or step == self.total:
            self.stream.write(text + "\n")
            self.stream.flush()
        self._last = text

    def message(self, text: str) -> None:
        """A line of its own, above the bar."""
        if self.tty and self._last:
            self.stream.write("\r" + " " * len(self._last) + "\r")
        self.stream.write(text + "\n")
        if self.tty and self._last:
            self.stream.write(self._last)
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._last:
            self.stream.write("\n")
            self.stream.flush()
