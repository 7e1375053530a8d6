"""The autostart files of each platform, rendered from one ``Launch``. Pure: no I/O
except reading the icon shipped with the package.

=========  ===========================  =======================================
platform   file (``render`` name)       what it is
=========  ===========================  =======================================
linux      ``volunteerd.service``       systemd user unit running ``serve``
linux      ``volunteerd-tray.desktop``  XDG autostart entry running ``tray``
linux      ``volunteerd.svg``           the entry's icon (hicolor, scalable)
macos      ``org.volunteerd.daemon.plist``  LaunchAgent running ``serve``
macos      ``org.volunteerd.tray.plist``    LaunchAgent running ``tray``
windows    ``volunteerd-daemon.xml``    Task Scheduler task running ``serve`` at logon
windows    ``volunteerd-tray.xml``      Task Scheduler task running ``tray`` at logon
=========  ===========================  =======================================

The daemon's units rely on the exit-code contract of ``errors.ExitCode``: 3 (invalid
configuration) is never restarted, 130 (stopped by a signal) is a clean stop, anything
else non-zero is a failure to restart after a pause.
Every file says at its top that volunteerd wrote it, and the same ``Launch`` always
gives the same bytes, so installing twice changes nothing.
"""

from __future__ import annotations

import math
import os
import plistlib
import subprocess
import unicodedata
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PureWindowsPath
from typing import Literal
from xml.sax.saxutils import escape

from volunteerd.config import TimeoutsConfig
from volunteerd.detached import IO_LEVEL, LOG_FILE_VARIABLE, NICE
from volunteerd.paths import ENV_CACHE_DIR, ENV_CONFIG, ENV_DATA_DIR

__all__ = [
    "DAEMON_LABEL",
    "DEFAULT_STOP_TIMEOUT_S",
    "PLACEHOLDER_USER",
    "PLATFORMS",
    "SYSTEMD_UNIT",
    "TASK_FOLDER",
    "TRAY_LABEL",
    "Launch",
    "Platform",
    "Rendered",
    "Role",
    "icon_svg",
    "render",
    "stop_timeout_s",
]

Platform = Literal["linux", "macos", "windows"]
Role = Literal["daemon", "tray", "icon"]
PLATFORMS: tuple[Platform, ...] = ("linux", "macos", "windows")

SYSTEMD_UNIT = "volunteerd.service"
DAEMON_LABEL = "org.volunteerd.daemon"
TRAY_LABEL = "org.volunteerd.tray"
TASK_FOLDER = "volunteerd"  # the Task Scheduler folder: volunteerd\daemon, volunteerd\tray
TASK_NAMESPACE = "http://schemas.microsoft.com/windows/2004/02/mit/task"

# After the stop signal the daemon withdraws its DHT records (at most shutdown_grace_s),
# drains queued work (at most shutdown_grace_s again), saves changed experts and closes
# its connections: the margin covers the last two.
STOP_MARGIN_S = 20
RESTART_DELAY_S = 10


def stop_timeout_s(timeouts: TimeoutsConfig) -> int:
    """How long a service manager waits after SIGTERM before it kills the daemon."""
    return math.ceil(2 * timeouts.shutdown_grace_s) + STOP_MARGIN_S


DEFAULT_STOP_TIMEOUT_S = stop_timeout_s(TimeoutsConfig())
# What `volunteerd service render` writes where an install writes the user's own.
PLACEHOLDER_USER = "DOMAIN\\USERNAME"
PLACEHOLDER_LOG_DIR = Path("/Users/USERNAME/Library/Logs/volunteerd")


@dataclass(frozen=True, slots=True)
class Launch:
    """How the service managers start volunteerd, and with which settings.

    ``argv`` runs the ``volunteerd`` command: ``(python, "-m", "volunteerd")``, or a
    frozen build's executable alone. ``config_file``, ``data_dir`` and ``cache_dir``
    are kept only when they were chosen explicitly at install time (else the daemon
    finds its per-user defaults itself). ``tray_starts_daemon``: no service manager runs
    the daemon (Linux without a user systemd), so the tray's autostart starts it.
    ``user`` is the Windows account (``DOMAIN\\name``) the tasks run as; ``log_dir``
    where launchd writes the agents' output (``~/Library/Logs/volunteerd``).
    ``low_priority``: the daemon runs at nice 10 and a low I/O priority, what it also
    does to itself (``runtime.priority``, ``volunteerd.detached``)."""

    argv: tuple[str, ...]
    stop_timeout_s: int = DEFAULT_STOP_TIMEOUT_S
    config_file: Path | None = None
    data_dir: Path | None = None
    cache_dir: Path | None = None
    tray_starts_daemon: bool = False
    user: str = PLACEHOLDER_USER
    log_dir: Path = PLACEHOLDER_LOG_DIR
    low_priority: bool = True

    def unwritable(self, platform: Platform) -> str | None:
        """Why an autostart file cannot name one of the paths it would hold (a sentence
        for the user), or None. A control character (a newline, a tab) splits or ends
        the line naming it: systemd would drop the variable, the tray entry would be
        invalid. A path whose bytes on disk are not UTF-8 (Latin-1 letters, on a UTF-8
        system or a Latin-1 one) cannot be written in these UTF-8 files at all, or comes
        out naming a folder that does not exist."""
        named: list[tuple[str, Path | None]] = [
            ("the program", Path(self.argv[0]) if self.argv else None),
            ("the configuration file", self.config_file),
            ("the data folder", self.data_dir),
            ("the cache folder", self.cache_dir),
            ("the log folder", self.log_dir if platform == "macos" else None),
        ]
        for what, path in named:
            if path is None:
                continue
            text = str(path)
            if any(unicodedata.category(c) == "Cc" for c in text):
                return (
                    f"{what} {text!r} has a control character (a newline or a tab) in its "
                    "path, which an autostart file cannot hold: choose one without"
                )
            try:
                os.fsencode(text).decode("utf-8")
            except UnicodeDecodeError:
                return (
                    f"{what} {text!r} is not named in UTF-8 on disk, and the autostart "
                    "files are UTF-8: rename it, or choose one whose name is"
                )
        return None

    def environment(self) -> dict[str, str]:
        """The environment variables the daemon and the tray are started with."""
        chosen = {
            ENV_CONFIG: self.config_file,
            ENV_DATA_DIR: self.data_dir,
            ENV_CACHE_DIR: self.cache_dir,
        }
        return {name: str(value) for name, value in chosen.items() if value is not None}

    def command(self, verb: str) -> list[str]:
        """The whole command line of ``volunteerd serve`` or ``volunteerd tray``."""
        if verb == "tray" and not self.tray_starts_daemon:
            return [*self.argv, "tray", "--no-start"]
        return [*self.argv, verb]


@dataclass(frozen=True, slots=True)
class Rendered:
    """One file: its name (in ``packaging/<platform>/``), what it starts, its bytes."""

    name: str
    role: Role
    content: bytes


def render(platform: Platform, launch: Launch) -> list[Rendered]:
    """Every autostart file of ``platform`` for ``launch``: the daemon's first."""
    if platform == "linux":
        return [
            Rendered(SYSTEMD_UNIT, "daemon", _systemd_unit(launch).encode()),
            Rendered("volunteerd-tray.desktop", "tray", _desktop_entry(launch).encode()),
            Rendered("volunteerd.svg", "icon", icon_svg()),
        ]
    if platform == "macos":
        return [
            Rendered(f"{DAEMON_LABEL}.plist", "daemon", _launch_agent(launch, "serve")),
            Rendered(f"{TRAY_LABEL}.plist", "tray", _launch_agent(launch, "tray")),
        ]
    return [
        Rendered("volunteerd-daemon.xml", "daemon", _task(launch, "serve")),
        Rendered("volunteerd-tray.xml", "tray", _task(launch, "tray")),
    ]


def icon_svg() -> bytes:
    """The tray entry's icon: the tray's "contributing" picture (``tray/icons.py``)."""
    return resources.files("volunteerd.service").joinpath("volunteerd.svg").read_bytes()


_HEADER = (
    "Written by volunteerd: `volunteerd service install` puts this file in place (and",
    "overwrites changes made here); `volunteerd service render` writes packaging/'s copy.",
)


# -- Linux: systemd user unit ------------------------------------------------------------


def _systemd_unit(launch: Launch) -> str:
    env = "".join(
        f"Environment={_systemd_quote(f'{name}={value}')}\n"
        for name, value in launch.environment().items()
    )
    return f"""\
# {_HEADER[0]}
# {_HEADER[1]}
# Local changes: `systemctl --user edit volunteerd`.
# Exit codes (volunteerd/errors.py): 3 = invalid configuration, do not restart;
# 130 = stopped by SIGINT/SIGTERM, cleanly.
[Unit]
Description=volunteerd: lend this computer to train neural networks together
StartLimitIntervalSec=600
StartLimitBurst=5

[Service]
Type=simple
ExecStart={" ".join(_systemd_quote(arg, command=True) for arg in _systemd_argv(launch))}
{env}WorkingDirectory=%h
Restart=on-failure
RestartSec={RESTART_DELAY_S}
RestartPreventExitStatus=3
SuccessExitStatus=130
KillSignal=SIGTERM
TimeoutStopSec={launch.stop_timeout_s}
{_systemd_priority(launch)}
[Install]
WantedBy=default.target
"""


def _systemd_priority(launch: Launch) -> str:
    if not launch.low_priority:
        return '# runtime.priority = "normal": started at the normal priority\n'
    return f"""\
# Volunteered compute should never slow the desktop down (the daemon lowers its own
# priority to the same: runtime.priority).
Nice={NICE}
IOSchedulingClass=best-effort
IOSchedulingPriority={IO_LEVEL}
"""


def _systemd_argv(launch: Launch) -> list[str]:
    """``serve``'s command line as ExecStart can hold it. systemd takes no quote or
    backslash in the program's name at all, and does not turn ``$$`` back into ``$``
    there ("is not executable"): a program whose path has one is started through
    ``/usr/bin/env``, as an argument, where the usual quoting holds."""
    argv = launch.command("serve")
    if any(c in argv[0] for c in "$\"'\\"):
        return ["/usr/bin/env", *argv]
    return argv


def _systemd_quote(word: str, *, command: bool = False) -> str:
    """One ExecStart (``command``) or Environment word, quoted when needed, its % (and,
    in a command line, $) kept literal: systemd expands specifiers in both and
    variables in command lines only."""
    if word and not any(c in word for c in " \t\n\"'\\;"):
        quoted = word
    else:
        quoted = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    quoted = quoted.replace("%", "%%")
    return quoted.replace("$", "$$") if command else quoted


# -- Linux: XDG autostart entry ------------------------------------------------------------


def _desktop_entry(launch: Launch) -> str:
    command = launch.command("tray")
    env = [f"{name}={value}" for name, value in launch.environment().items()]
    if env:
        command = ["env", *env, *command]
    exec_line = " ".join(_desktop_quote(arg) for arg in command)
    return f"""\
# {_HEADER[0]}
# {_HEADER[1]}
[Desktop Entry]
Type=Application
Version=1.4
Name=volunteerd
GenericName=Volunteer computing
Comment=Shows whether this computer is contributing, and pauses or resumes it
Exec={exec_line}
Icon=volunteerd
Terminal=false
Categories=Utility;
Keywords=volunteer;compute;training;
StartupNotify=false
X-GNOME-Autostart-enabled=true
X-GNOME-Autostart-Delay=5
"""


_DESKTOP_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")


def _desktop_quote(arg: str) -> str:
    """One argument of an Exec key (Desktop Entry Specification, "The Exec key"):
    quoted when it holds a reserved character, then escaped as a string value."""
    if arg and not (_DESKTOP_RESERVED & set(arg)):
        word = arg
    else:
        inner = "".join("\\" + c if c in '"`$\\' else c for c in arg)
        word = f'"{inner}"'
    # The key's value is a "string": a backslash is written \\; a literal % is %%.
    return word.replace("\\", "\\\\").replace("%", "%%")


# -- macOS: LaunchAgents -------------------------------------------------------------------


def _launch_agent(launch: Launch, verb: str) -> bytes:
    daemon = verb == "serve"
    label = DAEMON_LABEL if daemon else TRAY_LABEL
    log = launch.log_dir / ("daemon.log" if daemon else "tray.log")
    agent: dict[str, object] = {
        "Label": label,
        "ProgramArguments": launch.command(verb),
        "RunAtLoad": True,
        # Restart after a crash, never after a clean exit (the tray's Quit, `volunteerd
        # service uninstall`). launchd has no "do not restart on 3": ThrottleInterval
        # spaces out the retries of a daemon whose configuration is invalid.
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 60 if daemon else 10,
        "StandardOutPath": str(log),
        "StandardErrorPath": str(log),
        # "Background" would confine the daemon to the efficiency cores and throttle its
        # I/O; the volunteer chose to give this compute, Nice keeps the desktop snappy.
        "ProcessType": "Standard" if daemon else "Interactive",
    }
    if daemon:
        if launch.low_priority:
            agent["Nice"] = NICE
            agent["LowPriorityIO"] = True
        agent["ExitTimeOut"] = launch.stop_timeout_s
    else:
        agent["LimitLoadToSessionType"] = "Aqua"  # a logged-in desktop only
    # the daemon keeps the file launchd appends its output to bounded (detached.py)
    env = {**launch.environment(), **({LOG_FILE_VARIABLE: str(log)} if daemon else {})}
    if env:
        agent["EnvironmentVariables"] = env
    text = plistlib.dumps(agent, sort_keys=True).decode()
    doctype_end = text.index("\n", text.index("<!DOCTYPE")) + 1
    comment = f"<!-- {_HEADER[0]}\n     {_HEADER[1]} -->\n"
    return (text[:doctype_end] + comment + text[doctype_end:]).encode()


# -- Windows: Task Scheduler ---------------------------------------------------------------


def _task(launch: Launch, verb: str) -> bytes:
    daemon = verb == "serve"
    command = launch.command(verb)
    # Task Scheduler has no environment settings: explicit locations become flags.
    if launch.config_file is not None:
        command.extend(["--config", str(launch.config_file)])
    if launch.data_dir is not None:
        command.extend(["--data-dir", str(launch.data_dir)])
    # list2cmdline quotes as the Microsoft C runtime parses command lines.
    program, arguments = command[0], subprocess.list2cmdline(command[1:])
    what = "lends this computer to train neural networks" if daemon else "shows its tray icon"
    user = escape(launch.user)
    workdir = escape(str(PureWindowsPath(program).parent))
    text = f"""\
<?xml version="1.0" encoding="UTF-16"?>
<!-- {escape(_HEADER[0])}
     {escape(_HEADER[1])} -->
<Task version="1.2" xmlns="{TASK_NAMESPACE}">
  <RegistrationInfo>
    <Author>volunteerd</Author>
    <Source>volunteerd</Source>
    <Description>volunteerd {what}. Started at logon; restarted after a failure.</Description>
    <URI>\\{TASK_FOLDER}\\{"daemon" if daemon else "tray"}</URI>
  </RegistrationInfo>
  <Triggers>
    <LogonTrigger>
      <Enabled>true</Enabled>
      <UserId>{user}</UserId>
      <Delay>{"PT30S" if daemon else "PT10S"}</Delay>
    </LogonTrigger>
  </Triggers>
  <Principals>
    <Principal id="Author">
      <UserId>{user}</UserId>
      <LogonType>InteractiveToken</LogonType>
      <RunLevel>LeastPrivilege</RunLevel>
    </Principal>
  </Principals>
  <Settings>
    <MultipleInstancesPolicy>IgnoreNew</MultipleInstancesPolicy>
    <DisallowStartIfOnBatteries>false</DisallowStartIfOnBatteries>
    <StopIfGoingOnBatteries>false</StopIfGoingOnBatteries>
    <AllowHardTerminate>true</AllowHardTerminate>
    <StartWhenAvailable>false</StartWhenAvailable>
    <RunOnlyIfNetworkAvailable>false</RunOnlyIfNetworkAvailable>
    <IdleSettings>
      <StopOnIdleEnd>false</StopOnIdleEnd>
      <RestartOnIdle>false</RestartOnIdle>
    </IdleSettings>
    <AllowStartOnDemand>true</AllowStartOnDemand>
    <Enabled>true</Enabled>
    <Hidden>false</Hidden>
    <RunOnlyIfIdle>false</RunOnlyIfIdle>
    <WakeToRun>false</WakeToRun>
    <ExecutionTimeLimit>PT0S</ExecutionTimeLimit>
    <Priority>{7 if launch.low_priority or not daemon else 5}</Priority>
    <RestartOnFailure>
      <Interval>PT1M</Interval>
      <Count>3</Count>
    </RestartOnFailure>
  </Settings>
  <Actions Context="Author">
    <Exec>
      <Command>{escape(program)}</Command>
      <Arguments>{escape(arguments)}</Arguments>
      <WorkingDirectory>{workdir}</WorkingDirectory>
    </Exec>
  </Actions>
</Task>
"""
    # schtasks /XML expects UTF-16 (with its byte-order mark) and CRLF line ends.
    return ("\ufeff" + text.replace("\n", "\r\n")).encode("utf-16-le")
