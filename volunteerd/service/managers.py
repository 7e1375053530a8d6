"""The per-user service managers, driven through their command-line tools: systemd
(``systemctl --user``), launchd (``launchctl``) and Task Scheduler (``schtasks``).

Each manager knows where its files go (``locations``), whether it can be used here
(``usable``), how to take the installed files into account and start them
(``register``, ``start``), how to stop and forget them (``unregister``) and what it
says about them (``describe``). Every command runs with a timeout and its failure is
reported, never raised: the files are what install promises; a manager that is
missing or refuses is told to the user, who can still start volunteerd by hand.
"""

from __future__ import annotations

import locale
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from volunteerd.paths import Paths, xdg_home
from volunteerd.service.files import (
    DAEMON_LABEL,
    SYSTEMD_UNIT,
    TASK_FOLDER,
    TRAY_LABEL,
    Platform,
)

__all__ = ["Launchd", "Manager", "Outcome", "Systemd", "TaskScheduler", "manager_for"]

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 30.0  # one systemctl/launchctl/schtasks call


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one manager command did: ``ok``, and its words if it failed."""

    ok: bool
    output: str = ""


def output_encoding(platform: str = sys.platform) -> str:
    """How a manager's output is read. On Windows, ``schtasks`` writes to a pipe in the
    console's OEM code page (cp857 on a Turkish Windows, cp850 on a German one), not
    the ANSI one Python would pick; elsewhere the locale's encoding."""
    return "oem" if platform == "win32" else locale.getencoding()


def run(argv: Sequence[str]) -> Outcome:
    """Run a manager's command; a missing program or a timeout is a failed outcome.
    Its output is read as bytes and decoded with ``output_encoding``, bytes that do not
    fit it replaced: its words are only shown, never worth a traceback."""
    try:
        done = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Outcome(False, str(exc))
    encoding = output_encoding()
    output = (done.stdout + done.stderr).decode(encoding, errors="replace")
    output = output.replace("\r\n", "\n").strip()  # as text=True read Windows' lines
    logger.debug("%s -> %d %s", " ".join(argv), done.returncode, output)
    return Outcome(done.returncode == 0, output)


class Manager:
    """The interface; ``name`` is what the user reads ("systemd", "launchd", ...)."""

    name = "none"

    def locations(self, paths: Paths) -> dict[str, Path]:
        """Where each rendered file (by name) is installed."""
        raise NotImplementedError

    def usable(self) -> bool:
        """Whether the manager answers here (a user systemd may be missing in a
        container or an SSH session without a login)."""
        return True

    def register(self, files: Mapping[str, Path], *, changed: bool) -> Outcome:
        """Make the manager know the installed files, to start them at the next login."""
        return Outcome(True)

    def start(self, *, changed: bool, tray: bool) -> Outcome:
        """Start the daemon now (restart it if its file ``changed``), and the tray if the
        manager runs it."""
        return Outcome(True)

    def unregister(self, files: Mapping[str, Path]) -> Outcome:
        """Stop what the manager runs and forget it (before the files are removed)."""
        return Outcome(True)

    def after_removal(self) -> None:
        """Let the manager notice the files are gone."""

    def shared_folders(self) -> tuple[Path, ...]:
        """Folders that hold the installed files' folders and stay when those are
        removed (emptied by an uninstall, folders below them go too)."""
        return ()

    def describe(self) -> str:
        """One line on what the manager knows of the daemon."""
        return f"{self.name}: usable" if self.usable() else f"{self.name}: not available"


class Systemd(Manager):
    """A systemd user instance; ``XDG_CONFIG_HOME``/``XDG_DATA_HOME`` as the spec says."""

    name = "systemd"

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ
        self._usable: bool | None = None

    def locations(self, paths: Paths) -> dict[str, Path]:
        config_home = self._xdg("XDG_CONFIG_HOME", ".config")
        data_home = self._xdg("XDG_DATA_HOME", ".local/share")
        return {
            SYSTEMD_UNIT: config_home / "systemd" / "user" / SYSTEMD_UNIT,
            "volunteerd-tray.desktop": config_home / "autostart" / "volunteerd-tray.desktop",
            "volunteerd.svg": data_home / "icons/hicolor/scalable/apps/volunteerd.svg",
        }

    def enablement_link(self, paths: Paths) -> Path:
        """The link ``systemctl enable`` makes; removed by hand if systemd is gone."""
        unit = self.locations(paths)[SYSTEMD_UNIT]
        return unit.parent / "default.target.wants" / SYSTEMD_UNIT

    def usable(self) -> bool:
        if self._usable is None:
            self._usable = run(["systemctl", "--user", "show-environment"]).ok
        return self._usable

    def register(self, files: Mapping[str, Path], *, changed: bool) -> Outcome:
        if not self.usable():
            return Outcome(True)
        reload = run(["systemctl", "--user", "daemon-reload"])
        if not reload.ok:
            return reload
        return run(["systemctl", "--user", "enable", SYSTEMD_UNIT])

    def start(self, *, changed: bool, tray: bool) -> Outcome:
        verb = "restart" if changed else "start"
        return run(["systemctl", "--user", verb, SYSTEMD_UNIT])

    def state(self) -> str:
        """``systemctl --user is-active``: active, activating, failed, inactive, ..."""
        out = run(["systemctl", "--user", "is-active", SYSTEMD_UNIT]).output
        return out.splitlines()[-1] if out else "unknown"

    def unregister(self, files: Mapping[str, Path]) -> Outcome:
        if not self.usable():
            return Outcome(True)
        return run(["systemctl", "--user", "disable", "--now", SYSTEMD_UNIT])

    def after_removal(self) -> None:
        if self.usable():
            run(["systemctl", "--user", "daemon-reload"])
            run(["systemctl", "--user", "reset-failed", SYSTEMD_UNIT])

    def describe(self) -> str:
        if not self.usable():
            return "systemd: no user instance here (the tray's autostart entry starts the daemon)"
        enabled = run(["systemctl", "--user", "is-enabled", SYSTEMD_UNIT]).output or "unknown"
        return f"systemd: {SYSTEMD_UNIT} {enabled.splitlines()[-1]}, {self.state()}"

    def shared_folders(self) -> tuple[Path, ...]:
        return self._xdg("XDG_CONFIG_HOME", ".config"), self._xdg("XDG_DATA_HOME", ".local/share")

    def _xdg(self, name: str, default: str) -> Path:
        # the rule Paths.resolve follows for the data folder: the icon lands beside it
        return xdg_home(name, default, self._environ)


class Launchd(Manager):
    """The user's launchd domain ``gui/<uid>``."""

    name = "launchd"

    def locations(self, paths: Paths) -> dict[str, Path]:
        agents = Path.home() / "Library" / "LaunchAgents"
        return {f"{label}.plist": agents / f"{label}.plist" for label in (DAEMON_LABEL, TRAY_LABEL)}

    def register(self, files: Mapping[str, Path], *, changed: bool) -> Outcome:
        return Outcome(True)  # launchd reads ~/Library/LaunchAgents at each login

    def start(self, *, changed: bool, tray: bool) -> Outcome:
        outcome = Outcome(True)
        labels = [DAEMON_LABEL, TRAY_LABEL] if tray else [DAEMON_LABEL]
        agents = Path.home() / "Library" / "LaunchAgents"
        for label in labels:
            loaded = self._loaded(label)
            if loaded and not changed:
                continue  # running (RunAtLoad, KeepAlive) with the same file
            if loaded:
                run(["launchctl", "bootout", f"{self._domain}/{label}"])
            run(["launchctl", "enable", f"{self._domain}/{label}"])
            done = run(["launchctl", "bootstrap", self._domain, str(agents / f"{label}.plist")])
            if not done.ok:
                outcome = done
        return outcome

    def unregister(self, files: Mapping[str, Path]) -> Outcome:
        for label in (TRAY_LABEL, DAEMON_LABEL):
            if self._loaded(label):
                run(["launchctl", "bootout", f"{self._domain}/{label}"])
        return Outcome(True)

    def describe(self) -> str:
        return "launchd: " + ", ".join(
            f"{label} {'loaded' if self._loaded(label) else 'not loaded'}"
            for label in (DAEMON_LABEL, TRAY_LABEL)
        )

    @property
    def _domain(self) -> str:
        return f"gui/{os.getuid()}"

    def _loaded(self, label: str) -> bool:
        return run(["launchctl", "print", f"{self._domain}/{label}"]).ok


class TaskScheduler(Manager):
    """Task Scheduler: the files are kept in the data folder and registered as the
    tasks ``volunteerd\\daemon`` and ``volunteerd\\tray``."""

    name = "Task Scheduler"
    TASKS = {"volunteerd-daemon.xml": "daemon", "volunteerd-tray.xml": "tray"}

    def locations(self, paths: Paths) -> dict[str, Path]:
        return {name: paths.data_dir / "service" / name for name in self.TASKS}

    def register(self, files: Mapping[str, Path], *, changed: bool) -> Outcome:
        outcome = Outcome(True)
        for name, path in files.items():
            task = self._task(name)
            if not changed and self._registered(name):
                continue
            done = run(["schtasks", "/Create", "/XML", str(path), "/TN", task, "/F"])
            if not done.ok:
                outcome = done
        return outcome

    def start(self, *, changed: bool, tray: bool) -> Outcome:
        outcome = run(["schtasks", "/Run", "/TN", self._task("volunteerd-daemon.xml")])
        if tray and outcome.ok:
            outcome = run(["schtasks", "/Run", "/TN", self._task("volunteerd-tray.xml")])
        return outcome

    def unregister(self, files: Mapping[str, Path]) -> Outcome:
        for name in self.TASKS:
            task = self._task(name)
            if self._registered(name):
                run(["schtasks", "/End", "/TN", task])
                run(["schtasks", "/Delete", "/TN", task, "/F"])
        return Outcome(True)

    def describe(self) -> str:
        known = {name: self._registered(name) for name in self.TASKS}
        return "Task Scheduler: " + ", ".join(
            f"{self._task(name)} {'registered' if ok else 'absent'}" for name, ok in known.items()
        )

    def _registered(self, name: str) -> bool:
        return run(["schtasks", "/Query", "/TN", self._task(name)]).ok

    def _task(self, name: str) -> str:
        return f"{TASK_FOLDER}\\{self.TASKS[name]}"


def manager_for(platform: Platform) -> Manager:
    if platform == "linux":
        return Systemd()
    if platform == "macos":
        return Launchd()
    return TaskScheduler()
