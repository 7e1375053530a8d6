"""Every file location volunteerd uses, with one name each. The only user of appdirs.

A location comes from, in order: an explicit argument (a command-line flag), an
environment variable, then the platform's per-user directory (XDG on Linux,
``~/Library/Application Support`` on macOS, ``%LOCALAPPDATA%`` on Windows).

On Linux the per-user directories are the XDG base directories (``xdg_home``):
``$XDG_CONFIG_HOME``, ``$XDG_DATA_HOME`` and ``$XDG_CACHE_HOME`` where they hold an
absolute path, else ``~/.config``, ``~/.local/share`` and ``~/.cache``. The spec says
an empty or relative value is invalid and must be ignored; appdirs took it as it was,
so ``XDG_DATA_HOME=`` (empty) put the data folder, the identity key with it, in the
current folder: a daemon started from another folder made a new identity. The service
files (``service/managers.py``) follow the same rule, so the unit, the tray's entry and
its icon land beside the data they belong to.

The data folder is private (``Paths.make_data_dir``): made 0700, and made 0700 again
where group or others may write to it. In a folder anyone may write to, anyone may
replace ``identity.key`` or ``api-token`` by a file of theirs (a rename needs the right
to write to the folder, not to the file); under a umask of 000 volunteerd made its data
folder so itself (an outside audit). Other folders of ours are made 0700 when they are
made (``atomic.make_private_dirs``); folders that exist, the data folder aside, are left
as their owner set them.

=====================  ==============================  ======================
name                   default                         override
=====================  ==============================  ======================
``config_file``        <user config dir>/config.toml   ``--config``, ``VOLUNTEERD_CONFIG``
``limits_file``        <data dir>/limits.toml          (limits set at run time)
``schedule_file``      <data dir>/schedule.toml        (the schedule set at run time)
``data_dir``           <user data dir>                 ``--data-dir``, ``VOLUNTEERD_DATA_DIR``
``identity_file``      <data dir>/identity.key
``lock_file``          <data dir>/volunteerd.lock      (held while a node runs; names its pid)
``checkpoints_dir``    <data dir>/checkpoints
``downloads_dir``      <data dir>/downloads            (expert state from replicas)
``trainers_dir``       <data dir>/trainers             (`volunteerd train`'s own state)
``state_file``         <data dir>/state.json           (paused or snoozed, kept on restart)
``projects_file``      <data dir>/projects.toml        (projects joined: `volunteerd join`)
``manifests_file``     <data dir>/manifests.json       (when each project's last manifest expires)
``transfer_file``      <data dir>/transfer.json        (bytes this month, for the quota)
``stats_file``         <data dir>/stats.sqlite3        (contribution accounting)
``token_file``         <data dir>/api-token            (the control API's token, 0600)
``control_file``       <data dir>/control.json         (the control API's address, while up)
``daemon_log_file``    <data dir>/daemon.log           (output of a daemon the tray started)
``tray_pid_file``      <data dir>/tray.pid             (the running tray's pid)
``cache_dir``          <user cache dir>                ``VOLUNTEERD_CACHE_DIR``
=====================  ==============================  ======================
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import appdirs

from volunteerd.atomic import make_private_dirs, read_small

APP_NAME = "volunteerd"
ENV_CONFIG = "VOLUNTEERD_CONFIG"
ENV_DATA_DIR = "VOLUNTEERD_DATA_DIR"
ENV_CACHE_DIR = "VOLUNTEERD_CACHE_DIR"
# Set by a restart in place only, for the program it executes: the descriptor of the data
# folder's lock it keeps (``DataDirLock.hand_over``), "" where none could be kept.
ENV_LOCK_FD = "VOLUNTEERD_LOCK_FD"

# How long a start waits for the data folder's lock when another process has it: a
# restart in place whose lock could not be handed over, for the old process to end
# (Windows); anyone else, for ``lock_holder``'s test of it to end (a moment).
RESTART_LOCK_WAIT_S = 10.0
CONTENDED_LOCK_WAIT_S = 0.5

# appdirs' name for each per-user directory -> the XDG variable and its default
_XDG_HOMES = {
    "config": ("XDG_CONFIG_HOME", ".config"),
    "data": ("XDG_DATA_HOME", ".local/share"),
    "cache": ("XDG_CACHE_HOME", ".cache"),
}


def xdg_home(variable: str, default: str, environ: Mapping[str, str] | None = None) -> Path:
    """The XDG base directory ``variable`` names (``XDG_DATA_HOME``...) if it holds an
    absolute path, else ``~/<default>``: the spec says an empty or relative value is
    invalid and must be ignored."""
    value = (os.environ if environ is None else environ).get(variable, "")
    return Path(value) if value and Path(value).is_absolute() else Path.home() / default


def _user_dir(kind: str) -> Path:
    """This platform's per-user ``kind`` ("config", "data", "cache") folder of ours."""
    if appdirs.system in ("win32", "darwin"):
        user_dir: Callable[[str], str] = getattr(appdirs, f"user_{kind}_dir")
        return Path(user_dir(APP_NAME))
    return xdg_home(*_XDG_HOMES[kind]) / APP_NAME


@dataclass(frozen=True, slots=True)
class Paths:
    config_file: Path
    data_dir: Path
    cache_dir: Path

    @property
    def identity_file(self) -> Path:
        return self.data_dir / "identity.key"

    @property
    def lock_file(self) -> Path:
        return self.data_dir / "volunteerd.lock"

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def trainers_dir(self) -> Path:
        return self.data_dir / "trainers"

    @property
    def downloads_dir(self) -> Path:
        return self.data_dir / "downloads"

    @property
    def limits_file(self) -> Path:
        # the data folder's, not the config folder's: two daemons may share a config file
        return self.data_dir / "limits.toml"

    @property
    def old_limits_file(self) -> Path:
        """Where ``limits_file`` lived before it moved to the data folder."""
        return self.config_file.parent / "limits.toml"

    def adopt_old_limits_file(self, check: Callable[[Path], object] | None = None) -> bool:
        """Move ``old_limits_file`` into the data folder, once: when it exists, passes
        ``check`` (the CLI's: it holds limits as volunteerd wrote them), and the data
        folder has none. The first daemon to start after the move takes it (the one
        whose limits it most likely holds: the installed one starts first). Returns
        whether it moved. Raises OSError, and whatever ``check`` raises for a file that
        is no ``limits.toml`` of volunteerd's (another program's, beside a ``--config``
        file): it stays where it is, unread."""
        old, new = self.old_limits_file, self.limits_file
        if old == new or not old.exists() or new.exists():
            return False
        if check is not None:
            try:
                check(old)
            except FileNotFoundError:  # gone since exists()
                return False
        make_private_dirs(new.parent)
        try:
            os.rename(old, new)  # atomic: of two daemons starting at once, one takes it
        except FileNotFoundError:
            return False
        return True

    def make_data_dir(self) -> str | None:
        """Make the data folder (and its missing parents) 0700, or make an existing one
        that group or others may write to 0700 (see the module docstring). Returns what
        it changed or could not, for the log, else None: a folder made private says so
        once, it stays so. Raises OSError (the folder cannot be made)."""
        make_private_dirs(self.data_dir)
        mode = stat.S_IMODE(self.data_dir.stat().st_mode)
        if os.name != "posix" or not mode & 0o022:
            return None
        try:
            self.data_dir.chmod(0o700)
        except OSError as exc:
            return (
                f"the data folder {self.data_dir} (mode {mode:04o}) may be written by "
                f"others, who could replace its identity.key; it cannot be changed: {exc}"
            )
        return (
            f"made the data folder {self.data_dir} private (mode {mode:04o} -> 0700): "
            "others could write to it, and replace its identity.key"
        )

    @property
    def schedule_file(self) -> Path:
        # beside limits.toml, wherever that lives: config.loading reads both from there
        return self.limits_file.with_name("schedule.toml")

    @property
    def state_file(self) -> Path:
        return self.data_dir / "state.json"

    @property
    def projects_file(self) -> Path:
        return self.data_dir / "projects.toml"

    @property
    def manifests_file(self) -> Path:
        return self.data_dir / "manifests.json"

    @property
    def transfer_file(self) -> Path:
        return self.data_dir / "transfer.json"

    @property
    def stats_file(self) -> Path:
        return self.data_dir / "stats.sqlite3"

    @property
    def token_file(self) -> Path:
        return self.data_dir / "api-token"

    @property
    def control_file(self) -> Path:
        return self.data_dir / "control.json"

    @property
    def daemon_log_file(self) -> Path:
        return self.data_dir / "daemon.log"

    @property
    def tray_pid_file(self) -> Path:
        return self.data_dir / "tray.pid"

    # tray.pid's format (the pid in decimal, then a newline) is written and read here
    # only: the tray names itself in it while it runs, holding the file's lock;
    # `volunteerd service` reads it to stop the tray, and `volunteerd tray` not to start
    # a second one (checking first that the process is a tray: a stale pid may have been
    # reused).

    def hold_tray_pid(self, pid: int) -> int | None:
        """Take ``tray_pid_file``'s lock without waiting and name ``pid`` in it: the
        open descriptor holding the lock (closing it lets go), or None when another
        process holds it (a tray started at the same moment: the check of the pid a
        moment before cannot see it). The file is written in place, not replaced: a
        new file would be a new lock. Makes the data folder if need be. Raises OSError (a
        read-only disk)."""
        make_private_dirs(self.data_dir)
        for _ in range(3):  # the file was removed (a tray quit) between open and lock
            fd = os.open(self.tray_pid_file, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                _lock(fd)
            except OSError:
                os.close(fd)
                return None
            try:
                if os.path.samestat(os.fstat(fd), os.stat(self.tray_pid_file)):
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{pid}\n".encode())
                    return fd
            except FileNotFoundError:
                pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        return None

    def read_tray_pid(self) -> int | None:
        """The pid ``tray_pid_file`` names, or None (no file, or not a pid)."""
        try:
            return int(read_small(self.tray_pid_file, 4096).strip())
        except (OSError, ValueError):
            return None

    def remove_tray_pid(self, pid: int) -> None:
        """Remove ``tray_pid_file`` if it still names ``pid`` (not taken over by a
        newer tray)."""
        if self.read_tray_pid() == pid:
            self.tray_pid_file.unlink(missing_ok=True)

    @classmethod
    def resolve(
        cls, *, config_file: str | Path | None = None, data_dir: str | Path | None = None
    ) -> Paths:
        """Locations from flags, then the environment, then the platform defaults."""
        config = config_file or os.environ.get(ENV_CONFIG)
        data = data_dir or os.environ.get(ENV_DATA_DIR)
        cache = os.environ.get(ENV_CACHE_DIR)
        return cls(
            config_file=Path(config).expanduser()
            if config
            else _user_dir("config") / "config.toml",
            data_dir=Path(data).expanduser() if data else _user_dir("data"),
            cache_dir=Path(cache).expanduser() if cache else _user_dir("cache"),
        )

    def as_dict(self) -> dict[str, str]:
        return {
            "config_file": str(self.config_file),
            "data_dir": str(self.data_dir),
            "identity_file": str(self.identity_file),
            "lock_file": str(self.lock_file),
            "checkpoints_dir": str(self.checkpoints_dir),
            "downloads_dir": str(self.downloads_dir),
            "trainers_dir": str(self.trainers_dir),
            "limits_file": str(self.limits_file),
            "schedule_file": str(self.schedule_file),
            "state_file": str(self.state_file),
            "projects_file": str(self.projects_file),
            "transfer_file": str(self.transfer_file),
            "stats_file": str(self.stats_file),
            "token_file": str(self.token_file),
            "control_file": str(self.control_file),
            "daemon_log_file": str(self.daemon_log_file),
            "tray_pid_file": str(self.tray_pid_file),
            "cache_dir": str(self.cache_dir),
        }


class DataDirLock:
    """``with DataDirLock(paths.lock_file) as lock:`` holds an exclusive lock on the file
    while a node uses its data folder.

    Two nodes sharing one data folder would share one identity (and its checkpoints and
    statistics); the second one to start gets ResourceUnavailable. The operating system
    releases the lock when the process dies, even by SIGKILL.

    A restart in place (``volunteerd serve`` executing itself again after a join or a
    leave) keeps the lock: ``hand_over`` leaves its descriptor open across the exec, and
    the new program, given its number as ``handed_over`` (from ``ENV_LOCK_FD``), adopts
    it once it has checked that the descriptor is this lock file's and holds the lock.
    Let go before the exec and taken again after it, the lock was free for the 2-5 s the
    new program took to start; a ``volunteerd serve`` started then (the tray offered it)
    took the folder, and the restarted daemon exited "another volunteerd is using ...".
    Where a lock cannot be kept across the exec (Windows, where ``execv`` starts a new
    process and ends the old one, and its lock with it), the new program waits up to
    ``RESTART_LOCK_WAIT_S`` for it. Any other start waits ``CONTENDED_LOCK_WAIT_S``
    before it gives up: ``lock_holder`` (the tray, ``volunteerd status``) takes the lock
    for a moment to test it.
    """

    def __init__(self, path: Path, *, handed_over: str | None = None) -> None:
        self._path = path
        self._handed_over = handed_over
        self._fd: int | None = None

    def __enter__(self) -> DataDirLock:
        from volunteerd.errors import ResourceUnavailable

        make_private_dirs(self._path.parent)
        if self._handed_over is not None:
            self._fd = _adopt(self._path, self._handed_over)
            if self._fd is not None:  # it names this process already: execv keeps the pid
                return self
        wait_s = CONTENDED_LOCK_WAIT_S if self._handed_over is None else RESTART_LOCK_WAIT_S
        deadline = time.monotonic() + wait_s
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    _lock(fd)
                    break
                except OSError:
                    if time.monotonic() >= deadline:
                        raise ResourceUnavailable(
                            f"another volunteerd is using {self._path.parent} "
                            "(use --data-dir for a second node)"
                        ) from None
                    time.sleep(0.05)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def hand_over(self) -> int | None:
        """Keep the lock across an exec of this process: its descriptor, left open and
        made inheritable (``__exit__`` no longer closes it), for the new program to adopt
        (``handed_over``). None where a lock cannot outlive its process (Windows): it is
        let go here. Raises RuntimeError when the lock is not held."""
        if self._fd is None:
            raise RuntimeError(f"the lock {self._path} is not held")
        fd, self._fd = self._fd, None
        if os.name != "posix":  # pragma: no cover - Windows
            os.close(fd)
            return None
        os.set_inheritable(fd, True)
        return fd


def _adopt(path: Path, handed_over: str) -> int | None:
    """The descriptor a restart in place handed over (its number, ``handed_over``),
    holding the lock on ``path``; None where it cannot be adopted: no number, no such
    descriptor, another file (left open: not ours), or the lock is another process's."""
    try:
        fd = int(handed_over)
        ours = os.path.samestat(os.fstat(fd), os.stat(path))
    except (ValueError, OSError):
        return None
    if not ours:
        return None
    try:
        _lock(fd)  # holds it already (flock: the same open file, kept by the exec): no-op
    except OSError:
        os.close(fd)
        return None
    os.set_inheritable(fd, False)  # as every descriptor Python opens
    return fd


@dataclass(frozen=True, slots=True)
class LockHolder:
    """The process holding a data folder's lock: a volunteerd using that folder.
    ``pid`` is the one it wrote into the lock file; None where that cannot be read
    (Windows keeps a locked byte from other processes) or is not written yet."""

    pid: int | None


def lock_holder(path: Path) -> LockHolder | None:
    """Who holds the lock of ``DataDirLock(path)``, or None when nobody does. Found by
    trying to take the lock without blocking and letting it go at once, so it holds
    whatever started a daemon, with the control API on or off; unlike a pid or a
    command line, a lock cannot outlive its process. Creates nothing. A lock file that
    cannot be opened (but is there) counts as held by an unknown process: too little
    is known to say that no daemon runs."""
    try:
        # for writing, as DataDirLock: over NFS an exclusive lock needs it
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return LockHolder(None)
    try:
        _lock(fd)
    except OSError:
        pass  # held
    else:
        _unlock(fd)
        return None
    finally:
        os.close(fd)
    try:
        pid = int(read_small(path, 64).strip())
    except (OSError, ValueError):
        return LockHolder(None)
    return LockHolder(pid if pid > 0 else None)


if os.name == "posix":
    import fcntl

    def _lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)

else:  # pragma: no cover - Windows
    import msvcrt

    def _lock(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]

    def _unlock(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)  # type: ignore[attr-defined]
