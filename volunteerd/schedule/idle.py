"""How long nobody has touched the computer: one interface, one source per platform.

Every source has ``idle_seconds() -> float | None`` (None: unknown right now). Calls
may block briefly (a subprocess, an X11 round trip): the scheduler makes them in a
worker thread, one at a time.

* ``X11Idle``: the MIT-SCREEN-SAVER extension (``XScreenSaverQueryInfo`` through
  ctypes on libX11 and libXss), for the display in ``DISPLAY``. Not used in a Wayland
  session: XWayland sees only the input of X11 windows.
* ``LogindIdle``: systemd-logind's ``IdleHint``/``IdleSinceHint`` (``loginctl``) of
  this user's graphical session, or of the user as a whole: works under Wayland and on
  text consoles (the desktop or logind itself sets the hint).
* ``MacIdle``: ``HIDIdleTime`` of ``ioreg -c IOHIDSystem`` (nanoseconds).
* ``WindowsIdle``: ``GetLastInputInfo`` (milliseconds of the tick count).
* ``FakeIdle``: a value the test sets.

``choose_idle_source()`` returns the first of those that answers on this machine, or
``NoIdle`` (always unknown).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Protocol

__all__ = [
    "FakeIdle",
    "IdleSource",
    "LogindIdle",
    "MacIdle",
    "NoIdle",
    "WindowsIdle",
    "X11Idle",
    "choose_idle_source",
]

logger = logging.getLogger(__name__)

_COMMAND_S = 5.0  # a helper command that takes longer is not answering


class IdleSource(Protocol):
    name: str

    def idle_seconds(self) -> float | None:
        """Seconds since the last keyboard or mouse input; None when unknown."""
        ...


class NoIdle:
    """No way to tell on this machine."""

    name = "none"

    def idle_seconds(self) -> float | None:
        return None


class FakeIdle:
    """A value set by the test (None: unknown)."""

    name = "fake"

    def __init__(self, idle_s: float | None = None) -> None:
        self.idle_s = idle_s

    def idle_seconds(self) -> float | None:
        return self.idle_s


class _XScreenSaverInfo(ctypes.Structure):
    _fields_ = [
        ("window", ctypes.c_ulong),
        ("state", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("til_or_since", ctypes.c_ulong),
        ("idle", ctypes.c_ulong),  # milliseconds since the last input
        ("event_mask", ctypes.c_ulong),
    ]


# Xlib's default handlers end the process: on a protocol error, and when the
# connection breaks (the X server stops when the person logs out). The daemon must
# outlive its desktop, so errors are only logged, and a broken connection makes the
# idle time unknown (libX11 1.7's exit handler; older ones are not used).
_ERROR_HANDLER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_IO_ERROR_HANDLER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_EXIT_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


def _log_x_error(display: int | None, event: int | None) -> int:
    logger.debug("X11 error while reading the idle time (ignored)")
    return 0


def _log_x_io_error(display: int | None) -> int:
    return 0  # the exit handler (per display) says what it means


# referenced for as long as Xlib may call them: the life of the process
_ON_ERROR = _ERROR_HANDLER(_log_x_error)
_ON_IO_ERROR = _IO_ERROR_HANDLER(_log_x_io_error)


class X11Idle:
    """The X server's idle time (MIT-SCREEN-SAVER). ``open`` connects to ``display``
    and returns None when there is no X server, no libXss or no extension. Once the
    connection breaks (the X server stopped), the idle time is unknown."""

    name = "x11"

    def __init__(self, xlib: ctypes.CDLL, xss: ctypes.CDLL, display: int, info: int) -> None:
        self._xlib = xlib
        self._xss = xss
        self._display = display
        self._info = info
        self.broken = False

        def broke(display: int | None, data: int | None) -> None:
            logger.warning("the X server's connection broke: idle time unknown from now on")
            self.broken = True

        self._on_broken = _EXIT_HANDLER(broke)  # referenced while Xlib may call it
        xlib.XSetIOErrorExitHandler(display, self._on_broken, None)

    @classmethod
    def open(cls, display: str | None = None) -> X11Idle | None:
        display = display if display is not None else os.environ.get("DISPLAY")
        if not display:
            return None
        xlib = _load("X11")
        xss = _load("Xss")
        if xlib is None or xss is None or not hasattr(xlib, "XSetIOErrorExitHandler"):
            return None
        xlib.XSetErrorHandler.argtypes = [_ERROR_HANDLER]
        xlib.XSetErrorHandler.restype = ctypes.c_void_p
        xlib.XSetErrorHandler(_ON_ERROR)
        xlib.XSetIOErrorHandler.argtypes = [_IO_ERROR_HANDLER]
        xlib.XSetIOErrorHandler.restype = ctypes.c_void_p
        xlib.XSetIOErrorHandler(_ON_IO_ERROR)
        xlib.XSetIOErrorExitHandler.argtypes = [ctypes.c_void_p, _EXIT_HANDLER, ctypes.c_void_p]
        xlib.XSetIOErrorExitHandler.restype = None
        xlib.XOpenDisplay.restype = ctypes.c_void_p
        xlib.XOpenDisplay.argtypes = [ctypes.c_char_p]
        xlib.XDefaultRootWindow.restype = ctypes.c_ulong
        xlib.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        xlib.XCloseDisplay.argtypes = [ctypes.c_void_p]
        xss.XScreenSaverQueryExtension.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_int),
        ]
        xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(_XScreenSaverInfo)
        xss.XScreenSaverQueryInfo.argtypes = [
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.POINTER(_XScreenSaverInfo),
        ]
        handle = xlib.XOpenDisplay(display.encode())
        if not handle:
            return None
        event_base, error_base = ctypes.c_int(), ctypes.c_int()
        if not xss.XScreenSaverQueryExtension(
            handle, ctypes.byref(event_base), ctypes.byref(error_base)
        ):
            xlib.XCloseDisplay(handle)
            return None
        info = xss.XScreenSaverAllocInfo()
        if not info:
            xlib.XCloseDisplay(handle)
            return None
        return cls(xlib, xss, handle, ctypes.cast(info, ctypes.c_void_p).value or 0)

    def idle_seconds(self) -> float | None:
        if self.broken or not self._display:
            return None
        info = ctypes.cast(self._info, ctypes.POINTER(_XScreenSaverInfo))
        root = self._xlib.XDefaultRootWindow(self._display)
        if not self._xss.XScreenSaverQueryInfo(self._display, root, info) or self.broken:
            return None
        return float(info.contents.idle) / 1000.0

    def close(self) -> None:
        if self._display and not self.broken:
            self._xlib.XFree(ctypes.c_void_p(self._info))
            self._xlib.XCloseDisplay(self._display)
            self._display = 0


def _load(name: str) -> ctypes.CDLL | None:
    path = ctypes.util.find_library(name)
    for candidate in [path, f"lib{name}.so.1", f"lib{name}.so.6"]:
        if not candidate:
            continue
        try:
            return ctypes.CDLL(candidate)
        except OSError:
            continue
    return None


class LogindIdle:
    """systemd-logind's idle hint for this user: the graphical session's when there is
    one (``loginctl show-user -p Display``), else the user's (all sessions)."""

    name = "logind"

    def __init__(self, loginctl: str, uid: int, clock: Callable[[], float] = time.time) -> None:
        self._loginctl = loginctl
        self._uid = uid
        self._clock = clock

    @classmethod
    def open(cls) -> LogindIdle | None:
        loginctl = shutil.which("loginctl")
        if loginctl is None or not hasattr(os, "getuid"):
            return None
        source = cls(loginctl, os.getuid())
        return source if source.idle_seconds() is not None else None

    def idle_seconds(self) -> float | None:
        session = self._show(["show-user", str(self._uid), "-p", "Display", "--value"]).strip()
        what = ["show-session", session] if session else ["show-user", str(self._uid)]
        values = _properties(self._show([*what, "-p", "IdleHint", "-p", "IdleSinceHint"]))
        hint = values.get("IdleHint")
        if hint == "no":
            return 0.0
        if hint != "yes":
            return None
        try:
            since_us = int(values.get("IdleSinceHint", ""))
        except ValueError:
            return None
        # IdleSinceHint is wall-clock time (CLOCK_REALTIME) in microseconds
        return max(0.0, self._clock() - since_us / 1e6) if since_us > 0 else None

    def _show(self, args: list[str]) -> str:
        return _run([self._loginctl, "--no-pager", *args])


def _properties(text: str) -> dict[str, str]:
    pairs = (line.partition("=") for line in text.splitlines())
    return {key.strip(): value.strip() for key, sep, value in pairs if sep}


class MacIdle:
    """``HIDIdleTime`` of the IOHIDSystem registry entry (macOS)."""

    name = "macos"
    _PATTERN = re.compile(r'"HIDIdleTime"\s*=\s*(\d+)')

    @classmethod
    def open(cls) -> MacIdle | None:
        if sys.platform != "darwin" or shutil.which("ioreg") is None:
            return None
        source = cls()
        return source if source.idle_seconds() is not None else None

    def idle_seconds(self) -> float | None:
        found = self._PATTERN.search(_run(["ioreg", "-c", "IOHIDSystem", "-d", "4"]))
        return int(found.group(1)) / 1e9 if found else None


class WindowsIdle:
    """``GetLastInputInfo`` against the tick count (Windows; both wrap at 2^32 ms)."""

    name = "windows"

    class _LastInputInfo(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint32)]

    @classmethod
    def open(cls) -> WindowsIdle | None:
        if sys.platform != "win32":
            return None
        source = cls()
        return source if source.idle_seconds() is not None else None

    def idle_seconds(self) -> float | None:  # pragma: no cover - Windows
        windll = ctypes.windll  # type: ignore[attr-defined,unused-ignore]
        info = self._LastInputInfo()
        info.cbSize = ctypes.sizeof(info)
        if not windll.user32.GetLastInputInfo(ctypes.byref(info)):
            return None
        now_ms = windll.kernel32.GetTickCount() & 0xFFFFFFFF
        return ((now_ms - info.dwTime) & 0xFFFFFFFF) / 1000.0


def _run(command: list[str]) -> str:
    """The command's standard output; "" when it fails or takes too long."""
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_COMMAND_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def _wayland() -> bool:
    return (
        bool(os.environ.get("WAYLAND_DISPLAY")) or os.environ.get("XDG_SESSION_TYPE") == "wayland"
    )


def choose_idle_source() -> IdleSource:
    """The first source that answers here: X11 (not under Wayland), logind, macOS,
    Windows; ``NoIdle`` when none does. Probing may take a few seconds (call it in a
    worker thread)."""
    openers: list[Callable[[], IdleSource | None]] = [
        *([] if _wayland() else [X11Idle.open]),
        LogindIdle.open,
        MacIdle.open,
        WindowsIdle.open,
    ]
    for opener in openers:
        try:
            source = opener()
        except (OSError, AttributeError) as exc:  # a library that loads but misbehaves
            logger.debug("idle source %s failed: %s", opener, exc)
            continue
        if source is not None:
            logger.info("telling whether the computer is in use with %s", source.name)
            return source
    logger.info("no way to tell whether the computer is in use here: idle counts as unknown")
    return NoIdle()
