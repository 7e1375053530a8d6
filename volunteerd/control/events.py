"""The daemon's recent events, for the ``events`` long poll: state changes, limit
changes, experts taken on or dropped, reachability changes, new trainers and trimmed
connections, bans, errors.

The services post them as they happen (``EventSink``); nothing is guessed by comparing
snapshots. Each event gets the next integer id; a client asks for the events after the
last id it saw and waits (bounded) until there is one. The log keeps the newest
``keep`` events: a client that fell further behind gets what is left (it sees the gap
in the ids).

No kind of event holds more than ``keep_per_kind`` of them (a fifth): strangers can post
some kinds at will (a new identity's first request is a ``peers`` event, a misbehaving
one's ban a ``bans`` event), and a flood of fresh identities pushed every error and
state change out of the log within minutes. A kind over its share loses its own oldest.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Protocol

import trio

from volunteerd.control.models import Event, EventKind

__all__ = ["EventLog", "EventSink"]


class EventSink(Protocol):
    """Where services post what just happened (call from the trio thread)."""

    def post(self, kind: EventKind, message: str) -> object: ...


class EventLog:
    """The one ``EventSink`` of a daemon, read by the control API."""

    def __init__(
        self,
        keep: int = 500,
        *,
        keep_per_kind: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._events: deque[Event] = deque()
        self._keep = keep
        self._keep_per_kind = keep_per_kind if keep_per_kind is not None else max(1, keep // 5)
        self._kinds: Counter[str] = Counter()
        self._next_id = 1
        self._clock = clock
        self._changed = trio.Event()

    def post(self, kind: EventKind, message: str) -> Event:
        """Record an event and wake the waiting clients (call from the trio thread)."""
        event = Event(id=self._next_id, time=self._clock(), kind=kind, message=message)
        self._next_id += 1
        self._events.append(event)
        self._kinds[kind] += 1
        if self._kinds[kind] > self._keep_per_kind:  # its own oldest goes (a scan of 500)
            oldest = next(e for e in self._events if e.kind == kind)
            self._events.remove(oldest)
            self._kinds[kind] -= 1
        elif len(self._events) > self._keep:
            self._kinds[self._events.popleft().kind] -= 1
        self._changed.set()
        self._changed = trio.Event()
        return event

    def after(self, since: int) -> list[Event]:
        return [e for e in self._events if e.id > since]

    async def wait_after(self, since: int, wait_s: float) -> list[Event]:
        """The events after ``since``, waiting up to ``wait_s`` for the first one."""
        with trio.move_on_after(wait_s):
            while not (events := self.after(since)):
                await self._changed.wait()
            return events
        return []
