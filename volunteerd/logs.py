"""Logging set-up, and the one place third-party chatter is tamed.

py-libp2p logs routine events as warnings and errors — a normally closed Kademlia
stream ("Failed to read DHT message from stream", dozens a minute), a dial to a peer
that left, a rejected value dumped in hex — thousands of lines in a normal run. Its
import also detaches its loggers from the root, so its records would reach stderr
through logging's last-resort handler, without time or name, in any program that uses
volunteerd as a library (a researcher's own training script) and never configures
logging.

So every third-party logger named in ``_THIRD_PARTY`` is routed through one handler,
``_Routed``, into the root logger's handlers (volunteerd's, or the program's own):

* shown only while volunteerd logs at DEBUG, apart from CRITICAL records, which are
  always shown (volunteerd reports the failures that matter itself);
* an identical message (same logger, level and text) is shown at most ``_BURST`` times
  a minute; the next one shown after that says how many were left out.

volunteerd's own warnings and errors, on the handler ``configure_logging`` sets up (the
daemon's, the command line's), are summarised the same way (``_OwnRepeats``, 10 a minute), by
kind rather than by text: a peer must not be able to fill a volunteer's disk with the log of
a failure it can repeat.

What a line shows is escaped (``_escaped``): a message can carry a peer's text (an error
reply, a manifest's fault), and an ESC, a line break or a bidi override in it would act on
the terminal or forge a line of the log rather than be read. A traceback keeps its own
line breaks; its exceptions' messages are escaped like the rest. A line, and an
exception's message, shows at most ``_MAX_LINE`` characters and says how many more.

``volunteerd.net`` calls ``tame_third_party()`` as soon as it has imported py-libp2p
(every entry point and every library use goes through it); ``configure_logging`` calls
it again with the level it sets. Setting ``LIBP2P_DEBUG`` leaves py-libp2p's own
logging set-up alone (its handlers, its levels): the way to debug py-libp2p itself.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from volunteerd import localtime
from volunteerd.shown import escaped

__all__ = ["configure_logging", "tame_third_party"]

_THIRD_PARTY = ("libp2p", "multiaddr", "async_service", "hypercorn", "trio", "pystray")
# trio's listener logs each failed accept (out of file descriptors) with its traceback,
# ten a second while the descriptors stay used up: 973 tracebacks, 769 KB in 100 s of an
# outside probe that held a low limit's worth of connections. Its records are tamed like
# the rest; volunteerd says it once, in its own words (``_out_of_descriptors``).
_ACCEPT_LOGGER = "trio.serve_listeners"
_BURST = 3
_OWN_BURST = 10  # volunteerd's own: kinds are coarser (a message before its arguments)
_WINDOW_S = 60.0
_MAX_KEYS = 512
# The most characters of one line (and of an exception's message in a traceback), after
# escaping: a stranger's text in a refusal (a header key of 65,000 characters, six times
# longer once escaped) made lines of 130 KB, 1.1 GB of log a day from one request every
# 5 s, past any limit on the number of lines (an outside probe).
_MAX_LINE = 2000
_ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]


class _Repeats:
    """How many records of each kind were shown in the current minute: ``burst`` are,
    the rest are left out and counted, and the next one shown after the minute says how
    many. Bounded memory (``_MAX_KEYS`` kinds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, burst: int = _BURST) -> None:
        self.clock = clock
        self.burst = burst
        # kind -> [window start, shown in window, left out in window]
        self._seen: dict[tuple[object, ...], list[float]] = {}

    def count(self, key: tuple[object, ...]) -> int | None:
        """None: leave this record out; else show it, with how many like it were left
        out since it was last shown."""
        now = self.clock()
        seen = self._seen.get(key)
        if seen is None or now - seen[0] >= _WINDOW_S:
            left_out = 0 if seen is None else int(seen[2])
            if len(self._seen) >= _MAX_KEYS:
                self._forget(now)
            self._seen[key] = [now, 1, 0]
            return left_out
        if seen[1] < self.burst:
            seen[1] += 1
            return 0
        seen[2] += 1
        return None

    def shown(self, key: tuple[object, ...]) -> int:
        """How many of ``key``'s kind were shown in the current window."""
        seen = self._seen.get(key)
        return 0 if seen is None else int(seen[1])

    def _forget(self, now: float) -> None:
        """Drop the windows that are over, or every one if none is."""
        stale = [key for key, seen in self._seen.items() if now - seen[0] >= _WINDOW_S]
        for key in stale or list(self._seen):
            del self._seen[key]


def _noting(record: logging.LogRecord, text: str, left_out: int) -> logging.LogRecord:
    if not left_out:
        return record
    record = logging.makeLogRecord(record.__dict__)
    record.msg = f"{text} ({left_out} more like this in the last minute not shown)"
    record.args = None
    return record


class _Routed(logging.Handler):
    """Passes third-party records on to the root logger's handlers, as described in
    the module docstring; identical texts are counted by ``_Repeats``. Called under the
    handler's lock (logging.Handler.handle), so its counters need no other."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.repeats = _Repeats(clock)

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == _ACCEPT_LOGGER and record.levelno >= logging.ERROR:
            _out_of_descriptors(record)
        debugging = logging.getLogger("volunteerd").isEnabledFor(logging.DEBUG)
        if record.levelno < logging.CRITICAL and not debugging:
            return
        try:
            text = record.getMessage()
        except Exception:  # a third party's bad format arguments: not worth a traceback
            text = str(record.msg)
        left_out = self.repeats.count((record.name, record.levelno, text))
        if left_out is None:
            return
        logging.getLogger().handle(_noting(record, text, left_out))


def _out_of_descriptors(record: logging.LogRecord) -> None:
    """volunteerd's own warning for a failed accept (``_OwnRepeats`` keeps it to a few
    lines a minute, however often it fails)."""
    error = record.exc_info[1] if record.exc_info else None
    reason = os.strerror(error.errno) if isinstance(error, OSError) and error.errno else "?"
    logging.getLogger("volunteerd.net").warning(
        "new connections cannot be accepted (%s): the process is out of file descriptors "
        "or memory; it retries by itself (see the open-file limit, `ulimit -n`)",
        reason,
    )


class _OwnRepeats(logging.Filter):
    """volunteerd's own lines from INFO up on the handler ``configure_logging`` sets
    up: at most ``_OWN_BURST`` a minute of one kind (logger, level, message before its
    arguments, exception type), whatever the arguments (a peer's id, an expert's uid).
    A peer that can make the daemon log a failure or a refusal (a bug it found, a bad
    header logged at INFO, the default level) could otherwise repeat it at its request
    rate: gigabytes of a log that nothing rotates (an outside probe: 0.6 GB a day from
    one identity's bad requests), and the CPU to format the tracebacks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.repeats = _Repeats(clock, _OWN_BURST)
        self._lock = threading.Lock()  # filters run before the handler takes its own

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO or not record.name.startswith("volunteerd"):
            return True
        error = record.exc_info[1] if record.exc_info else None
        key = (record.name, record.levelno, str(record.msg), type(error).__qualname__)
        with self._lock:
            left_out = self.repeats.count(key)
            last = left_out is not None and self.repeats.shown(key) == self.repeats.burst
        if left_out is None:
            return False
        notes = []
        if left_out:
            notes.append(f"{left_out} more like this in the last minute not shown")
        if last:  # a reader must know that silence after it is not the end of them
            notes.append("more like this within a minute are counted, not shown")
        if notes:  # on the record, not in its message: other handlers see it as it was
            record.volunteerd_repeats = "; ".join(notes)
        return True


class _NotingFormatter(logging.Formatter):
    """Adds ``_OwnRepeats``' note, if the record has one, to the end of its line (before
    a traceback), and escapes what the line shows (``_escaped``): one record, one line.
    Its times follow a change of the machine's time zone (``localtime``)."""

    converter = staticmethod(localtime.local)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = _capped(escaped(super().formatMessage(record)))
        note = getattr(record, "volunteerd_repeats", None)
        return f"{line} ({escaped(note)})" if note else line

    def formatException(self, ei: _ExcInfo) -> str:
        """The traceback with its own line breaks, but each exception's message (which
        can quote a peer) escaped whole, line breaks included."""
        text = super().formatException(ei)
        seen: set[int] = set()
        error = ei[1]
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            try:
                message = str(error)
            except Exception:  # traceback shows "<exception str() failed>"
                message = ""
            shown = _capped(escaped(message))
            if message and shown != message:
                text = text.replace(message, shown)
            error = error.__cause__ or error.__context__
        return escaped(text, keep="\n")

    def formatStack(self, stack_info: str) -> str:
        return escaped(stack_info, keep="\n")


def _capped(text: str) -> str:
    """``text``, or its first ``_MAX_LINE`` characters and how many more there were."""
    if len(text) <= _MAX_LINE:
        return text
    return f"{text[:_MAX_LINE]}… ({len(text) - _MAX_LINE} more characters not shown)"


_ROUTED = _Routed()


def tame_third_party() -> None:
    """Route the third-party loggers through ``_Routed`` at the level volunteerd's own
    logger has now. Idempotent; call it again after py-libp2p is (first) imported, as
    its import resets its loggers."""
    debugging = logging.getLogger("volunteerd").isEnabledFor(logging.DEBUG)
    names = [n for n in _THIRD_PARTY if not (n == "libp2p" and os.environ.get("LIBP2P_DEBUG"))]
    for name in names:
        logger = logging.getLogger(name)
        logger.handlers = [h for h in logger.handlers if h is not _ROUTED]
        logger.addHandler(_ROUTED)
        logger.propagate = False  # _ROUTED passes on what is to be shown
        # Below the level shown, records are not even made (py-libp2p logs a lot).
        logger.setLevel(logging.DEBUG if debugging else logging.WARNING)
    # Some of py-libp2p's modules set their own levels (one sets INFO); bring them back
    # under their parents, so that their debug records show with the rest.
    children = tuple(f"{name}." for name in names)
    for name, child in logging.root.manager.loggerDict.items():
        if isinstance(child, logging.Logger) and name.startswith(children):
            child.setLevel(logging.NOTSET)


def configure_logging(level: str = "INFO") -> None:
    """Log to stderr with timestamps; ``level`` applies to volunteerd's own loggers,
    and at DEBUG the third parties' records are shown too (rate-limited)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _NotingFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
    )
    handler.addFilter(_OwnRepeats())
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("volunteerd").setLevel(level)
    tame_third_party()
