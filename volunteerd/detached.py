"""Start a volunteerd command detached from this process, as a service manager would,
and run the daemon politely.

The tray (starting the daemon when none answers) and ``volunteerd service install``
(starting the daemon or the tray where no service manager does) both start programs
that must outlive them: no terminal, their own session (so a Ctrl-C or the end of the
starter does not stop them), the home folder as their current folder (the systemd
unit's ``WorkingDirectory=%h``: they kept the starter's, even once it was deleted, and
``python -m`` imports from it first), output appended to a log file (made 0600, in a
folder made 0700: it was 0666 under a umask of 000), and the starter's environment
without its ``VOLUNTEERD_<SECTION>__<KEY>`` settings (the daemon a service manager
starts does not see a shell's variables either; the file locations are passed
explicitly). A leaf (of the others it imports ``atomic`` only): the tray may import
nothing else of the daemon's.

Polite by default: ``volunteerd serve`` lowers its own CPU and I/O priority first thing
(``lower_priority``, unless ``runtime.priority = "normal"``), however it was started —
a service unit, this detached start, a terminal — to what the service files ask of
their managers (``service/files.py``: ``Nice=10``, best-effort I/O at level 7):

=========  ==============================  ========================================
platform   CPU                             I/O
=========  ==============================  ========================================
Linux      nice 10 (``setpriority``)       best-effort, level 7 (``ioprio_set``;
                                           else the ``ionice`` tool)
macOS      nice 10                         the "utility" policy (``setiopolicy_np``)
Windows    below normal priority class     follows the priority class
=========  ==============================  ========================================

Linux keeps both per thread, and a thread inherits them from the thread that starts
it: the daemon lowers them before it starts any.

Its log stays bounded: a program started here (and the daemon's macOS LaunchAgent) is
told which file its output goes to (``VOLUNTEERD_LOG_FILE``), and ``OwnLogFile`` keeps
that file under ``LOG_MAX_BYTES`` (10 MiB) by copying it to ``<name>.1`` (the one older
file kept) and emptying it, as logrotate's ``copytruncate`` does: whoever writes to it
(the daemon's output, a tray) keeps its open file. Nothing rotated it: a stranger
repeating a handful of bad requests grew it ~7 MB a day even with repeated lines
summarised. Only a file opened for appending is emptied (POSIX; not on Windows, where
the daemon runs under the Task Scheduler).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from volunteerd.atomic import make_private_dirs

__all__ = [
    "IO_CLASS_BEST_EFFORT",
    "IO_LEVEL",
    "LOG_FILE_VARIABLE",
    "LOG_MAX_BYTES",
    "NICE",
    "OwnLogFile",
    "config_variables",
    "io_priority",
    "lower_priority",
    "start_detached",
]

logger = logging.getLogger(__name__)

NICE = 10  # the service files' Nice=
IO_CLASS_BEST_EFFORT = 2  # Linux's IOPRIO_CLASS_BE (IOSchedulingClass=best-effort)
IO_LEVEL = 7  # the lowest level of that class (IOSchedulingPriority=7)

# ioprio_set and ioprio_get by machine (the kernel's syscall tables; the generic table
# of the newer architectures has them at 30 and 31).
_IOPRIO_SYSCALLS = {
    "x86_64": (251, 252),
    "amd64": (251, 252),
    "i386": (289, 290),
    "i686": (289, 290),
    "aarch64": (30, 31),
    "arm64": (30, 31),
    "riscv64": (30, 31),
    "loongarch64": (30, 31),
    "armv7l": (314, 315),
    "armv6l": (314, 315),
    "ppc64le": (273, 274),
    "ppc64": (273, 274),
    "s390x": (282, 283),
}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_SHIFT = 13

LOG_FILE_VARIABLE = "VOLUNTEERD_LOG_FILE"
LOG_MAX_BYTES = 10 << 20

# The prefix of the configuration's environment variables (volunteerd.config.loading
# reads the same names; tests/unit/test_service_process.py checks that they agree).
_PREFIX = "VOLUNTEERD_"


def config_variables(environ: Mapping[str, str]) -> list[str]:
    """The ``VOLUNTEERD_<SECTION>__<KEY>`` variables set in ``environ``."""
    return sorted(
        name for name in environ if name.startswith(_PREFIX) and "__" in name[len(_PREFIX) :]
    )


def start_detached(
    command: Sequence[str], log_file: Path, environment: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session with no terminal, in the home folder, its
    output appended to ``log_file`` (named in its ``VOLUNTEERD_LOG_FILE``), and this
    process's environment less its configuration variables plus ``environment``. It
    outlives this process. Paths in ``command`` and ``environment`` must be absolute."""
    env = {k: v for k, v in os.environ.items() if k not in config_variables(os.environ)}
    env.update(environment)
    env[LOG_FILE_VARIABLE] = str(log_file)
    make_private_dirs(log_file.parent)
    detach: dict[str, object] = {"start_new_session": True}
    if sys.platform == "win32":  # pragma: no cover - Windows uses Task Scheduler
        flags = subprocess.DETACHED_PROCESS | subprocess.CREATE_NEW_PROCESS_GROUP  # type: ignore[attr-defined,unused-ignore]
        detach = {"creationflags": flags}
    home = Path.home()
    # 0600 whatever the umask: it holds the daemon's log (0666 under a umask of 000)
    fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with open(fd, "ab") as out:
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return,unused-ignore]
            list(command),
            cwd=home if home.is_dir() else Path("/"),  # "/": a service manager's default
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            **detach,
        )


def lower_priority() -> list[str]:
    """Lower this process's CPU and I/O priority as the module docstring says (never
    raising one that is lower already). Call it before any thread starts. Returns what
    was done, for the log; what cannot be done is skipped (logged at debug level)."""
    done = []
    if sys.platform == "win32":  # pragma: no cover - Windows
        below_normal = 0x4000  # BELOW_NORMAL_PRIORITY_CLASS
        kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined,unused-ignore]
        if kernel32.SetPriorityClass(kernel32.GetCurrentProcess(), below_normal):
            done.append("below normal priority")
        else:
            logger.debug("SetPriorityClass failed: %s", ctypes.GetLastError())  # type: ignore[attr-defined,unused-ignore]
        return done
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) < NICE:
            os.setpriority(os.PRIO_PROCESS, 0, NICE)
        done.append(f"nice {os.getpriority(os.PRIO_PROCESS, 0)}")
    except OSError as exc:
        logger.debug("cannot lower the CPU priority: %s", exc)
    if sys.platform == "darwin":  # pragma: no cover - macOS
        done.extend(_darwin_io_policy())
    elif sys.platform.startswith("linux"):
        done.extend(_linux_io_priority())
    return done


def io_priority(pid: int = 0) -> tuple[int, int] | None:
    """Linux: the I/O scheduling class and level of thread ``pid`` (0: the calling
    one), e.g. ``(2, 7)``; None where it cannot be read."""
    numbers = _IOPRIO_SYSCALLS.get(platform.machine().lower())
    if numbers is None or not sys.platform.startswith("linux"):
        return None
    value = _libc().syscall(numbers[1], _IOPRIO_WHO_PROCESS, pid)
    if value < 0:
        return None
    return value >> _IOPRIO_CLASS_SHIFT, value & ((1 << _IOPRIO_CLASS_SHIFT) - 1)


def _linux_io_priority() -> list[str]:
    current = io_priority()
    # class 3 (idle) is lower still; 0 (none) reads as best-effort at a level from nice
    if current is not None and (current[0] == 3 or current == (IO_CLASS_BEST_EFFORT, IO_LEVEL)):
        return []
    wanted = IO_CLASS_BEST_EFFORT << _IOPRIO_CLASS_SHIFT | IO_LEVEL
    numbers = _IOPRIO_SYSCALLS.get(platform.machine().lower())
    if numbers is not None:
        if _libc().syscall(numbers[0], _IOPRIO_WHO_PROCESS, 0, wanted) == 0:
            return [f"I/O best-effort {IO_LEVEL}"]
        logger.debug("ioprio_set failed: %s", os.strerror(ctypes.get_errno()))
    ionice = shutil.which("ionice")
    if ionice is None:
        logger.debug("cannot lower the I/O priority: no ioprio_set here and no ionice tool")
        return []
    tool = [ionice, "-c", str(IO_CLASS_BEST_EFFORT), "-n", str(IO_LEVEL), "-p", str(os.getpid())]
    if subprocess.run(tool, capture_output=True, check=False).returncode != 0:
        logger.debug("cannot lower the I/O priority: %s failed", " ".join(tool))
        return []
    return [f"I/O best-effort {IO_LEVEL} (ionice)"]


def _darwin_io_policy() -> list[str]:  # pragma: no cover - macOS
    iopol_type_disk, iopol_scope_process, iopol_utility = 0, 0, 4
    if _libc().setiopolicy_np(iopol_type_disk, iopol_scope_process, iopol_utility) == 0:
        return ["I/O policy utility"]
    logger.debug("setiopolicy_np failed: %s", os.strerror(ctypes.get_errno()))
    return []


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class OwnLogFile:
    """The file this process's output (descriptors 1 and 2) is appended to, kept under
    ``max_bytes`` (see the module's docstring)."""

    def __init__(self, path: Path, max_bytes: int = LOG_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.older = path.with_name(path.name + ".1")

    @classmethod
    def named(cls, environ: Mapping[str, str] = os.environ) -> OwnLogFile | None:
        """The file ``VOLUNTEERD_LOG_FILE`` names, if this process's error output is
        appended to it; else None (a terminal, a journal, a file opened otherwise)."""
        name = environ.get(LOG_FILE_VARIABLE)
        if not name or sys.platform == "win32":
            return None
        try:
            import fcntl

            same = os.path.samestat(os.fstat(2), os.stat(name))
            appending = bool(fcntl.fcntl(2, fcntl.F_GETFL) & os.O_APPEND)
        except (OSError, ValueError):
            return None
        if not (same and appending):
            logger.debug("%s is not where this process appends its output", name)
            return None
        return cls(Path(name))

    def bound(self) -> bool:
        """(Blocking.) Past ``max_bytes``, copy the file to ``<name>.1`` and empty it;
        True when it did. A failure is logged and tried again at the next call."""
        try:
            if os.fstat(2).st_size <= self.max_bytes:
                return False
            sys.stdout.flush()
            sys.stderr.flush()
            copy = self.older.with_name(self.older.name + ".tmp")
            shutil.copyfile(self.path, copy)
            os.replace(copy, self.older)
            os.ftruncate(2, 0)
        except OSError as exc:
            logger.warning("could not start %s afresh: %s", self.path, exc)
            return False
        logger.info(
            "%s passed %d MiB: its lines so far are in %s",
            self.path,
            self.max_bytes >> 20,
            self.older,
        )
        return True
