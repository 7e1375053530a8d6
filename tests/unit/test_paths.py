"""Where volunteerd's files go (volunteerd/paths.py), from the environment it runs in,
and who may touch them."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import appdirs
import pytest

from volunteerd import cli
from volunteerd.atomic import write_atomic
from volunteerd.detached import start_detached
from volunteerd.errors import ResourceUnavailable
from volunteerd.paths import (
    ENV_CACHE_DIR,
    ENV_CONFIG,
    ENV_DATA_DIR,
    DataDirLock,
    LockHolder,
    Paths,
    lock_holder,
    xdg_home,
)
from volunteerd.service.managers import Systemd

XDG = ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Linux home with no volunteerd or XDG settings, and a current folder elsewhere."""
    monkeypatch.setattr(appdirs, "system", "linux")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in (*XDG, ENV_CONFIG, ENV_DATA_DIR, ENV_CACHE_DIR):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path / "home"


def test_absolute_xdg_variables_are_followed(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in XDG:
        monkeypatch.setenv(name, f"/x/{name}")
    paths = Paths.resolve()
    assert paths.config_file == Path("/x/XDG_CONFIG_HOME/volunteerd/config.toml")
    assert paths.data_dir == Path("/x/XDG_DATA_HOME/volunteerd")
    assert paths.cache_dir == Path("/x/XDG_CACHE_HOME/volunteerd")


@pytest.mark.parametrize("value", ["", "relative", "./here", "~/tilde"])
def test_empty_or_relative_xdg_variables_mean_the_home_defaults(
    home: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    # XDG_DATA_HOME= (empty) put the identity key in whichever folder a command ran from
    for name in XDG:
        monkeypatch.setenv(name, value)
    paths = Paths.resolve()
    assert paths.config_file == home / ".config/volunteerd/config.toml"
    assert paths.data_dir == home / ".local/share/volunteerd"
    assert paths.cache_dir == home / ".cache/volunteerd"
    assert all(Path(p).is_absolute() for p in paths.as_dict().values())


def test_flags_and_volunteerd_variables_come_before_xdg(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", "")
    monkeypatch.setenv(ENV_CACHE_DIR, "/c")
    monkeypatch.setenv(ENV_DATA_DIR, "/d")
    assert Paths.resolve().data_dir == Path("/d")
    assert Paths.resolve(data_dir="/flag").data_dir == Path("/flag")
    assert Paths.resolve().cache_dir == Path("/c")


def test_the_tray_icon_goes_beside_the_data_folder(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for value in ("", "relative", str(home / "elsewhere")):
        monkeypatch.setenv("XDG_DATA_HOME", value)
        data_home = Paths.resolve().data_dir.parent
        icon = Systemd().locations(Paths.resolve())["volunteerd.svg"]
        assert icon.is_relative_to(data_home), (value, icon, data_home)
        assert data_home == xdg_home("XDG_DATA_HOME", ".local/share")


def test_macos_keeps_its_own_folders(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(appdirs, "system", "darwin")
    monkeypatch.setenv("XDG_DATA_HOME", "/x")
    assert Paths.resolve().data_dir == home / "Library/Application Support/volunteerd"


# -- private files ---------------------------------------------------------------------------


@pytest.fixture
def umask_000() -> Iterator[None]:
    """The loosest umask: what volunteerd makes is as private as it makes it itself."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX modes")


@posix_only
@pytest.mark.usefixtures("umask_000")
def test_the_data_folder_and_its_missing_parents_are_made_private(tmp_path: Path) -> None:
    # under a umask of 000 they were 0777: another user could move a key over identity.key
    (tmp_path / "home").mkdir(mode=0o755)
    paths = Paths(tmp_path / "c.toml", tmp_path / "home/.local/share/volunteerd", tmp_path)
    assert paths.make_data_dir() is None
    assert mode(paths.data_dir) == 0o700
    assert mode(tmp_path / "home/.local/share") == 0o700
    assert mode(tmp_path / "home/.local") == 0o700
    assert mode(tmp_path / "home") == 0o755  # there already: the user's, left as it was


@posix_only
@pytest.mark.usefixtures("umask_000")
def test_a_data_folder_others_may_write_to_is_made_private_and_said_once(tmp_path: Path) -> None:
    paths = Paths(tmp_path / "c.toml", tmp_path / "data", tmp_path)
    paths.data_dir.mkdir(mode=0o777)
    note = paths.make_data_dir()
    assert note is not None
    assert f"{paths.data_dir} private (mode 0777 -> 0700)" in note
    assert mode(paths.data_dir) == 0o700
    assert paths.make_data_dir() is None
    paths.data_dir.chmod(0o755)  # readable by others, as the user set it: not ours to change
    assert paths.make_data_dir() is None
    assert mode(paths.data_dir) == 0o755


@posix_only
@pytest.mark.usefixtures("umask_000")
def test_folders_made_for_our_files_are_private(tmp_path: Path) -> None:
    # e.g. ~/.config/systemd/user for the unit: 0777 let another user replace it
    unit = tmp_path / "config/systemd/user/volunteerd.service"
    write_atomic(unit, "[Service]\n")
    assert [mode(p) for p in (unit, unit.parent, unit.parent.parent)] == [0o600, 0o700, 0o700]
    with DataDirLock(tmp_path / "data/volunteerd.lock"):
        assert mode(tmp_path / "data") == 0o700
        assert mode(tmp_path / "data/volunteerd.lock") == 0o600


@posix_only
@pytest.mark.usefixtures("umask_000")
def test_a_detached_daemons_log_is_its_users_only(tmp_path: Path) -> None:
    log = tmp_path / "data/daemon.log"
    child = start_detached([sys.executable, "-c", "print('started')"], log, {})
    assert child.wait(30) == 0
    assert log.read_text() == "started\n"
    assert (mode(log), mode(log.parent)) == (0o600, 0o700)


@posix_only
@pytest.mark.parametrize(("before", "after"), [(0o000, 0o077), (0o022, 0o077), (0o277, 0o277)])
def test_serve_and_service_install_make_private_files(before: int, after: int) -> None:
    old = os.umask(before)
    try:
        cli._private_files()
        assert os.umask(old) == after
    finally:
        os.umask(old)


# -- the data folder's lock across a restart in place --------------------------------------

# A daemon restarting in place, as ``volunteerd serve`` does: it takes the lock, hands it
# over and executes itself again; the new program adopts it. Each step waits for a line
# on stdin, so that the test can look at the lock in between.
_RESTARTING = """
import os, sys
from pathlib import Path
from volunteerd.paths import ENV_LOCK_FD, DataDirLock

handed_over = os.environ.pop(ENV_LOCK_FD, None)
with DataDirLock(Path(sys.argv[1]), handed_over=handed_over) as lock:
    print("adopted" if handed_over else "locked", len(os.listdir("/proc/self/fd")), flush=True)
    sys.stdin.readline()
    if handed_over is None:
        os.environ[ENV_LOCK_FD] = str(lock.hand_over())
        os.execv(sys.executable, sys.orig_argv)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
def test_a_restart_in_place_keeps_the_data_folders_lock_throughout(tmp_path: Path) -> None:
    # Let go before the exec and taken again after it, the lock was free while the new
    # program started: a `volunteerd serve` started then took the folder, and the
    # restarted daemon exited.
    lock_file = tmp_path / "data" / "volunteerd.lock"
    with subprocess.Popen(
        [sys.executable, "-c", _RESTARTING, str(lock_file)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as child:  # fmt: skip
        stdin, stdout = child.stdin, child.stdout
        assert stdin is not None
        assert stdout is not None
        first, fds = stdout.readline().split()
        assert first == "locked"
        assert lock_holder(lock_file) == LockHolder(child.pid)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(stdout.readline()))
        reader.start()
        stdin.write("restart\n")
        stdin.flush()
        seen = set()
        while reader.is_alive():  # until the new program has adopted it
            seen.add(lock_holder(lock_file))
        assert seen <= {LockHolder(child.pid)}, "the lock was free, or another's, meanwhile"
        again, fds_again = lines[0].split()
        assert again == "adopted"
        assert fds_again == fds  # the descriptor kept: no second one opened beside it
        with pytest.raises(ResourceUnavailable, match="another volunteerd is using"):
            DataDirLock(lock_file).__enter__()
        stdin.close()
        assert child.wait(30) == 0
    assert lock_holder(lock_file) is None


def test_a_descriptor_that_is_not_the_locks_is_not_adopted_and_left_open(tmp_path: Path) -> None:
    lock_file = tmp_path / "volunteerd.lock"
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for handed_over in (str(other), "", "x", "-1", "99999"):
            with DataDirLock(lock_file, handed_over=handed_over):  # taken afresh
                assert lock_holder(lock_file) == LockHolder(os.getpid())
            assert lock_holder(lock_file) is None
        os.fstat(other)  # still open: not ours to close
    finally:
        os.close(other)


def test_a_restart_whose_lock_could_not_be_kept_waits_for_it(tmp_path: Path) -> None:
    # Windows: execv starts a new process and ends the old one, its lock with it
    lock_file = tmp_path / "volunteerd.lock"
    old = DataDirLock(lock_file).__enter__()
    threading.Timer(0.5, old.__exit__).start()  # the old process ending
    started = time.monotonic()
    with DataDirLock(lock_file, handed_over=""):
        assert time.monotonic() - started >= 0.4
        assert lock_holder(lock_file) == LockHolder(os.getpid())
