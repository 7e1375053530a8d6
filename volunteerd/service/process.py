"""The daemon as a process, seen from outside: wait until its control API answers, ask it
to stop (then SIGTERM it) and wait until it is gone; the same for the tray. Starting
either detached is ``volunteerd.detached``'s.

The daemon is found through its data folder only, so these work whoever started it: a
service manager, the tray, ``volunteerd service install`` or the user in a terminal.
Its control API is found as every client finds it (``control.json`` and
``api-token``). Whether it runs at all is the data folder's lock (``volunteerd.lock``,
held by the daemon and naming its pid): it is there with the control API off too, and
it cannot outlive its process, where a pid in a stale ``control.json`` may have been
reused by any program (a ``tail -f`` of the daemon's log has "volunteerd" in its
command line). Only the pid named by the held lock is ever sent a signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from volunteerd.control.client import ControlClient
from volunteerd.errors import (
    ControlError,
    DaemonNotAnswering,
    DaemonNotRunning,
    ResourceUnavailable,
)
from volunteerd.paths import LockHolder, Paths, lock_holder

__all__ = [
    "Answer",
    "probe",
    "stop_daemon",
    "stop_tray",
    "tray_pid",
    "wait_until_answering",
    "wait_until_running",
]

POLL_S = 0.25
REQUEST_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Answer:
    """What answers on a data folder's control address: ``url`` (``http://127.0.0.1:P``)
    and ``pid`` from ``control.json``; ``refused`` when something answers but refuses
    us (another token: not a daemon these commands may drive); ``busy`` when the
    recorded process runs but its API did not answer in time (a daemon at nice 10 on a
    loaded computer: it is there, and must not get a second one started beside it).
    ``unreachable`` when no control API is found but a daemon holds the data folder's
    lock (``control.enabled = false``, or still starting): ``url`` is "" and ``pid``
    the lock's."""

    url: str
    pid: int | None
    refused: str = ""
    busy: str = ""
    unreachable: bool = False


def probe(data_dir: Path) -> Answer | None:
    """The daemon answering for ``data_dir`` (or running there without answering in
    time: ``busy``; or holding its lock with no control API found: ``unreachable``),
    or None when none runs."""
    try:
        client = ControlClient.for_data_dir(data_dir, timeout_s=REQUEST_TIMEOUT_S)
    except DaemonNotRunning:
        return _locked(data_dir)
    except ControlError as exc:  # the token is unreadable
        return Answer("", None, refused=str(exc))
    try:
        client.health()
    except DaemonNotAnswering as exc:
        return Answer(client.endpoint.url, client.endpoint.pid, busy=str(exc))
    except DaemonNotRunning:  # a stale control.json: nothing listens at its address
        return _locked(data_dir)
    except ControlError as exc:
        return Answer(client.endpoint.url, client.endpoint.pid, refused=str(exc))
    return Answer(client.endpoint.url, client.endpoint.pid)


def wait_until_answering(
    data_dir: Path, timeout_s: float, alive: Callable[[], bool] | None = None
) -> Answer | None:
    """Poll the control API until it answers (the Answer) or ``timeout_s`` passes, or
    ``alive`` says the daemon has ended (None). A daemon that runs without answering in
    time (or holds its lock before its API is up) is waited for too; at the deadline
    its ``busy`` (``unreachable``) Answer is returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = probe(data_dir)
        if answer is not None and not answer.busy and not answer.unreachable:
            return answer
        if time.monotonic() >= deadline:
            return answer
        if alive is not None and not alive():
            return None
        time.sleep(POLL_S)


def wait_until_running(
    data_dir: Path,
    timeout_s: float,
    alive: Callable[[], bool] | None = None,
    settle_s: float = 5.0,
) -> Answer | None:
    """For a daemon started with its control API off: poll until it holds the data
    folder's lock (or answers) and still does ``settle_s`` later (the Answer), or
    ``timeout_s`` passes or ``alive`` says it has ended (None). The lock is its first
    step; ``settle_s`` covers what may still end it early (loading its experts, binding
    its port), so that a daemon that exits at once is not taken for a running one."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = probe(data_dir)
        if answer is not None:
            time.sleep(settle_s)
            if alive is None or alive():
                return probe(data_dir)
            return None
        if time.monotonic() >= deadline or (alive is not None and not alive()):
            return None
        time.sleep(POLL_S)


def stop_daemon(paths: Paths, timeout_s: float) -> str:
    """Stop the daemon of ``paths.data_dir``: ask it through the control API and wait up
    to ``timeout_s`` for it to be gone; else (no API: ``control.enabled = false``;
    busy; refusing us) SIGTERM the pid named by the data folder's lock, while the lock
    is held, and wait again. Returns what happened, in words. Raises
    ResourceUnavailable if it is still there."""
    answer = probe(paths.data_dir)
    if answer is None:
        paths.control_file.unlink(missing_ok=True)  # left by a daemon that was killed
        return "no daemon was running"
    pid = answer.pid
    if answer.url and not answer.refused and not answer.busy:
        try:
            ControlClient.for_data_dir(paths.data_dir, timeout_s=REQUEST_TIMEOUT_S).shutdown()
        except ControlError:
            pass
        else:
            if _wait_gone(paths, pid, timeout_s):
                return "stopped the daemon" + (f" (pid {pid})" if pid else "")
    holder = _settled_holder(paths)
    if holder is None:
        if answer.refused or answer.busy or answer.unreachable:
            # No volunteerd holds the folder: the control.json found is stale, and
            # whatever has its pid or port now is not ours to stop.
            paths.control_file.unlink(missing_ok=True)
            return "no daemon was running"
        raise ResourceUnavailable(f"something answers at {answer.url} and did not stop")
    if holder.pid is not None and _alive(holder.pid):
        os.kill(holder.pid, signal.SIGTERM)
        if _wait_gone(paths, holder.pid, timeout_s):
            return f"stopped the daemon (pid {holder.pid}) with SIGTERM"
        raise ResourceUnavailable(f"the daemon (pid {holder.pid}) did not stop; stop it by hand")
    shown = f"pid {holder.pid}" if holder.pid is not None else "its pid unknown"
    raise ResourceUnavailable(
        f"the volunteerd using {paths.data_dir} ({shown}) did not stop; stop it by hand"
    )


def tray_pid(paths: Paths) -> int | None:
    """The pid of the tray of ``paths.data_dir`` if it runs (named in ``tray.pid``, and
    its command line is volunteerd's tray: a stale pid may have been reused)."""
    pid = paths.read_tray_pid()
    if pid is None:
        return None
    if not (_alive(pid) and _is_volunteerd(pid) and "tray" in _command_line(pid).split()):
        paths.tray_pid_file.unlink(missing_ok=True)  # left by a tray that was killed
        return None
    return pid


def stop_tray(paths: Paths, timeout_s: float = 10.0) -> str | None:
    """Stop the tray of ``paths.data_dir`` (named in ``tray.pid``) with SIGTERM, if it
    runs; returns what happened, or None when no tray was running. Only a process whose
    command line is volunteerd's tray is signalled (a stale pid may have been reused)."""
    pid = tray_pid(paths)
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return f"the tray (pid {pid}) did not stop; it will be gone at logout"
        time.sleep(POLL_S)
    paths.tray_pid_file.unlink(missing_ok=True)
    return f"stopped the tray (pid {pid})"


def _locked(data_dir: Path) -> Answer | None:
    """An ``unreachable`` Answer when a daemon holds ``data_dir``'s lock, else None."""
    holder = lock_holder(data_dir / "volunteerd.lock")
    return None if holder is None else Answer("", holder.pid, unreachable=True)


def _settled_holder(paths: Paths) -> LockHolder | None:
    """The data folder's lock holder, its pid read twice ``POLL_S`` apart, the lock held
    both times: a daemon takes the lock a moment before it writes its pid over the last
    one's, which must not be signalled. Its pid is None if it did not settle in 2 s."""
    deadline = time.monotonic() + 2.0
    holder = lock_holder(paths.lock_file)
    while holder is not None:
        time.sleep(POLL_S)
        again = lock_holder(paths.lock_file)
        if again is None or (again == holder and again.pid is not None):
            return again
        if time.monotonic() >= deadline:
            return LockHolder(None)
        holder = again
    return None


def _wait_gone(paths: Paths, pid: int | None, timeout_s: float) -> bool:
    """Whether the daemon let go of the data folder's lock and its process ``pid`` has
    ended, within ``timeout_s``. A ``control.json`` it left (killed) is removed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if lock_holder(paths.lock_file) is None and (pid is None or not _alive(pid)):
            paths.control_file.unlink(missing_ok=True)
            return True
        time.sleep(POLL_S)
    return False


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, waiting for a parent that never reaps it in some
    containers, does not)."""
    if sys.platform == "win32":  # pragma: no cover - os.kill would terminate it there
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        # bytes: a name cut at 15 bytes inside a letter is no UTF-8 (a reused pid's)
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return stat.rsplit(b")", 1)[1].split()[0] != b"Z"
    return True


def _is_volunteerd(pid: int) -> bool:
    """Whether ``pid``'s command line names volunteerd: for the tray, which holds no
    lock (a pid in a stale ``tray.pid`` may have been reused by another program, which
    must not be signalled). Not for the daemon: a ``tail -f`` of its log passes this."""
    return "volunteerd" in _command_line(pid)


def _command_line(pid: int) -> str:
    """``pid``'s command line, words separated by spaces ("" if it cannot be read); a
    byte that is not UTF-8 (another program's Latin-1 argument) read as U+FFFD."""
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        return line.decode("utf-8", "replace")
    except OSError:
        try:
            return subprocess.run(
                ["ps", "-o", "command=", "-p", str(pid)],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=REQUEST_TIMEOUT_S,
                check=False,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
