"""The tray app: a pystray icon that shows the daemon's state and drives it through the
control API (``volunteerd.control.client``), in its own process.

Three threads, so the UI never waits for the daemon:

* pystray's loop (the main thread: macOS needs it) shows the icon and the menu; a click
  only queues the item's action;
* the poll thread asks for ``/status`` (and ``/schedule``, for "Compute only when
  idle") every ``poll_s`` (sooner right after an action), backs off up to
  ``max_backoff_s`` while nothing answers, and re-renders the icon, tooltip and menu
  from ``menu.view`` when what it sees changes;
* the worker thread runs the queued actions one at a time (client calls, opening the
  dashboard, starting the daemon, quitting).

If no daemon answers when the tray starts (and ``start_daemon``), and none holds the
data folder's lock (one starting, or restarting in place after a join), it starts
``volunteerd serve`` detached (``volunteerd.detached``: its own session, output in
``<data dir>/daemon.log``) with the tray's file locations and its environment less the
``VOLUNTEERD_<SECTION>__<KEY>`` settings, as a service manager would; the daemon outlives
the tray. If the daemon goes away later, the icon says "not connected" and recovers
when it is back.

One tray per data folder: ``run_tray`` names its process in ``<data dir>/tray.pid``,
holding that file's lock while it runs, and does not start while the file names another
tray that runs (``run_tray``'s ``showing``) or another tray holds the lock (one started
at the same moment).

Backends: pystray picks one (AppIndicator or GTK where PyGObject is installed, else
plain X through python-xlib); ``backend`` or ``PYSTRAY_BACKEND`` chooses. The plain X
backend shows no menu: a click runs the default item, "Open dashboard" (or "Start
volunteerd" while none runs), and the dashboard has every control.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import webbrowser
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from volunteerd.control.client import ControlClient
from volunteerd.detached import start_detached
from volunteerd.errors import (
    ControlError,
    DaemonNotAnswering,
    DaemonNotRunning,
    ExitCode,
    ResourceUnavailable,
)
from volunteerd.paths import ENV_CACHE_DIR, ENV_CONFIG, ENV_DATA_DIR, Paths, lock_holder
from volunteerd.tray import menu
from volunteerd.tray.icons import icon_image
from volunteerd.tray.menu import Action, Item, Seen, View

__all__ = ["BACKENDS", "TrayApp", "pystray_items", "run_tray"]

logger = logging.getLogger(__name__)

BACKENDS = ("appindicator", "gtk", "xorg", "darwin", "win32", "dummy")

POLL_S = 2.0  # between status requests while the daemon answers
STARTING_POLL_S = 0.5  # while a daemon the tray started comes up
MAX_BACKOFF_S = 8.0  # between tries while nothing answers
REQUEST_TIMEOUT_S = 5.0  # one control API call
NOTICE_S = 30.0  # how long a failed action stays in the menu
STOP_TIMEOUT_S = 10.0  # for pystray's loop to end
START_TIMEOUT_S = 180.0  # a started daemon that has not answered by then is "not running"
FLUSH_S = 0.25  # how often the X connection is flushed (see ``_flush_loop``)


class TrayApp:
    """The tray of the daemon that uses ``paths.data_dir``. ``run`` shows it until Quit.

    ``open_url`` opens the dashboard (``webbrowser.open``; tests pass their own);
    ``serve_command`` starts the daemon (``python -m volunteerd serve``; a frozen build
    passes its own executable)."""

    def __init__(
        self,
        paths: Paths,
        *,
        start_daemon: bool = True,
        backend: str | None = None,
        poll_s: float = POLL_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        open_url: Callable[[str], object] = webbrowser.open,
        serve_command: Sequence[str] | None = None,
    ) -> None:
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"unknown pystray backend {backend!r}; one of {', '.join(BACKENDS)}")
        self.paths = paths
        self.start_daemon = start_daemon
        self.backend = backend
        self.poll_s = poll_s
        self.max_backoff_s = max_backoff_s
        self.open_url = open_url
        # A frozen build (packaging/pyinstaller) is the volunteerd command itself.
        frozen = getattr(sys, "frozen", False)
        own = [sys.executable] if frozen else [sys.executable, "-m", "volunteerd"]
        self.serve_command = list(serve_command or [*own, "serve"])
        self.icon: Any = None  # the pystray Icon, while ``run`` runs
        self._seen = Seen("absent")
        self._view = menu.view(self._seen)
        self._notice = ("", 0.0)  # message, until (monotonic)
        self._child: subprocess.Popen[bytes] | None = None  # the daemon the tray started
        self._child_started = 0.0  # monotonic
        self._child_answered = False
        self._lock = threading.Lock()  # guards the fields above
        self._start_lock = threading.Lock()  # one start at a time
        self._ui_lock = threading.Lock()  # one icon update at a time, none after stopping
        self._stopping = threading.Event()
        self._loop_done = threading.Event()  # pystray's loop has returned
        self._wake = threading.Event()
        self._jobs: queue.Queue[Action | None] = queue.Queue()
        self._exit_code = ExitCode.OK
        self._latin1_titles = False
        self._drawn_state: menu.IconState | None = None  # the image the icon shows
        self._menu_shown: View | None = None  # the view the menu was last built from

    # -- what the tray shows --------------------------------------------------------------

    @property
    def seen(self) -> Seen:
        with self._lock:
            return self._seen

    @property
    def view(self) -> View:
        """What the icon and the menu show now."""
        with self._lock:
            return self._view

    # -- life -----------------------------------------------------------------------------

    def run(self) -> int:
        """Show the icon until Quit (or ``stop``); returns the exit status. Blocks: call
        it from the main thread (macOS needs that; elsewhere any thread will do).
        Raises ResourceUnavailable when no icon can be shown (e.g. no display)."""
        first = self.view
        try:
            icon_class, pystray_menu = _load_pystray(self.backend)
            self._latin1_titles = _backend_of(icon_class) == "xorg"
            self._drawn_state = first.state
            self._menu_shown = first
            self.icon = icon_class(
                "volunteerd",
                icon=icon_image(first.state),
                title=self._title(first),
                menu=pystray_menu.Menu(
                    lambda: pystray_items(pystray_menu, self.view.items, self.submit)
                ),
            )
        except Exception as exc:  # pystray raises whatever its backend's library raises
            hint = ""
            if sys.platform.startswith("linux") and not os.environ.get("DISPLAY"):
                hint = "; the tray needs a desktop session (DISPLAY is not set)"
            raise ResourceUnavailable(
                f"cannot show a tray icon ({type(exc).__name__}: {exc}){hint}"
            ) from exc
        pollers = [
            threading.Thread(target=self._poll_loop, name="tray-poll", daemon=True),
            threading.Thread(target=self._work_loop, name="tray-work", daemon=True),
        ]
        threads = list(pollers)
        flusher = None
        if getattr(self.icon, "_display", None) is not None:  # pystray's X backend
            flusher = threading.Thread(target=self._flush_loop, name="tray-flush", daemon=True)

        def setup(icon: Any) -> None:
            if self._stopping.is_set():  # stopped before the loop started
                icon.stop()
                return
            try:
                # Two requests that pystray's loop runs while this thread waits (the
                # image, then showing it): the flush thread sends them if python-xlib
                # left them unsent.
                icon.visible = True
            except Exception:  # whatever the backend raises: the next poll tries again
                logger.exception("could not show the tray icon")
            for thread in pollers:
                thread.start()

        logger.info("tray started (pystray's %s backend)", _backend_of(type(self.icon)))
        if flusher is not None:  # from before pystray's loop: setup waits on it too
            threads.append(flusher)
            flusher.start()
        try:
            self.icon.run(setup)
        finally:
            self._loop_done.set()
            self._stopping.set()
            self._wake.set()
            self._jobs.put(None)
            for thread in threads:
                if thread.is_alive():
                    thread.join(REQUEST_TIMEOUT_S + 1)
        return int(self._exit_code)

    def stop(self, exit_code: ExitCode = ExitCode.OK) -> None:
        """End ``run`` (from any thread but pystray's own callbacks)."""
        with self._ui_lock:
            if self._stopping.is_set():
                return
            self._exit_code = exit_code
            self._stopping.set()
        self._wake.set()
        self._jobs.put(None)
        if self.icon is not None:
            self.icon.stop()
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while not self._loop_done.wait(0.1) and time.monotonic() < deadline:
                self._flush_x()

    def submit(self, action: Action) -> None:
        """Queue ``action`` for the worker thread (what a menu click does)."""
        self._jobs.put(action)

    # -- the poll thread ------------------------------------------------------------------

    def _poll_loop(self) -> None:
        if self.start_daemon:
            try:
                self._start_if_absent()
            except Exception as exc:  # e.g. no such executable: say so, keep polling
                logger.exception("could not start volunteerd")
                self._set_notice(f"Could not start volunteerd: {exc}")
        delay = self.poll_s
        while not self._stopping.is_set():
            try:
                seen = self._poll()
            except Exception as exc:  # a bug; the tray keeps going and says so
                logger.exception("could not ask volunteerd for its status")
                seen = Seen("error", error=f"{type(exc).__name__}: {exc}")
            self._show(seen)
            if seen.link == "connected":
                delay = self.poll_s
            elif seen.link == "starting":
                delay = STARTING_POLL_S
            elif seen.link == "locked":  # back in seconds (a restart), or never (API off)
                delay = self.poll_s
            else:
                delay = min(delay * 2, self.max_backoff_s)
            self._wake.wait(delay)
            self._wake.clear()

    def _poll(self) -> Seen:
        notice = self._current_notice()
        try:
            client = self._client()
            status = client.status()
        except DaemonNotAnswering:  # its process runs: busy, not gone
            return Seen("busy", notice=notice)
        except DaemonNotRunning:
            return self._not_answering(notice)
        except ControlError as exc:
            return Seen("error", error=str(exc), notice=notice)
        with self._lock:
            self._child_answered = True  # from now on, "gone away" rather than "failed"
        try:
            run: str | None = client.schedule().run
        except ControlError:  # an older daemon (404), or gone since: no check item
            run = None
        return Seen("connected", status=status, notice=notice, schedule_run=run)

    def _not_answering(self, notice: str) -> Seen:
        with self._lock:
            child, started, answered = self._child, self._child_started, self._child_answered
        code = None if child is None else child.poll()  # also reaps it once it exits
        if child is not None and not answered:
            if code is not None:
                log = self.paths.daemon_log_file
                last = _last_line(log)
                error = f"volunteerd exited ({code})" + (f": {last}" if last else f"; see {log}")
                return Seen("failed", error=error, notice=notice)
            if time.monotonic() - started < START_TIMEOUT_S:
                return Seen("starting", notice=notice)
        # Restarting in place (a join or leave): no control.json until it is back, the
        # lock held throughout. "Not running" and "Start volunteerd" then started a
        # second daemon, which could only be refused.
        holder = lock_holder(self.paths.lock_file)
        if holder is not None:
            return Seen("locked", notice=notice, pid=holder.pid)
        return Seen("absent", notice=notice)

    def _show(self, seen: Seen) -> None:
        """Make ``seen`` the model (the menu pystray builds reads it) and show it: the
        image, the tooltip and the menu, each on its own, so that one the backend refuses
        keeps none of the others from changing (a tooltip Windows found too long kept the
        paused menu, Resume and all, beside a running daemon). What was not shown is
        tried again at the next poll."""
        new = menu.view(seen)
        with self._lock:
            old, self._seen, self._view = self._view, seen, new
        if new.state != old.state or new.status_line != old.status_line:
            logger.info("tray: %s", new.status_line)
        with self._ui_lock:
            if self._stopping.is_set() or self.icon is None:
                return
            try:
                for part, show in (
                    ("image", self._show_image),
                    ("tooltip", self._show_title),
                    ("menu", self._show_menu),
                ):
                    try:
                        show(new)
                    except Exception:  # whatever the backend raises: keep polling
                        logger.exception("could not update the tray icon's %s", part)
            finally:
                self._flush_x()

    def _show_image(self, new: View) -> None:
        if not self.icon.visible:  # showing it failed at the start
            self.icon.visible = True
        if new.state != self._drawn_state:
            self._drawn_state = None  # until it is drawn: the next poll retries
            self.icon.icon = icon_image(new.state)
            self._drawn_state = new.state

    def _show_title(self, new: View) -> None:
        self.icon.title = self._title(new)

    def _show_menu(self, new: View) -> None:
        if new != self._menu_shown:
            self._menu_shown = None  # until it is rebuilt: the next poll retries
            self.icon.update_menu()
            self._menu_shown = new

    # -- the worker thread ----------------------------------------------------------------

    def _work_loop(self) -> None:
        while True:
            action = self._jobs.get()
            if action is None or self._stopping.is_set():
                return
            try:
                self._do(action)
            except (ControlError, OSError) as exc:
                logger.warning("could not %s: %s", menu.describe(action), exc)
                self._set_notice(f"Could not {menu.describe(action)}: {exc}")
            except Exception:
                logger.exception("the tray action %s failed", action)
                self._set_notice(f"Could not {menu.describe(action)} (see the log)")
            self._wake.set()

    def _do(self, action: Action) -> None:
        logger.info("tray: %s", menu.describe(action))
        if action.name == "quit":
            self.stop()
        elif action.name == "dashboard":
            self.open_url(self._client().dashboard_url)
        elif action.name == "join":
            # the page reads "join" in the fragment (beside the token) and opens its field
            self.open_url(self._client().dashboard_url + "&join")
        elif action.name == "start":
            self._start_if_absent()
        elif action.name == "quit_and_stop":
            menu.perform(self._client(), action)
            self.stop()
        else:
            menu.perform(self._client(), action)

    def _set_notice(self, message: str) -> None:
        with self._lock:
            self._notice = (message, time.monotonic() + NOTICE_S)

    def _current_notice(self) -> str:
        with self._lock:
            message, until = self._notice
        return message if time.monotonic() < until else ""

    # -- the daemon -------------------------------------------------------------------------

    def _client(self) -> ControlClient:
        # Read the address each time: a restarted daemon listens on a new port.
        return ControlClient.for_data_dir(self.paths.data_dir, timeout_s=REQUEST_TIMEOUT_S)

    def _start_if_absent(self) -> None:
        """Start ``volunteerd serve`` unless a daemon answers or one we started runs."""
        with self._start_lock:
            self._start_unlocked()

    def _start_unlocked(self) -> None:
        try:
            self._client().health()
            return
        except DaemonNotAnswering:
            return  # it runs, busy: another would only find its data folder locked
        except DaemonNotRunning:
            pass
        except ControlError:
            return  # something answers: not ours to replace
        holder = lock_holder(self.paths.lock_file)
        if holder is not None:  # starting or restarting: another would only be refused
            logger.info("volunteerd (pid %s) is starting: not starting another", holder.pid)
            return
        with self._lock:
            if self._child is not None and self._child.poll() is None:
                return
        log = self.paths.daemon_log_file
        # The tray's file locations, not only its environment's: a tray started with
        # --config or --data-dir drives the daemon of those (absolute: the daemon starts
        # in the home folder).
        locations = {
            ENV_CONFIG: str(self.paths.config_file.absolute()),
            ENV_DATA_DIR: str(self.paths.data_dir.absolute()),
            ENV_CACHE_DIR: str(self.paths.cache_dir.absolute()),
        }
        child = start_detached(self.serve_command, log, locations)
        logger.info("started volunteerd (pid %d); its output goes to %s", child.pid, log)
        with self._lock:
            self._child, self._child_started, self._child_answered = child, time.monotonic(), False

    # -- pystray --------------------------------------------------------------------------

    def _flush_x(self) -> None:
        """Send what pystray's X backend queued but did not send.

        That backend calls python-xlib from several threads on one connection, and
        python-xlib's flush returns at once while another thread is sending; a request
        queued then waits for the next X event. For the last request of all, the
        DestroyWindow that ends pystray's loop, no event ever comes."""
        display = getattr(self.icon, "_display", None)
        if display is not None:
            with contextlib.suppress(Exception):  # closed, or the server went away
                display.flush()

    def _flush_loop(self) -> None:
        """Flush the X connection every ``FLUSH_S`` until pystray's loop has ended.

        pystray's X backend runs an update asked for from another thread (the icon, the
        title) by sending its own window a message and waiting until its loop has done
        it. python-xlib can leave that message unsent (its flush returns at once while
        another thread sends, and that thread may stop before it), and the loop waits
        for X events that never come: the updating thread then waited forever, and the
        icon kept its first title ("volunteerd is not running") beside a daemon that
        ran. Showing the icon at the start (pystray's setup thread) and stopping the
        loop wait the same way, so this runs from before pystray's loop until after it.
        Whatever is left unsent goes out at the next flush here."""
        while not self._loop_done.wait(FLUSH_S):
            self._flush_x()

    def _title(self, shown: View) -> str:
        """The tooltip, at most ``menu.MAX_TITLE`` characters whatever the backend (the
        Windows one raises on more)."""
        title = shown.title
        # pystray's X backend sets the title as a Latin-1 window name
        if self._latin1_titles:
            plain = title.translate(_LATIN1)
            title = plain.encode("latin-1", errors="replace").decode("latin-1")
        return title[: menu.MAX_TITLE]


def pystray_items(
    pystray: Any, items: tuple[Item, ...], submit: Callable[[Action], None]
) -> list[Any]:
    """``items`` as pystray MenuItems of the ``pystray`` module; a click on an enabled
    item calls ``submit`` with its action (and nothing else, so the UI never waits).
    The tray builds them anew each time pystray asks for its menu."""
    out: list[Any] = []
    for item in items:
        if item.separator:
            out.append(pystray.Menu.SEPARATOR)
            continue
        target: Any = None
        if item.submenu:
            target = pystray.Menu(*pystray_items(pystray, item.submenu, submit))
        elif item.action is not None:
            target = _on_click(item, submit)
        out.append(
            pystray.MenuItem(
                item.text,
                target,
                checked=None if item.checked is None else _constant(item.checked),
                radio=item.radio,
                default=item.default,
                enabled=item.enabled,
            )
        )
    return out


def _on_click(item: Item, submit: Callable[[Action], None]) -> Callable[[Any, Any], None]:
    def clicked(icon: Any, menu_item: Any) -> None:
        # pystray runs a click on the icon (the default item) even when it is disabled
        if item.enabled and item.action is not None:
            submit(item.action)

    return clicked


def run_tray(
    paths: Paths,
    *,
    start_daemon: bool = True,
    backend: str | None = None,
    showing: Callable[[Paths], int | None] | None = None,
) -> int:
    """``volunteerd tray``: show the tray until Quit, SIGINT or SIGTERM; the exit status
    (0 after Quit, 130 after a signal). Starts the daemon if none answers and
    ``start_daemon``. Raises ResourceUnavailable when no icon can be shown.

    One tray per data folder: where ``showing`` (``service.process.tray_pid``, which
    the command line passes: the tray itself looks at no other process) finds a tray
    of the folder that runs (a volunteerd tray's process, not a stale pid reused by
    another program), it says so and returns 0. A second one showed a second icon, and
    took ``tray.pid`` over: ``volunteerd service uninstall`` stopped only that one."""
    running = None if showing is None else showing(paths)
    if running is not None and running != os.getpid():
        print(f"the tray icon of {paths.data_dir} is showing already (pid {running})")
        return ExitCode.OK
    with _named_in_tray_pid(paths) as named:
        if not named:  # another tray took tray.pid's lock since the check above
            running = paths.read_tray_pid()
            shown = f"pid {running}" if running is not None else "starting"
            print(f"the tray icon of {paths.data_dir} is showing already ({shown})")
            return ExitCode.OK
        app = TrayApp(paths, start_daemon=start_daemon, backend=backend)
        with _stopping_on_signals(app):
            return app.run()


@contextlib.contextmanager
def _named_in_tray_pid(paths: Paths) -> Iterator[bool]:
    """Name this process in ``paths.tray_pid_file``, holding its lock, while the tray
    runs, so that ``volunteerd service uninstall`` (and an upgrade) can stop it; yields
    False when another tray holds it (two started at the same moment both passed the
    check of the pid: both showed an icon). A file that cannot be written is logged,
    and the tray runs unnamed."""
    pid = os.getpid()
    try:
        held = paths.hold_tray_pid(pid)
    except OSError as exc:
        logger.warning("cannot write %s: %s", paths.tray_pid_file, exc)
        yield True
        return
    if held is None:
        yield False
        return
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            paths.remove_tray_pid(pid)  # while still locked: a newcomer's file is new
        os.close(held)


@contextlib.contextmanager
def _stopping_on_signals(app: TrayApp) -> Iterator[None]:
    """Stop ``app`` on SIGINT or SIGTERM.

    Python runs signal handlers in the main thread, between bytecodes; pystray's loop
    may sit in a blocking X read there for as long as no X event comes. So the C-level
    handler's wakeup byte (``signal.set_wakeup_fd``) wakes a watcher thread instead,
    which stops the app; the Python-level handlers do nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; the caller handles signals
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    done = threading.Event()

    def watch() -> None:
        with contextlib.suppress(OSError):
            reader.recv(1)
        if not done.is_set():
            app.stop(ExitCode.INTERRUPTED)

    old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    old_handlers = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    watcher = threading.Thread(target=watch, name="tray-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(old_fd)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        with contextlib.suppress(OSError):
            writer.send(b"\0")
        watcher.join(1)
        reader.close()
        writer.close()


def _ignore(signum: int, frame: object) -> None:
    pass


def _load_pystray(backend: str | None) -> tuple[type[Any], Any]:
    """pystray's Icon class for ``backend`` (None: pystray's choice) and the module with
    Menu and MenuItem. Raises what the backend's library raises: importing the plain X
    backend already connects to the display."""
    if backend is not None and "pystray" not in sys.modules:
        # pystray picks its backend on import: let it pick this one (the import of
        # another might fail, e.g. GTK's without PyGObject).
        os.environ["PYSTRAY_BACKEND"] = backend
    import pystray

    icon_class = pystray.Icon
    if backend is not None:
        icon_class = importlib.import_module(f"pystray._{backend}").Icon
    if icon_class.__module__ == "pystray._xorg":
        icon_class = _docking_once(icon_class)
    return icon_class, pystray


def _backend_of(icon_class: type[Any]) -> str:
    for cls in icon_class.__mro__:
        if cls.__module__.startswith("pystray._"):
            return cls.__module__.removeprefix("pystray._")
    return icon_class.__module__


def _docking_once(base: type[Any]) -> type[Any]:
    class XorgIcon(base):  # type: ignore[misc,valid-type]
        """pystray's plain X icon, asking the tray to dock it only while it is not
        docked. pystray asks again with every new image, and the tray then embeds the
        icon anew (it flickers, and may move). A tray that goes away still makes
        pystray look for the next one."""

        said_no_tray = False

        def _assert_docked(self) -> None:
            if self._systray_manager is None:
                try:
                    super()._assert_docked()
                except AssertionError:
                    # No tray on this desktop (yet): pystray logs "Failed to dock icon"
                    # with a traceback at every try (its logger is tamed, volunteerd.logs)
                    # and docks once a tray starts. Said once, in our words.
                    if not self.said_no_tray:
                        self.said_no_tray = True
                        logger.warning(
                            "no system tray (notification area) on this desktop: the icon "
                            "shows once one starts; `volunteerd dashboard` has every control"
                        )
                    raise

    return XorgIcon


_LATIN1 = str.maketrans({"\u2014": "-", "\u2013": "-", "\u2026": "...", "\u2019": "'"})


def _constant(value: bool) -> Callable[[Any], bool]:
    return lambda _item: value


def _last_line(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""
