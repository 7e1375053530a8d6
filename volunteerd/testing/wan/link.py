"""One direction of an access link: a FIFO served at a fixed rate behind a drop-tail
queue. Pure arithmetic on times the caller gives, so tests drive it with a fake clock."""

from __future__ import annotations

import math


class Link:
    """A link of `mbit` Mbit/s whose queue holds `queue_ms` worth of bytes (at least two
    packets of `mtu`, so a slow link still passes full-size packets).

    The queue is kept as the time the link finishes sending what it holds; the bytes
    waiting at time t are what the rate sends between t and then.
    """

    __slots__ = ("_busy_until", "_bytes_per_s", "_queue_bytes")

    def __init__(self, mbit: float, queue_ms: float, mtu: int) -> None:
        self._bytes_per_s = mbit * 1e6 / 8
        self._queue_bytes = max(self._bytes_per_s * queue_ms / 1000, 2 * mtu)
        self._busy_until = 0.0

    def admit(self, now: float, size: int) -> float | None:
        """The time a packet of `size` bytes arriving at `now` has left the link (its last
        bit sent), or None when the queue is full and it is dropped. Calls come in
        non-decreasing `now`."""
        if math.isinf(self._bytes_per_s):
            return now
        start = max(self._busy_until, now)
        # a byte of slack: float time must not drop a packet that exactly fits
        if (start - now) * self._bytes_per_s + size > self._queue_bytes + 1:
            return None
        self._busy_until = start + size / self._bytes_per_s
        return self._busy_until

    def backlog_bytes(self, now: float) -> float:
        """Bytes queued or being sent at `now`."""
        if math.isinf(self._bytes_per_s):
            return 0.0
        return max(0.0, self._busy_until - now) * self._bytes_per_s
